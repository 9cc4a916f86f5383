"""Requests a worker took from its model's queue but has not started yet, and how the other
workers take them over when that worker dies.

A worker takes a request out of Redis before its engine starts it: the request waits in the
engine's backlog (its scheduler's waiting queue, where the tenants' shares pick the next
request). If the worker is killed then, nothing else would bring the request back. So the
worker records it in Redis
(:func:`webapp.transport.keys.held_key`: request id -> JSON ``{"worker", "payload", "charge"}``) as it
takes it off the queue (:func:`.request_queue.take`, in the same atomic step),
and removes the record (:func:`settle`) when the request's first output or error is published,
when its client aborts it, or when the worker gives it back. A client that leaves while its request
is held marks the claim ``ABORTED`` (:func:`abort_held`), so that it never starts, even when its
worker died and the record is taken over. Every worker of the model checks
that hash once a second; the records of a worker whose heartbeat has expired are taken and put
back on the model's queue, within about ``HEARTBEAT_TTL + RECLAIM_INTERVAL`` seconds (5 s) of
the death.

Exactly once, even with a worker that only stalled (its heartbeat expired, yet it runs on):
taking a record (:func:`take_orphans`) and settling it are Lua scripts, atomic in Redis
(:mod:`webapp.transport.queue_scripts`). Taking
removes the record and turns the dead worker's claim into ``REQUEUED`` (so the requeued copy
can claim it); settling removes the record only while the claim still names this worker, and
a worker publishes nothing of a request it could not settle (it aborts it). So whichever comes
first wins: the requeued copy, or the first output of the original. The client's stream reads
the record too: an owner that died with its request still held is not a lost request
(:meth:`webapp.serving.client.GenerationStream._check_workers`).

Why the first published message, not the step in which the scheduler first takes the request:
that message is the first thing its client could see, so settling there is exactly the point
after which a second run would show. A request that a dying worker had scheduled but not yet
answered (a chunked prefill, a step in flight) is requeued instead of lost, and the signal
needs nothing from the engine (no I/O in its step loop, no new scheduler output).
"""
from __future__ import annotations

import json
import logging
import threading
from typing import Any, Callable

from webapp.transport import queue_scripts
from webapp.transport.keys import claim_key, held_key, worker_key
from webapp.transport.wire import request_id_of

from . import worker_registry

logger = logging.getLogger(__name__)

RECLAIM_INTERVAL = 1.0  # seconds between two checks for requests held by dead workers


def release(redis, model: str, worker_id: str, request_id: str) -> None:
    """``worker_id`` gave the request back, or could not claim it: forget its record (only its own)."""
    redis.register_script(queue_scripts.RELEASE_HELD)(keys=[held_key(model)], args=[request_id, worker_id])


def settle(redis, model: str, worker_id: str, request_id: str, client=None):
    """The request claimed by ``worker_id`` starts (its first output or error goes out) or ends:
    remove its record. Returns 1 if the claim still names ``worker_id`` (the request is this
    worker's to run), -1 if its client aborted it, 0 if another worker took it over (in both
    cases this one must drop it). With ``client`` (a pipeline), the result comes from its ``execute``."""
    return redis.register_script(queue_scripts.SETTLE_HELD)(
        keys=[claim_key(request_id), held_key(model)],
        args=[worker_id, request_id, worker_registry.ABORTED, worker_registry.CLAIM_TTL], client=client)


def abort_held(redis, model: str, request_id: str, client=None):
    """The client of ``request_id`` is gone: if the worker that claimed it still holds it unstarted
    (alive or dead), turn the claim into ``ABORTED``, so that neither that worker (its
    :func:`settle` fails and removes the record) nor a requeued copy (:func:`take` drops it)
    ever runs it. Returns 1 if it was held, else 0 (a pipeline's ``execute`` gives it with
    ``client``)."""
    return redis.register_script(queue_scripts.ABORT_HELD)(
        keys=[claim_key(request_id), held_key(model)],
        args=[request_id, worker_registry.ABORTED, worker_registry.CLAIM_TTL], client=client)


def take_orphans(redis, model: str) -> list[dict[str, Any]]:
    """Records (``payload``: the encoded request, ``charge``: what its tenant's counter was
    charged) of the requests held by workers whose heartbeat has expired, removed from the hash
    (each is returned to exactly one caller, whatever the number of workers calling at once), their
    claims turned from the dead worker's id into ``REQUEUED``."""
    records = {rid.decode(): json.loads(raw) for rid, raw in redis.hgetall(held_key(model)).items()}
    if not records:
        return []
    owners = sorted({r["worker"] for r in records.values()})
    alive = dict(zip(owners, (raw is not None for raw in redis.mget([worker_key(w) for w in owners]))))
    taken = [take(redis, model, record["worker"], rid) for rid, record in records.items() if not alive[record["worker"]]]
    return [record for record in taken if record is not None]


def take(redis, model: str, worker_id: str, request_id: str) -> dict[str, Any] | None:
    """Take the record of ``request_id`` held by ``worker_id`` (dead, or giving it back): remove
    it and turn that worker's claim, if it had one, into ``REQUEUED``, so that a requeued copy can
    claim it. Returns the record (``payload``: the encoded request, ``charge``: what its tenant's
    counter was charged, ``aborted``: True when its client aborted it, :func:`abort_held`, and it
    must not be requeued, only refunded), None when the record was not there (taken already, or
    settled)."""
    found = redis.register_script(queue_scripts.TAKE_HELD)(
        keys=[held_key(model), claim_key(request_id)],
        args=[request_id, worker_id, worker_registry.REQUEUED, worker_registry.CLAIM_TTL, worker_registry.ABORTED])
    if not found:
        return None
    record = json.loads(found[0])
    record["aborted"] = found[1] in (b"aborted", "aborted")
    return record


class OrphanReclaimer(threading.Thread):
    """Puts the held requests of dead workers of ``model`` back on its queue, once a second.

    Args:
        redis: a synchronous ``redis.Redis``.
        requeue: puts one taken record's request back at the head of its queue
            (:func:`.request_queue.requeue`).
    """

    def __init__(self, redis, model: str, requeue: Callable[[dict[str, Any]], None]) -> None:
        super().__init__(name="tessera-reclaimer", daemon=True)
        self._redis = redis
        self._model = model
        self._requeue = requeue
        self._stop = threading.Event()

    def run(self) -> None:
        while not self._stop.wait(RECLAIM_INTERVAL):
            try:
                for record in take_orphans(self._redis, self._model):
                    logger.warning("request %s was held by a worker that died; putting it back on the queue",
                                   request_id_of(record["payload"]))
                    self._requeue(record)
            except Exception:  # noqa: BLE001 (Redis unreachable for a moment: try again next time)
                logger.exception("reclaiming held requests failed")

    def stop(self) -> None:
        self._stop.set()
