"""One engine at a time per Celery worker: load, unload and reload it, run its loops, admit
requests from Celery tasks.

Admission (why a dead worker loses no queued request, and why the engine holds a backlog):
the worker consumes its model's queue one message at a time (prefetch 1, late ack). The task
for a message records the request as held by this worker (:mod:`.held`), waits for a place in
the engine, claims the request in Redis (:func:`.registry.claim`), hands it to the engine loop
and only then returns, which acknowledges the message. The engine has ``max_num_seqs`` +
``max_waiting_requests`` places: the requests it runs, and a backlog waiting in its scheduler.
The backlog is what lets the scheduler enforce the tenants' GPU shares: with places only for
the requests it runs, it would almost never hold waiting requests of several tenants to
choose between, and tenants would be served in the queue's arrival order. Everything beyond
the backlog stays in the queue for any worker of the model. A full engine keeps every tenant
present in its backlog: a request of a tenant with few requests waiting takes the place of a
not-yet-started one of the tenant with the most, which goes back to the queue
(:meth:`.EngineLoop.displace_for`); otherwise the requests of the tenant served least would
fill the backlog and leave the scheduler nothing else to choose.

A request stays held until its first output or error is published (the I/O thread settles
the record, :mod:`.io_loop`). If the worker dies before that (waiting for a place, or in the
backlog) the other workers put the request back on the queue within about 5 s and move its
claim to ``requeued``, so the copy runs elsewhere; a worker that only stalled then publishes
nothing of it. Requests already started are lost with the worker; their clients see its
heartbeat expire and get an error (see :mod:`webapp.serving.client`). The broker redelivers
an unacknowledged message after its visibility timeout; the claim guarantees the request
runs at most once.

Models (why the process outlives its engine): a worker may start with a model or with none
(``idle``), and takes load / unload / reload commands from its command list
(:mod:`.commands`) on a thread of its own. A load builds the engine on a new engine-loop
thread (``loading``), then starts consuming the model's queue (``ready``); if building
fails, the error is kept for the heartbeat (``failed``) and the worker stays as it was
without a model, ready for the next command. An unload first stops consuming the queue,
then ends the engine's requests (running and backlogged) with an error saying so, adds the model's last
counter increments to its totals, and drops the engine (its weights and KV cache) before
the worker reports ``idle``.
"""
from __future__ import annotations

import gc
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
import torch

from inference import EngineArgs
from inference.sampling_params import SamplingParams
from webapp.celery import queue_for

from . import held, registry
from .commands import LOAD, RELOAD, UNLOAD, ModelCommand, commands_key
from .devices import describe_device, gpu_stats
from .engine_loop import EngineLoop, EngineRequest
from .io_loop import WorkerIO
from .model_spec import ModelSpec
from .queues import CeleryQueues

logger = logging.getLogger(__name__)

SLOT_POLL = 0.5  # seconds between checks for shutdown while waiting for a slot
GIL_SWITCH_INTERVAL = 0.0001  # seconds; see WorkerRuntime.start
COMMAND_POLL = 1.0  # seconds a BLPOP for commands blocks before checking for shutdown
UNLOADED = "The model was unloaded from this worker; retry the request."
DISPLACED = "The request could not be kept waiting on this worker; retry the request."
IDLE, LOADING, READY, UNLOADING, FAILED = "idle", "loading", "ready", "unloading", "failed"
MIN_DEFAULT_BACKLOG = 64  # requests


def default_max_waiting_requests(max_num_seqs: int) -> int:
    """The backlog a worker keeps when ``--max-waiting-requests`` is not given, in requests:
    ``max(max_num_seqs, 64)``.

    At least ``max_num_seqs``, so that a whole batch finishing at once (same ``max_tokens``)
    is refilled from the engine's own waiting queue, chosen by the tenants' shares, rather
    than from Redis in arrival order; at least 64, so that with a small batch several
    tenants still each have requests waiting for the scheduler to choose between. Not more:
    a request in one worker's backlog cannot move to another worker that has room (only a
    dead worker's backlog is requeued), so a longer backlog spreads a burst less evenly over
    the model's workers.
    """
    return max(max_num_seqs, MIN_DEFAULT_BACKLOG)


class WorkerShuttingDown(Exception):
    """The worker stops, or no longer serves the message's model: the message must go back
    to the queue (for another worker of the model)."""


class WorkerRuntime:
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
        self.queues: CeleryQueues | None = None  # set once the Celery worker consumes (see serve_commands)
        self._shares = None
        self.reclaimer: held.OrphanReclaimer | None = None  # for the served model's held requests
        self.io = WorkerIO(self.worker_id, layer, self._info, self._on_abort, self._on_shares)

    @property
    def model(self) -> str | None:
        """The served model's name while an engine serves it (``ready`` or ``unloading``)."""
        return self.spec.name if self.state in (READY, UNLOADING) else None

    def start(self, spec: ModelSpec | None) -> None:
        """Start the I/O thread (its first heartbeat registers this worker), then load ``spec``
        if given.

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
        if spec is not None:
            self.load(spec)
        logger.info("worker %s started (%s; commands on %s)", self.worker_id,
                    f"serves {self.model}" if self.model else "no model", commands_key(self.worker_id))

    # ---- models ------------------------------------------------------------------
    def load(self, spec: ModelSpec) -> None:
        """Build ``spec``'s engine (unloading the current model first) and consume its queue.

        A spec whose settings are refused before anything is built (``create_engine_config``: an
        unknown source, FP8 without FP8 tensor cores, a ``max_model_len`` over the model's) leaves
        the served model serving, with the refusal as the worker's error.

        Raises:
            what building the engine raised, or ``QueueControlError``; the worker is then
            ``failed``, with no model, and takes the next command.
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
                          args.max_num_seqs + backlog, self._on_engine_failure)
        try:
            engine = loop.start_and_wait()
            if self._shares is not None:
                loop.set_tenant_shares(self._shares)
            with self._lock:
                self.loop, self.engine, self.state, self.ready_at = loop, engine, READY, time.time()
            if self.queues is not None:
                self.queues.consume(queue_for(spec.name))
            self.reclaimer = held.OrphanReclaimer(self._redis, spec.name, self._requeue)
            self.reclaimer.start()
        except BaseException as error:
            if self.loop is loop:  # built, but its queue could not be consumed
                self.unload()
            self.state, self.spec, self.error = FAILED, None, f"{type(error).__name__}: {error}"
            _free_memory()
            logger.error("loading model %s failed: %s", spec.name, self.error)
            raise
        logger.info("model %s is ready (max_model_len %d)", spec.name, engine.max_model_len)

    def unload(self, reason: str = UNLOADED) -> None:
        """Stop consuming the model's queue, end its running requests with ``reason`` (a 503
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
        if self.queues is not None:
            try:
                self.queues.cancel(queue_for(name))
            except Exception:  # requests it still takes are sent back (see admit)
                logger.exception("could not stop consuming %s", queue_for(name))
        loop.stop(reason)
        loop.join(30)
        self.io.end_model()
        with self._lock:
            self.loop, self.engine, self.spec, self.state = None, None, None, IDLE
        loop.engine = None
        del loop
        _free_memory()
        logger.info("model %s unloaded", name)

    def run_command(self, command: ModelCommand) -> None:
        """Carry out one model command; a failed load is reported in the heartbeat, not raised."""
        try:
            if command.op == UNLOAD:
                self.unload()
            elif command.op in (LOAD, RELOAD):
                spec = command.spec or self.spec
                if spec is None:
                    logger.warning("reload: this worker serves no model")
                    return
                self.load(spec)
        except Exception:  # a failed load is logged by load, and its state and error say what happened
            if command.op == UNLOAD:
                logger.exception("unloading failed")

    def serve_commands(self, queues: CeleryQueues) -> None:
        """Once the Celery worker consumes: take model commands on a thread of its own
        (returns at once)."""
        self.queues = queues
        threading.Thread(target=self._command_loop, name="tessera-worker-commands", daemon=True).start()

    def _command_loop(self) -> None:
        client = redis.Redis.from_url(self._redis_url, socket_timeout=COMMAND_POLL + 30)
        while not self._closing.is_set():
            try:
                item = client.blpop([commands_key(self.worker_id)], timeout=COMMAND_POLL)
            except redis.RedisError:
                logger.exception("reading model commands failed")
                time.sleep(COMMAND_POLL)
                continue
            if item is None or self._closing.is_set():
                continue
            try:
                command = ModelCommand.decode(item[1])
            except ValueError as error:
                logger.error("ignored a command: %s", error)
                continue
            self.run_command(command)

    # ---- requests ----------------------------------------------------------------
    def admit(self, payload: dict[str, Any]) -> None:
        """Hand one request from a Celery task to the engine; returns once the engine has it
        (running, or waiting in its backlog).

        ``payload``: ``rid``, ``reply`` (channel), ``model`` (the served model's name),
        ``prompt_token_ids``, ``params`` (SamplingParams keyword arguments), ``priority`` (int,
        optional), ``cache_salt`` (str, optional), ``tenant`` (slug, optional), ``arrival``
        (``time.time()`` at the web process).

        The request is recorded as held by this worker (:mod:`.held`) from now until its first
        output or error is published, so that the other workers requeue it if this one dies
        before starting it.

        Raises:
            WorkerShuttingDown: the worker is stopping, or does not serve the request's model
                (any more), before the request got a place in the engine.
        """
        loop, model = self.loop, self.model
        if loop is None or payload.get("model", model) != model:
            raise WorkerShuttingDown()
        rid = payload["rid"]
        held.hold(self._redis, model, self.worker_id, payload)
        try:
            self._wait_for_place(loop, model, payload.get("tenant"))
            with self._lock:
                if self._closing.is_set() or loop is not self.loop or self.state != READY:
                    loop.release_slot()
                    raise WorkerShuttingDown()
                if not registry.claim(self._redis, rid, self.worker_id):
                    loop.release_slot()  # aborted by its client, or taken by another worker
                    held.release(self._redis, model, self.worker_id, rid)
                    return
                self.io.add_route(rid, payload["reply"])
                self.io.expect_start(rid, model)  # its first message (even an error) settles the held record
                try:
                    params = SamplingParams(**payload["params"])
                except (TypeError, ValueError) as error:
                    loop.release_slot()
                    self.io.reject(rid, 400, str(error), getattr(error, "param", None))
                    return
                arrival = time.monotonic() - max(0.0, time.time() - payload.get("arrival", time.time()))
                loop.submit(EngineRequest(rid, list(payload["prompt_token_ids"]), params, arrival,
                                          payload.get("tenant"), priority=int(payload.get("priority", 0)),
                                          cache_salt=payload.get("cache_salt")))
        except BaseException:  # WorkerShuttingDown: the message goes back to the queue, for any worker
            held.release(self._redis, model, self.worker_id, rid)
            raise

    def _wait_for_place(self, loop: EngineLoop, model: str, tenant: str | None) -> None:
        """Wait for a place in the engine (running or backlog) while the request is held. A
        full engine first tries to make room by giving back to the queue a backlogged request
        of a tenant over-represented in the backlog (:meth:`EngineLoop.displace_for`)."""
        if loop.acquire_slot(0):
            return
        while True:
            displaced = loop.displace_for(tenant)
            if displaced is not None:  # its place is ours now
                self._give_back(model, displaced)
                return
            if loop.acquire_slot(SLOT_POLL):
                return
            if self._closing.is_set() or not loop.is_alive():
                raise WorkerShuttingDown()

    def _give_back(self, model: str, request_id: str) -> None:
        """Put a backlogged request that the engine dropped unstarted back on the queue (its
        claim becomes ``requeued``; its client keeps waiting)."""
        payload = held.take(self._redis, model, self.worker_id, request_id)
        if payload is not None:
            self.io.forget(request_id)
            self._requeue(payload)
        else:  # no record of this worker's (a duplicate copy's record stood, or another worker took it)
            self.io.reject(request_id, 503, DISPLACED, None)  # dropped at publishing if taken over

    def _requeue(self, payload: dict[str, Any]) -> None:
        from .task_messages import enqueue_blocking  # noqa: PLC0415 (it imports the tasks, which import this module)
        enqueue_blocking(self._redis, queue_for(payload.get("model") or self.model), [payload])

    def _stop_reclaimer(self) -> None:
        if self.reclaimer is not None:
            self.reclaimer.stop()
            self.reclaimer = None

    def begin_shutdown(self) -> None:
        """Stop admitting; requests in the engine are ended with an error to their clients."""
        if self._closing.is_set():
            return
        self._closing.set()
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
        os.kill(os.getpid(), signal.SIGTERM)

    def _on_abort(self, request_ids: list[str]) -> None:
        if self.loop is not None:
            self.loop.abort(request_ids)

    def _on_shares(self, shares) -> None:
        self._shares = shares
        if self.loop is not None:
            self.loop.set_tenant_shares(shares)

    def _info(self) -> dict[str, Any]:
        loop, spec, state = self.loop, self.spec, self.state
        serving = state in (READY, UNLOADING) and loop is not None and spec is not None
        stats = loop.stats if serving else None
        info = {
            "model": spec.name if serving else None,
            "source": spec.source if serving else None,
            "state": state,
            "loading": spec.name if state == LOADING and spec is not None else None,
            "error": self.error,
            "ready_at": self.ready_at if serving else None,
            "pid": os.getpid(),
            "started": self.started,
            **describe_device(),
            "gpus": gpu_stats(),
            "max_model_len": int(self.engine.max_model_len) if serving else None,
            "cache_config": _cache_config(self.engine) if serving else None,
            "scheduling_policy": self.engine.config.scheduler.scheduling_policy if serving else None,
            "stats": (dict(vars(stats)) if not isinstance(stats, dict) else stats) if stats is not None else {},
            "num_steps": loop.num_steps if serving else 0,
            "tenant_shares": loop.tenant_shares.shares if serving and loop.tenant_shares else None,
            "live": serving and state == READY and loop.is_alive() and not self._closing.is_set(),
        }
        return info


def _cache_config(engine) -> dict[str, Any]:
    """The engine's KV-cache settings, as vLLM's ``vllm:cache_config_info`` labels them."""
    cache, kv = engine.config.cache, engine.kv_cache_manager
    return {"block_size": cache.block_size, "cache_dtype": "auto", "enable_prefix_caching": cache.enable_prefix_caching,
            "gpu_memory_utilization": cache.gpu_memory_utilization, "num_gpu_blocks": kv.num_blocks,
            "num_cpu_blocks": kv.num_cpu_blocks, "swap_space": cache.swap_space}


def _free_memory() -> None:
    """Return a dropped engine's memory (its weights and KV cache) to the system / the GPU."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


_runtime: WorkerRuntime | None = None
_runtime_ready = threading.Event()


def install_runtime(runtime: WorkerRuntime) -> None:
    """Make ``runtime`` the one the Celery tasks of this process hand requests to."""
    global _runtime
    _runtime = runtime
    _runtime_ready.set()


def get_runtime(timeout: float = 600.0) -> WorkerRuntime:
    """This process's runtime (waits for the engine to be built)."""
    if not _runtime_ready.wait(timeout):
        raise WorkerShuttingDown()
    assert _runtime is not None
    return _runtime
