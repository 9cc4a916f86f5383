"""One engine at a time per Celery worker: :class:`WorkerRuntime`, the worker process's
state, composed of its parts, one module each: the model it serves and the engine serving it
(:class:`.model_lifecycle.ModelHost`: load, unload, reload), the thread that takes model
commands (:class:`.command_loop.CommandLoop`), what the heartbeat says about the worker
(:func:`.heartbeat_info.heartbeat_info`) and the I/O thread that writes it
(:class:`.io_loop.WorkerIO`). The loaded model's requests come from its queues through a
:class:`.dispatcher.Dispatcher` (which says why a dead worker loses no queued request, and how
the tenants' shares decide what enters the engine).
"""
from __future__ import annotations

import logging
import os
import socket
import sys
import threading
import time
import uuid
from typing import Any, Callable

import redis

from inference import EngineArgs
from webapp.transport.keys import commands_key

from . import worker_slot
from .command_loop import CommandLoop
from .heartbeat_info import heartbeat_info
from .io_loop import WorkerIO
from .model_lifecycle import READY, ModelHost, default_max_waiting_requests
from .model_spec import ModelSpec

__all__ = ["WorkerRuntime", "default_max_waiting_requests"]

logger = logging.getLogger(__name__)

GIL_SWITCH_INTERVAL = 0.0001  # seconds; see WorkerRuntime.start


class WorkerRuntime:
    """This worker process: its I/O thread, its command thread, and the host of the model it
    serves (none while ``idle`` or ``failed``) with that engine's step-loop thread.

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
        host: the model host (``host.state``, ``host.spec``: what it serves or loads).
        commands: the command loop, started by :meth:`serve_commands`.
    """

    def __init__(self, base_args: EngineArgs, redis_url: str, layer: Any,
                 engine_builder: Callable[[EngineArgs], Any], max_waiting_requests: int | None = None) -> None:
        if max_waiting_requests is not None and max_waiting_requests < 0:
            raise ValueError(f"max_waiting_requests must be at least 0 requests, got {max_waiting_requests}")
        self.worker_id = f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.slot = os.environ.get("TESSERA_WORKER_SLOT") or None  # see worker_slot: set by serve
        self.started = time.time()
        self._redis = redis.Redis.from_url(redis_url)
        self._closing = threading.Event()
        # The I/O thread calls back into the host only once started (after the host exists).
        self.io = WorkerIO(self.worker_id, layer, self._info, lambda rids: self.host.abort(rids),
                           lambda shares: self.host.set_tenant_shares(shares),
                           lambda loras: self.host.set_loras(loras),
                           lambda name, path: self.host.check_lora(name, path))
        self.host = ModelHost(base_args, engine_builder, self.io, redis_url, self.worker_id, self._closing,
                              max_waiting_requests)
        self.commands = CommandLoop(self.worker_id, redis_url, self._closing, self.host, self.slot)

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
        host = self.host
        found, resumed, resumes = worker_slot.resume(self._redis, self.slot)
        if found:  # this slot's previous worker died: serve what it served (what the admin last loaded)
            logger.info("worker slot %s: resuming with %s", self.slot, resumed.name if resumed else "no model")
            worker_slot.record(self._redis, self.slot, resumed, resumes)  # counted first: a crash in the load counts
            try:
                if resumed is not None:
                    host.load(resumed)
            except Exception:  # noqa: BLE001 - logged by load; stay up, failed and idle, not in a restart loop
                pass
        elif spec is not None:
            host.load(spec)
        worker_slot.record(self._redis, self.slot, host.spec if host.state == READY else None, resumes)
        logger.info("worker %s started (%s; commands on %s)", self.worker_id,
                    f"serves {host.model}" if host.model else "no model", commands_key(self.worker_id))

    def serve_commands(self) -> None:
        """Once the Celery worker is ready: take model commands on a thread of its own
        (returns at once)."""
        self.commands.start()

    def begin_shutdown(self) -> None:
        """Stop taking requests; those in the engine are ended with an error to their clients."""
        if self._closing.is_set():
            return
        self._closing.set()
        self.host.stop()

    def close(self) -> None:
        """Wait for the loops to end and remove this worker's heartbeat."""
        self.begin_shutdown()
        self.host.join()
        self.io.stop()

    def _info(self) -> dict[str, Any]:
        return heartbeat_info(self.host, self.started, self._closing.is_set())
