"""A supervised worker's slot: what the worker in one of ``serve``'s worker slots serves, kept in Redis
(:func:`webapp.transport.keys.slot_key`).

``serve`` starts each worker with ``TESSERA_WORKER_SLOT`` (its host, a nonce of this ``serve`` run and the
worker's index) and, when that worker dies, starts the next one with the same slot. The worker records its
model there when a load finishes (the one on its command line, or one the admin loaded) and records "none"
when the admin unloads it; a worker that starts in a recorded slot comes back serving that, not the model
on ``serve``'s command line. A new ``serve`` run has new slots, so it always starts with its flags; it
deletes its slots' records when it stops. A worker started by hand has no slot and starts with its flags.

A recorded model whose worker keeps dying (a crash while loading, an engine that fails at once) is resumed
at most ``MAX_RESUMES`` times within ``RESUME_WINDOW`` seconds; the next worker starts with the flags.
"""
from __future__ import annotations

import json
import logging
import time

import redis

from webapp.transport.keys import slot_key

from .model_spec import ModelSpec

logger = logging.getLogger(__name__)

MAX_RESUMES = 2  # resumes of one slot's record within RESUME_WINDOW before the flags' model is used instead
RESUME_WINDOW = 600.0  # seconds; serve's own restart window (it gives up after 5 restarts in it)


def record(client: redis.Redis, slot: str | None, spec: ModelSpec | None, resumes: list[float] = ()) -> None:
    """Remember that the worker in ``slot`` serves ``spec`` (None: no model); ``resumes``: the times
    (``time.time()``) this record was resumed by a restarted worker. Nothing without a slot; a Redis error
    is logged, not raised (the worker goes on serving)."""
    if not slot:
        return
    try:
        client.set(slot_key(slot), json.dumps({"spec": spec.to_json() if spec else None, "resumes": list(resumes)}))
    except redis.RedisError:
        logger.exception("could not record worker slot %s", slot)


def resume(client: redis.Redis, slot: str | None) -> tuple[bool, ModelSpec | None, list[float]]:
    """What a worker starting in ``slot`` should serve: ``(True, spec, resumes)`` to resume the record
    (``spec`` None: no model; ``resumes`` with this resume added), or ``(False, None, [])`` to start with
    the flags (no slot, no record, an unreadable record, or ``MAX_RESUMES`` resumes within
    ``RESUME_WINDOW``)."""
    if not slot:
        return False, None, []
    try:
        raw = client.get(slot_key(slot))
        if raw is None:
            return False, None, []
        data = json.loads(raw)
        spec = ModelSpec.from_json(data["spec"]) if data["spec"] is not None else None
        now = time.time()
        resumes = [float(t) for t in data.get("resumes", []) if now - float(t) < RESUME_WINDOW]
    except (redis.RedisError, ValueError, KeyError, TypeError):
        logger.exception("ignoring worker slot %s's record", slot)
        return False, None, []
    if len(resumes) >= MAX_RESUMES:
        logger.warning("worker slot %s: its model %s was resumed %d times in %.0f s; starting with the flags",
                       slot, spec.name if spec else "(none)", len(resumes), RESUME_WINDOW)
        return False, None, []
    return True, spec, resumes + [now]


def forget(client: redis.Redis, slots: list[str]) -> None:
    """Delete the records of ``slots`` (``serve`` stopping); a Redis error is ignored."""
    try:
        if slots:
            client.delete(*[slot_key(slot) for slot in slots])
    except redis.RedisError:
        pass
