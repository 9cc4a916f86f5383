"""Requests a worker took from its model's queue but could not start yet, and how the other
workers take them over when that worker dies.

A worker reserves one message at a time and, when its engine is full, waits in the task for a
free slot. If the worker is killed then, the broker puts the message back only after its
visibility timeout. So while a task waits it records the request in Redis
(``tessera:held:<model>``, field request id -> JSON ``{"worker", "payload"}``) and removes
the record once it has claimed the request or given it back. Every worker of the model checks
that hash once a second; the records of a worker whose heartbeat has expired are taken (one
``HDEL`` each: exactly one survivor wins) and put back on the model's queue, within about
``HEARTBEAT_TTL + RECLAIM_INTERVAL`` seconds (5 s) of the death. When the broker redelivers the
original message later, the request's claim (kept ``CLAIM_DONE_TTL`` seconds after it finished)
stops it running twice.
"""
from __future__ import annotations

import json
import logging
import threading
from typing import Any, Callable

from . import registry

logger = logging.getLogger(__name__)

RECLAIM_INTERVAL = 1.0  # seconds between two checks for requests held by dead workers


def held_key(model: str) -> str:
    return f"tessera:held:{model}"


def hold(redis, model: str, worker_id: str, payload: dict[str, Any]) -> None:
    """Record that ``worker_id`` holds ``payload`` (a ``tessera.generate`` task's) without having started it."""
    redis.hset(held_key(model), payload["rid"], json.dumps({"worker": worker_id, "payload": payload}))


def release(redis, model: str, request_id: str) -> None:
    """The holder claimed the request or gave it back: forget the record."""
    redis.hdel(held_key(model), request_id)


def take_orphans(redis, model: str) -> list[dict[str, Any]]:
    """Payloads of the requests held by workers whose heartbeat has expired, removed from the hash
    (each is returned to exactly one caller, whatever the number of workers calling at once)."""
    records = {rid.decode(): json.loads(raw) for rid, raw in redis.hgetall(held_key(model)).items()}
    if not records:
        return []
    owners = sorted({r["worker"] for r in records.values()})
    alive = dict(zip(owners, (raw is not None for raw in redis.mget([registry.worker_key(w) for w in owners]))))
    taken = []
    for rid, record in records.items():
        if not alive[record["worker"]] and redis.hdel(held_key(model), rid):
            taken.append(record["payload"])
    return taken


class OrphanReclaimer(threading.Thread):
    """Puts the held requests of dead workers of ``model`` back on its queue, once a second.

    Args:
        redis: a synchronous ``redis.Redis``.
        requeue: sends one payload to the model's queue (:func:`.task_messages.enqueue_blocking`).
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
                for payload in take_orphans(self._redis, self._model):
                    logger.warning("request %s was held by a worker that died; putting it back on the queue",
                                   payload["rid"])
                    self._requeue(payload)
            except Exception:  # noqa: BLE001 (Redis unreachable for a moment: try again next time)
                logger.exception("reclaiming held requests failed")

    def stop(self) -> None:
        self._stop.set()
