"""A supervised worker's slot: what the worker in one of ``serve``'s worker slots serves, kept in Redis.

``serve`` starts each worker with ``TESSERA_WORKER_SLOT`` (its host, its own pid and the worker's
index) and, when that worker dies, starts the next one with the same slot. The worker records its model
there when a load finishes (the one on its command line, or one the admin loaded) and records "none"
when the admin unloads it; a worker that starts in a recorded slot comes back serving that, not the
model on ``serve``'s command line. A worker started by hand has no slot and always starts with its flags.
"""
from __future__ import annotations

import json
import logging

import redis

from .model_spec import ModelSpec

logger = logging.getLogger(__name__)

SLOT_TTL = 7 * 24 * 3600  # seconds a slot's record outlives its last change (serve runs are not tracked)


def slot_key(slot: str) -> str:
    return f"tessera:worker-slot:{slot}"


def record(client: redis.Redis, slot: str | None, spec: ModelSpec | None) -> None:
    """Remember that the worker in ``slot`` serves ``spec`` (None: no model). Nothing without a slot; a
    Redis error is logged, not raised (the worker goes on serving)."""
    if not slot:
        return
    try:
        client.set(slot_key(slot), json.dumps({"spec": spec.to_json() if spec else None}), ex=SLOT_TTL)
    except redis.RedisError:
        logger.exception("could not record worker slot %s", slot)


def recorded(client: redis.Redis, slot: str | None) -> tuple[bool, ModelSpec | None]:
    """``(True, spec)`` when ``slot`` has a record (``spec`` None: the worker had no model), else
    ``(False, None)``; an unreadable record counts as none."""
    if not slot:
        return False, None
    try:
        raw = client.get(slot_key(slot))
        if raw is None:
            return False, None
        data = json.loads(raw)["spec"]
        return True, ModelSpec.from_json(data) if data is not None else None
    except (redis.RedisError, ValueError, KeyError, TypeError):
        logger.exception("ignoring worker slot %s's record", slot)
        return False, None
