"""One engine at a time per Celery worker: :class:`WorkerRuntime`, the worker process's
state, and the runtime the Celery tasks of this process hand requests to.

Its parts, one module each: loading, unloading and reloading the model
(:mod:`.model_lifecycle`), the thread that takes model commands (:mod:`.command_loop`),
and what the heartbeat says about the worker (:mod:`.heartbeat_info`). The loaded model's
requests come from its queues through a :class:`.dispatcher.Dispatcher` (which says why a dead
worker loses no queued request, and how the tenants' shares decide what enters the engine).
"""
from __future__ import annotations

import logging
import os
import signal
import socket
import sys
import threading
import time
import uuid
from typing import Any, Callable

import redis

from inference import EngineArgs
from webapp.transport.keys import commands_key

from . import held, worker_slot
from .command_loop import CommandLoop
from .dispatcher import Dispatcher
from .engine_loop import EngineLoop
from .heartbeat_info import HeartbeatInfo
from .io_loop import WorkerIO
from .model_lifecycle import IDLE, READY, ModelLifecycle, default_max_waiting_requests
from .model_spec import ModelSpec

__all__ = ["WorkerRuntime", "default_max_waiting_requests"]

logger = logging.getLogger(__name__)

GIL_SWITCH_INTERVAL = 0.0001  # seconds; see WorkerRuntime.start


class WorkerRuntime(ModelLifecycle, CommandLoop, HeartbeatInfo):
    """This worker process: its I/O thread, its command thread, and the engine of the model
    it serves (none while ``idle`` or ``failed``) with that engine's step-loop thread.

    Args:
        base_args: the worker's engine flags; a loaded model's :class:`ModelSpec` is laid
            over them (``--kv-cache-space``, ``--block-size`` ... stay the worker's).
        redis_url: Redis for claims and commands (the I/O thread uses the Channels layer's
            connections).
        layer: the Channels layer.
        engine_builder: builds an ``inference.LLMEngine`` from ``EngineArgs`` (called on the
            engine-loop thread).
        max_waiting_requests: requests the worker admits into its engine beyond
            ``max_num_seqs``, to wait in the engine's scheduler (the backlog); None:
            :func:`default_max_waiting_requests` of the loaded model's ``max_num_seqs``.

    Raises:
        ValueError: ``max_waiting_requests`` is negative.

    Attributes:
        state: ``idle``, ``loading``, ``ready``, ``unloading`` or ``failed`` (idle, with the
            last load's ``error``).
        spec: the model loading or served, None without one.
    """

    def __init__(self, base_args: EngineArgs, redis_url: str, layer: Any,
                 engine_builder: Callable[[EngineArgs], Any], max_waiting_requests: int | None = None) -> None:
        if max_waiting_requests is not None and max_waiting_requests < 0:
            raise ValueError(f"max_waiting_requests must be at least 0 requests, got {max_waiting_requests}")
        self.base_args = base_args
        self.max_waiting_requests = max_waiting_requests
        self.worker_id = f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.slot = os.environ.get("TESSERA_WORKER_SLOT") or None  # see worker_slot: set by serve
        self._redis_url = redis_url
        self._redis = redis.Redis.from_url(redis_url)
        self._build_engine = engine_builder
        self._closing = threading.Event()
        self._lock = threading.Lock()  # admission against unload: no request enters a stopping engine
        self.started = time.time()
        self.state, self.error = IDLE, None
        self.spec: ModelSpec | None = None
        self.ready_at: float | None = None  # time.time() when the current model became ready
        self.loop: EngineLoop | None = None
        self.engine: Any = None
        self._shares = None
        self.dispatcher: Dispatcher | None = None  # takes the served model's requests into its engine
        self.reclaimer: held.OrphanReclaimer | None = None  # for the served model's held requests
        self.io = WorkerIO(self.worker_id, layer, self._info, self._on_abort, self._on_shares)

    def start(self, spec: ModelSpec | None) -> None:
        """Start the I/O thread (its first heartbeat registers this worker), then load ``spec``
        if given; in a :mod:`worker slot <.worker_slot>` with a record, what the record says instead.

        Raises:
            what building the engine raised (``ModelLoadError``, ``NotSupportedYetError``, ...).
        """
        # A request crosses four threads here (Celery's consumer, its pool thread, the engine
        # loop, the I/O thread), and at each hand-off the woken thread waits for the GIL until
        # the other one blocks or the switch interval runs out: the default 5 ms, or even
        # 0.5 ms, added that much to a request's TTFT per hand-off (about 0.4 ms each at
        # 0.5 ms on 2 CPU cores). Forced switches only happen while two threads want the GIL,
        # which the engine thread rarely does (torch releases it inside its kernels).
        sys.setswitchinterval(GIL_SWITCH_INTERVAL)
        self.io.start_and_wait()
        found, resumed, resumes = worker_slot.resume(self._redis, self.slot)
        if found:  # this slot's previous worker died: serve what it served (what the admin last loaded)
            logger.info("worker slot %s: resuming with %s", self.slot, resumed.name if resumed else "no model")
            worker_slot.record(self._redis, self.slot, resumed, resumes)  # counted first: a crash in the load counts
            try:
                if resumed is not None:
                    self.load(resumed)
            except Exception:  # noqa: BLE001 - logged by load; stay up, failed and idle, not in a restart loop
                pass
        elif spec is not None:
            self.load(spec)
        worker_slot.record(self._redis, self.slot, self.spec if self.state == READY else None, resumes)
        logger.info("worker %s started (%s; commands on %s)", self.worker_id,
                    f"serves {self.model}" if self.model else "no model", commands_key(self.worker_id))

    def begin_shutdown(self) -> None:
        """Stop taking requests; those in the engine are ended with an error to their clients."""
        if self._closing.is_set():
            return
        self._closing.set()
        self._stop_dispatcher()
        if self.loop is not None:
            self.loop.stop()

    def close(self) -> None:
        """Wait for the loops to end and remove this worker's heartbeat."""
        self.begin_shutdown()
        self._stop_reclaimer()
        if self.loop is not None:
            self.loop.join(10)
        self.io.stop()

    def _on_engine_failure(self, error: BaseException) -> None:
        """The engine raised: stop this worker (warm shutdown), so that a supervisor such as
        ``manage.py serve`` starts a fresh one; queued requests wait for it in Redis."""
        logger.error("engine failed (%s); stopping worker %s", error, self.worker_id)
        self._closing.set()
        if self.dispatcher is not None:
            self.dispatcher.stop(timeout=0)
        os.kill(os.getpid(), signal.SIGTERM)

    def _on_abort(self, request_ids: list[str]) -> None:
        if self.loop is not None:
            self.loop.abort(request_ids)

    def _on_shares(self, shares) -> None:
        self._shares = shares
        if self.loop is not None:
            self.loop.set_tenant_shares(shares)
