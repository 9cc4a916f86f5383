"""Load, unload and reload the one model a worker serves (part of :class:`.runtime.WorkerRuntime`).

Why the process outlives its engine: a worker may start with a model or with none
(``idle``), and takes load / unload / reload commands from its command list
(:mod:`.commands`) on a thread of its own (:mod:`.command_loop`). A load builds the engine
on a new engine-loop thread (``loading``), then starts consuming the model's queues, one per
tenant (``ready``; the queue of a tenant created later within about a second, by the command
thread); if building fails, the error is kept for the heartbeat (``failed``) and the
worker stays as it was without a model, ready for the next command. An unload first stops
consuming the queue, then ends the engine's requests (running and backlogged) with an error
saying so, adds the model's last counter increments to its totals, and drops the engine
(its weights and KV cache) before the worker reports ``idle``.
"""
from __future__ import annotations

import gc
import logging
import time

import torch

from webapp.celery import queue_for

from . import held
from .engine_loop import EngineLoop
from .model_spec import ModelSpec
from .tenant_shares import SHARES_KEY, decode_shares

logger = logging.getLogger(__name__)

UNLOADED = "The model was unloaded from this worker; retry the request."
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


class ModelLifecycle:
    """The model part of :class:`.runtime.WorkerRuntime` (it uses that class's attributes):
    ``state``, ``spec`` and the engine, its loop and its queue, under the admission lock."""

    @property
    def model(self) -> str | None:
        """The served model's name while an engine serves it (``ready`` or ``unloading``)."""
        return self.spec.name if self.state in (READY, UNLOADING) else None

    def model_queues(self, scan: bool = False) -> list[str]:
        """The Celery queues of the served model (none without one): its queue for requests of no
        tenant and one per active tenant (from the shares the workers read, :mod:`.tenant_shares`).
        ``scan`` (at a load): also the tenant queues that hold messages, e.g. of a tenant deleted
        while its requests waited, so that no request is left in a queue nobody consumes."""
        name = self.model
        if name is None:
            return []
        shares = self._shares if self._shares is not None else decode_shares(self._redis.hgetall(SHARES_KEY))
        queues = {queue_for(name, slug) for slug in shares.shares}
        if scan:
            found = (key.decode() for key in self._redis.scan_iter(match=queue_for(name, "*"), count=1000))
            queues.update(key for key in found if "\x06" not in key)  # not kombu's priority sub-queues
        return [queue_for(name)] + sorted(queues)

    def sync_queues(self, scan: bool = False) -> None:
        """Consume the served model's queues not consumed yet (a tenant created since the last
        call, or all of them after a load, ``scan`` as in :meth:`model_queues`); on the command
        thread, since each waits for the Celery consumer's answer.

        Raises:
            QueueControlError: the consumer did not confirm.
        """
        for queue in self.model_queues(scan):
            if queue not in self.consumed_queues:
                self.queues.consume(queue)
                self.consumed_queues.add(queue)

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
                self.sync_queues(scan=True)
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
            for queue in sorted(self.consumed_queues):
                try:
                    self.queues.cancel(queue)
                except Exception:  # requests it still takes are sent back (see admit)
                    logger.exception("could not stop consuming %s", queue)
        self.consumed_queues.clear()
        loop.stop(reason)
        loop.join(30)
        self.io.end_model()
        with self._lock:
            self.loop, self.engine, self.spec, self.state = None, None, None, IDLE
        loop.engine = None
        del loop
        _free_memory()
        logger.info("model %s unloaded", name)

    def _stop_reclaimer(self) -> None:
        if self.reclaimer is not None:
            self.reclaimer.stop()
            self.reclaimer = None


def _free_memory() -> None:
    """Return a dropped engine's memory (its weights and KV cache) to the system / the GPU."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
