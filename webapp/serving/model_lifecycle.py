"""Load, unload and reload the one model a worker serves: :class:`ModelHost`, which
:class:`.runtime.WorkerRuntime` holds.

Why the process outlives its engine: a worker may start with a model or with none
(``idle``), and takes load / unload / reload commands from its command list
(:mod:`.commands`) on a thread of its own (:mod:`.command_loop`). A load builds the engine
on a new engine-loop thread (``loading``), then starts taking the model's requests from its
queues (``ready``; :mod:`.dispatcher`); if building fails, the error is kept for the heartbeat (``failed``) and the
worker stays as it was without a model, ready for the next command. An unload first stops
taking requests, then ends the engine's requests (running and backlogged) with an error
saying so, adds the model's last counter increments to its totals, and drops the engine
(its weights and KV cache) before the worker reports ``idle``.
"""
from __future__ import annotations

import gc
import logging
import os
import signal
import threading
import time
from typing import Any, Callable

import torch

from inference import EngineArgs

from . import held
from .dispatcher import Dispatcher, reclaimer
from .engine_loop import EngineLoop
from .io_loop import WorkerIO
from .lora_registry import AdapterEntry, adapters_of
from .model_spec import ModelSpec
from .tenant_shares import TenantShares

logger = logging.getLogger(__name__)

UNLOADED = "The model was unloaded from this worker; retry the request."
IDLE, LOADING, READY, UNLOADING, FAILED = "idle", "loading", "ready", "unloading", "failed"
MIN_DEFAULT_BACKLOG = 64  # requests


def default_max_waiting_requests(max_num_seqs: int) -> int:
    """The backlog a worker keeps when ``--max-waiting-requests`` is not given, in requests:
    ``max(2 * max_num_seqs, 64)``.

    At least ``max_num_seqs``, so that a whole batch finishing at once (same ``max_tokens``) is
    refilled from the engine's own waiting queue in the next step; twice that, so that the
    batch after it is already waiting too while the worker takes more from Redis. The mix of
    tenants in the backlog follows their shares whatever its depth (:mod:`.dispatcher`). Not
    deeper: a request in one worker's backlog cannot move to another worker that has room
    (only a dead worker's backlog is requeued), so a longer backlog spreads a burst less evenly
    over the model's workers.
    """
    return max(2 * max_num_seqs, MIN_DEFAULT_BACKLOG)


class ModelHost:
    """The engine of the model a worker serves (none while ``idle`` or ``failed``), its step-loop
    thread, the dispatcher that feeds it from the model's queues and the reclaimer of its dead
    workers' requests; :meth:`load` and :meth:`unload` move it between the states.

    Args:
        base_args: the worker's engine flags; a loaded model's :class:`ModelSpec` is laid over them.
        engine_builder: builds an ``inference.LLMEngine`` from ``EngineArgs`` (called on the
            engine-loop thread).
        io: the worker's I/O thread (publishes the engine's outputs, its requests' ledger).
        redis_url: Redis of the model's queues.
        worker_id: this worker's id (its claims and held records).
        closing: set once the worker shuts down (an engine failure sets it too).
        max_waiting_requests: the engine's backlog beyond ``max_num_seqs``, in requests; None:
            :func:`default_max_waiting_requests` of the loaded model's ``max_num_seqs``.

    Attributes:
        state: ``idle``, ``loading``, ``ready``, ``unloading`` or ``failed`` (idle, with the
            last load's ``error``).
        spec: the model loading or served, None without one.
        ready_at: ``time.time()`` when the current model became ready.
    """

    def __init__(self, base_args: EngineArgs, engine_builder: Callable[[EngineArgs], Any], io: WorkerIO,
                 redis_url: str, worker_id: str, closing: threading.Event,
                 max_waiting_requests: int | None = None) -> None:
        self.base_args = base_args
        self.max_waiting_requests = max_waiting_requests
        self.worker_id = worker_id
        self.io = io
        self.closing = closing
        self._redis_url = redis_url
        self._build_engine = engine_builder
        self._lock = threading.Lock()  # admission against unload: no request enters a stopping engine
        self.state, self.error = IDLE, None
        self.spec: ModelSpec | None = None
        self.ready_at: float | None = None
        self.loop: EngineLoop | None = None
        self.engine: Any = None
        self._shares: TenantShares | None = None
        self._loras: dict[str, AdapterEntry] = {}  # the registered runtime LoRA adapters, every model's
        self.dispatcher: Dispatcher | None = None  # takes the served model's requests into its engine
        self.reclaimer: held.OrphanReclaimer | None = None  # for the served model's held requests

    @property
    def model(self) -> str | None:
        """The served model's name while an engine serves it (``ready`` or ``unloading``)."""
        return self.spec.name if self.state in (READY, UNLOADING) else None

    def load(self, spec: ModelSpec) -> None:
        """Build ``spec``'s engine (unloading the current model first) and take its requests.

        A spec whose settings are refused before anything is built (``create_engine_config``: an
        unknown source, FP8 without FP8 tensor cores, a ``max_model_len`` over the model's) leaves
        the served model serving, with the refusal as the worker's error.

        Raises:
            what building the engine raised; the worker is then ``failed``, with no model, and
            takes the next command.
        """
        args = spec.engine_args(self.base_args)
        if self.loop is not None:
            try:
                args.create_engine_config()
            except Exception as error:
                self.error = f"{type(error).__name__}: {error}"
                logger.error("not loading model %s (%s); %s stays loaded", spec.name, self.error, self.model)
                raise
            self.unload()
        self.state, self.spec, self.error = LOADING, spec, None
        logger.info("loading model %s from %s", spec.name, spec.source)
        backlog = (default_max_waiting_requests(args.max_num_seqs) if self.max_waiting_requests is None
                   else self.max_waiting_requests)
        loop = EngineLoop(lambda: self._build_engine(args), self.io.publish, self.io.reject,
                          args.max_num_seqs + backlog, self._on_engine_failure, self.io.aborted)
        try:
            engine = loop.start_and_wait()
            if self._shares is not None:
                loop.set_tenant_shares(self._shares)
            loop.sync_loras(adapters_of(self._loras, spec.name))
            with self._lock:
                self.loop, self.engine, self.state, self.ready_at = loop, engine, READY, time.time()
            self.dispatcher = Dispatcher(self._redis_url, spec.name, self.worker_id, loop, self.io)
            self.dispatcher.start()
            self.reclaimer = reclaimer(self._redis_url, spec.name)
            self.reclaimer.start()
        except BaseException as error:
            if self.loop is loop:  # built, but what follows failed
                self.unload()
            self.state, self.spec, self.error = FAILED, None, f"{type(error).__name__}: {error}"
            _free_memory()
            logger.error("loading model %s failed: %s", spec.name, self.error)
            raise
        logger.info("model %s is ready (max_model_len %d)", spec.name, engine.max_model_len)

    def unload(self, reason: str = UNLOADED) -> None:
        """Stop taking the model's requests, end those in the engine with ``reason`` (a 503
        to their clients), add its last counters to its totals and free the engine."""
        with self._lock:
            loop = self.loop
            if loop is None:
                self.state, self.spec = IDLE, None
                return
            self.state = UNLOADING
        name = self.spec.name
        logger.info("unloading model %s", name)
        try:  # /v1/models drops the model before its requests see the unload error
            self.io.heartbeat_now()
        except Exception:
            logger.exception("could not publish the unloading state")
        self._stop_reclaimer()
        self._stop_dispatcher()
        loop.stop(reason)
        loop.join(30)
        self.io.end_model()
        with self._lock:
            self.loop, self.engine, self.spec, self.state = None, None, None, IDLE
        loop.engine = None
        del loop
        _free_memory()
        logger.info("model %s unloaded", name)

    def stop(self) -> None:
        """Stop taking requests; those in the engine are ended with an error to their clients."""
        self._stop_dispatcher()
        if self.loop is not None:
            self.loop.stop()

    def join(self) -> None:
        """After :meth:`stop`: stop reclaiming and wait (up to 10 s) for the engine loop to end."""
        self._stop_reclaimer()
        if self.loop is not None:
            self.loop.join(10)

    def abort(self, request_ids: list[str]) -> None:
        """The clients of ``request_ids`` left: the engine drops them (without an engine, they are reported
        dropped with no prompt computed, so that their tenants' charges are corrected)."""
        if self.loop is not None:
            self.loop.abort(request_ids)
        else:
            self.io.aborted(dict.fromkeys(request_ids, 0))

    def set_tenant_shares(self, shares: TenantShares) -> None:
        """The tenants' GPU shares changed: pass them to the engine (and to the next one loaded)."""
        self._shares = shares
        if self.loop is not None:
            self.loop.set_tenant_shares(shares)

    def set_loras(self, entries: dict[str, AdapterEntry]) -> None:
        """The registered LoRA adapters changed: the engine loads its model's new ones and unloads the others
        (and the next engine loaded does the same)."""
        self._loras = entries
        loop, spec = self.loop, self.spec
        if loop is not None and spec is not None:
            loop.sync_loras(adapters_of(entries, spec.name))

    def check_lora(self, name: str, path: str):
        """Load adapter ``name`` from ``path`` into the engine now: the ``EngineLoop.add_lora`` future, or None
        while no engine is ready."""
        loop = self.loop
        return loop.add_lora(name, path) if loop is not None and self.state == READY else None

    def _on_engine_failure(self, error: BaseException) -> None:
        """The engine raised: stop this worker (warm shutdown), so that a supervisor such as
        ``manage.py serve`` starts a fresh one; queued requests wait for it in Redis."""
        logger.error("engine failed (%s); stopping worker %s", error, self.worker_id)
        self.closing.set()
        if self.dispatcher is not None:
            self.dispatcher.stop(timeout=0)
        os.kill(os.getpid(), signal.SIGTERM)

    def _stop_dispatcher(self) -> None:
        if self.dispatcher is not None:
            self.dispatcher.stop()
            self.dispatcher = None

    def _stop_reclaimer(self) -> None:
        if self.reclaimer is not None:
            self.reclaimer.stop()
            self.reclaimer = None


def _free_memory() -> None:
    """Return a dropped engine's memory (its weights and KV cache) to the system / the GPU."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
