"""Redis keys shared by web processes and workers: heartbeats, worker info and request claims.

* ``tessera:workers`` — sorted set, worker id -> time (s) of its last heartbeat.
* ``tessera:worker:<id>`` — JSON :class:`WorkerInfo` plus live stats, expiring
  ``HEARTBEAT_TTL`` seconds after the last heartbeat: a worker that died vanishes.
* ``tessera:claim:<request id>`` — the id of the worker whose engine took the request, or
  ``"aborted"`` when the client left before any worker took it. Set with NX, so exactly
  one party wins: a request is never run twice, and an abort is never lost. Kept
  ``CLAIM_DONE_TTL`` seconds after the request finished, for late redeliveries.
* ``tessera:metrics:<model>`` — hash, the model's cumulative metrics over all its workers
  past and present (:mod:`.worker_metrics` names the fields), plus ``created`` (the Unix
  time the totals started, exported as ``_created``). Workers add increments; never expires.
"""
from __future__ import annotations

import json
import time
from typing import Any

WORKERS_KEY = "tessera:workers"
HEARTBEAT_INTERVAL = 0.5  # seconds between heartbeats
HEARTBEAT_TTL = 4  # seconds after which a silent worker counts as dead
CLAIM_TTL = 3600  # seconds
CLAIM_DONE_TTL = 300  # seconds a claim outlives its finished request (longer than the broker's redelivery)
ABORTED = "aborted"


def worker_key(worker_id: str) -> str:
    return f"tessera:worker:{worker_id}"


def claim_key(request_id: str) -> str:
    return f"tessera:claim:{request_id}"


def metrics_key(model: str) -> str:
    return f"tessera:metrics:{model}"


def counter_increment_commands(model: str, increments: dict[str, float]) -> list[tuple[str, tuple, dict]]:
    """Redis commands that add ``increments`` (field -> amount) to ``model``'s totals; run them
    in one MULTI/EXEC so the totals never hold half a heartbeat's increments."""
    key = metrics_key(model)
    return [("hsetnx", (key, "created", time.time()), {}),
            *[("hincrbyfloat", (key, name, amount), {}) for name, amount in increments.items()]]


async def model_totals(redis, models: list[str]) -> dict[str, dict[str, float]]:
    """``model -> {field: value}`` of the models' cumulative metrics (empty when none yet)."""
    pipe = redis.pipeline(transaction=False)
    for model in models:
        pipe.hgetall(metrics_key(model))
    raw = await pipe.execute()
    return {model: {k.decode(): float(v) for k, v in values.items()} for model, values in zip(models, raw)}


def heartbeat_commands(worker_id: str, info: dict[str, Any]) -> list[tuple[str, tuple, dict]]:
    """Redis commands ``(method, args, kwargs)`` of one heartbeat, for a pipeline."""
    now = time.time()
    return [
        ("set", (worker_key(worker_id), json.dumps(info)), {"ex": HEARTBEAT_TTL}),
        ("zadd", (WORKERS_KEY, {worker_id: now}), {}),
        ("zremrangebyscore", (WORKERS_KEY, 0, now - 3600), {}),
    ]


async def live_workers(redis, model: str | None = None) -> list[dict[str, Any]]:
    """Info dicts of the workers whose heartbeat is fresh, optionally of one model only.

    ``redis`` is a ``redis.asyncio.Redis``. Each dict has at least ``id``, ``model``,
    ``control`` (its control channel), ``max_model_len`` and ``stats``.
    """
    ids = await redis.zrangebyscore(WORKERS_KEY, time.time() - HEARTBEAT_TTL, "+inf")
    if not ids:
        return []
    raw = await redis.mget([worker_key(i.decode() if isinstance(i, bytes) else i) for i in ids])
    workers = [json.loads(r) for r in raw if r]
    return [w for w in workers if model is None or w["model"] == model]


async def worker_info(redis, worker_id: str) -> dict[str, Any] | None:
    """The live worker's info, or None when its heartbeat has expired (it died or left)."""
    raw = await redis.get(worker_key(worker_id))
    return json.loads(raw) if raw else None
