"""One engine per Celery worker: build it, run its loops, admit requests from Celery tasks.

Admission (why a dead worker loses no queued request): the worker consumes its model's
queue one message at a time (prefetch 1, late ack). The task for a message waits here for
a free engine slot, claims the request in Redis (``SET NX``), hands it to the engine loop
and only then returns, which acknowledges the message. A worker therefore takes a request
out of Redis only when its engine has room for it; everything else stays in the queue for
any worker of the model. If the worker dies holding its one unacknowledged message, the
other workers put the request back on the queue within about 5 s (:mod:`.held`); the broker
also redelivers the message after its visibility timeout, and the claim guarantees the
request runs at most once. Requests already in the engine are lost with the worker; their clients
see its heartbeat expire and get an error (see :mod:`webapp.serving.client`).
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

from inference.sampling_params import SamplingParams

from webapp.celery import queue_for

from . import held, registry
from .engine_loop import EngineLoop, EngineRequest
from .io_loop import WorkerIO

logger = logging.getLogger(__name__)

SLOT_POLL = 0.5  # seconds between checks for shutdown while waiting for a slot
GIL_SWITCH_INTERVAL = 0.0005  # seconds


class WorkerShuttingDown(Exception):
    """The worker stops; the message must go back to the queue."""


class WorkerRuntime:
    """The engine of this worker process, its step-loop thread and its I/O thread.

    Args:
        engine_factory: builds the ``inference.LLMEngine`` (called on the engine-loop thread).
        served_model_name: the name clients use, also the queue's name.
        redis_url: Redis for claims (the I/O thread uses the Channels layer's connections).
        layer: the Channels layer.
        max_num_seqs: requests admitted at once.
    """

    def __init__(self, engine_factory: Callable[[], Any], served_model_name: str, redis_url: str, layer: Any,
                 max_num_seqs: int) -> None:
        self.model = served_model_name
        self.worker_id = f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self._redis = redis.Redis.from_url(redis_url)
        self._closing = threading.Event()
        self.started = time.time()
        self.io = WorkerIO(self.worker_id, layer, self._info, self._on_abort, self._on_shares)
        self.loop = EngineLoop(engine_factory, self.io.publish, self.io.reject, max_num_seqs, self._on_engine_failure)
        self.reclaimer = held.OrphanReclaimer(self._redis, self.model, self._requeue)

    def start(self) -> None:
        """Build the engine on the engine-loop thread, then start the I/O thread (whose first
        heartbeat makes this worker live).

        Raises:
            what building the engine raised (``ModelLoadError``, ``NotSupportedYetError``, ...).
        """
        # The engine thread holds the GIL between torch calls; with the default 5 ms switch
        # interval the I/O thread could wait that long to publish a step's tokens.
        sys.setswitchinterval(GIL_SWITCH_INTERVAL)
        self.engine = self.loop.start_and_wait()
        self.io.start_and_wait()
        self.reclaimer.start()
        logger.info("worker %s serves %s (control channel %s)", self.worker_id, self.model, self.io.control_channel)

    def admit(self, payload: dict[str, Any]) -> None:
        """Hand one request from a Celery task to the engine; returns once the engine has it.

        ``payload``: ``rid``, ``reply`` (channel), ``prompt_token_ids``, ``params``
        (SamplingParams keyword arguments), ``priority`` (int, optional), ``cache_salt`` (str,
        optional), ``arrival`` (``time.time()`` at the web process).

        Raises:
            WorkerShuttingDown: the worker is stopping before the request got a slot.
        """
        if not self.loop.acquire_slot(0):
            self._wait_for_slot(payload)
        if self._closing.is_set():
            self.loop.release_slot()
            raise WorkerShuttingDown()
        rid = payload["rid"]
        if not self._redis.set(registry.claim_key(rid), self.worker_id, nx=True, ex=registry.CLAIM_TTL):
            self.loop.release_slot()  # aborted by its client, or taken by another worker
            return
        try:
            params = SamplingParams(**payload["params"])
        except (TypeError, ValueError) as error:
            self.loop.release_slot()
            self.io.add_route(rid, payload["reply"])
            self.io.reject(rid, 400, str(error), getattr(error, "param", None))
            return
        arrival = time.monotonic() - max(0.0, time.time() - payload.get("arrival", time.time()))
        self.io.add_route(rid, payload["reply"])
        self.loop.submit(EngineRequest(rid, list(payload["prompt_token_ids"]), params, arrival, payload.get("tenant"),
                                       priority=int(payload.get("priority", 0)),
                                       cache_salt=payload.get("cache_salt")))

    def _wait_for_slot(self, payload: dict[str, Any]) -> None:
        """Wait for a free engine slot while the request is recorded as held by this worker
        (so that the others take it over if this worker dies meanwhile)."""
        held.hold(self._redis, self.model, self.worker_id, payload)
        try:
            while not self.loop.acquire_slot(SLOT_POLL):
                if self._closing.is_set() or not self.loop.is_alive():
                    raise WorkerShuttingDown()
        finally:
            held.release(self._redis, self.model, payload["rid"])

    def begin_shutdown(self) -> None:
        """Stop admitting; requests in the engine are ended with an error to their clients."""
        if self._closing.is_set():
            return
        self._closing.set()
        self.loop.stop()

    def close(self) -> None:
        """Wait for the loops to end and remove this worker's heartbeat."""
        self.begin_shutdown()
        self.reclaimer.stop()
        self.loop.join(10)
        self.io.stop()

    def _on_engine_failure(self, error: BaseException) -> None:
        """The engine raised: stop this worker (warm shutdown), so that a supervisor such as
        ``manage.py serve`` starts a fresh one; queued requests wait for it in Redis."""
        logger.error("engine failed (%s); stopping worker %s", error, self.worker_id)
        self._closing.set()
        os.kill(os.getpid(), signal.SIGTERM)

    def _requeue(self, payload: dict[str, Any]) -> None:
        from .client import _enqueue  # noqa: PLC0415 (client imports the tasks, which import this module)
        _enqueue(queue_for(self.model), [payload])

    def _on_abort(self, request_ids: list[str]) -> None:
        self.loop.abort(request_ids)

    def _on_shares(self, shares) -> None:
        self.loop.set_tenant_shares(shares)

    def _info(self) -> dict[str, Any]:
        stats = self.loop.stats
        return {
            "model": self.model,
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "started": self.started,
            "max_model_len": int(self.engine.max_model_len),
            "stats": dict(vars(stats)) if not isinstance(stats, dict) else stats,
            "num_steps": self.loop.num_steps,
            "tenant_shares": self.loop.tenant_shares.shares if self.loop.tenant_shares else None,
            "live": self.loop.is_alive() and not self._closing.is_set(),
        }


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
