"""Admit requests from Celery tasks into the worker's engine (part of
:class:`.runtime.WorkerRuntime`).

Why a dead worker loses no queued request, and why the engine holds a backlog: the worker
consumes its model's queue one message at a time (prefetch 1, late ack). The task for a
message records the request as held by this worker (:mod:`.held`), waits for a place in the
engine, claims the request in Redis (:func:`.registry.claim`), hands it to the engine loop
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
"""
from __future__ import annotations

import time
from typing import Any

from inference.sampling_params import SamplingParams
from webapp.celery import queue_for

from . import held, registry
from .engine_loop import EngineLoop, EngineRequest
from .model_lifecycle import READY

SLOT_POLL = 0.5  # seconds between checks for shutdown while waiting for a slot
DISPLACED = "The request could not be kept waiting on this worker; retry the request."


class WorkerShuttingDown(Exception):
    """The worker stops, or no longer serves the message's model: the message must go back
    to the queue (for another worker of the model)."""


class Admission:
    """The request part of :class:`.runtime.WorkerRuntime` (it uses that class's attributes)."""

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
        claim = self._redis.get(registry.claim_key(rid))
        if claim is not None and claim.decode() == registry.ABORTED:  # its client left: no wait for a place
            return
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
        from .task_messages import enqueue_blocking  # noqa: PLC0415 (it imports webapp.tasks, which imports .runtime)
        queue = queue_for(payload.get("model") or self.model, payload.get("tenant"))
        enqueue_blocking(self._redis, queue, [payload])
