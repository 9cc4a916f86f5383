"""Workers and claims in Redis: heartbeats and worker info, request claims, and the models' metric totals
(the keys: :mod:`webapp.transport.keys`).

A worker's heartbeat (every ``HEARTBEAT_INTERVAL`` seconds) writes its info with a TTL of
``HEARTBEAT_TTL`` seconds: a worker that died vanishes. A request's claim names the worker whose
engine took it, ``ABORTED`` when the client left before any worker took it, or ``REQUEUED`` when
the worker that took it died before starting it and another worker put it back on the queue
(:mod:`.held`). It is set by :func:`claim` only when absent or ``REQUEUED``, so exactly one party
wins: a request is never run by two workers, and an abort is never lost. It is kept
``CLAIM_DONE_TTL`` seconds after the request finished, for late redeliveries. The models'
cumulative metrics (:mod:`.worker_metrics` names the fields) are hashes to which workers add
increments; they never expire.
"""
from __future__ import annotations

import json
import time
from typing import Any

from webapp.transport import queue_scripts
from webapp.transport.keys import METRICS_MODELS_KEY, WORKERS_KEY, claim_key, metrics_key, worker_key

HEARTBEAT_INTERVAL = 0.5  # seconds between heartbeats
HEARTBEAT_TTL = 4  # seconds after which a silent worker counts as dead
CLAIM_TTL = 3600  # seconds
CLAIM_DONE_TTL = 300  # seconds a claim outlives its finished request (longer than the broker's redelivery)
ABORTED = "aborted"
REQUEUED = "requeued"


def claim(redis, request_id: str, owner: str, client=None):
    """Claim ``request_id`` for ``owner`` (a worker id, or ``ABORTED``) if nobody holds it: the
    claim is absent, or ``REQUEUED`` (its first worker died before starting it). Returns 1 when
    ``owner`` won, else 0 (an awaitable with a ``redis.asyncio`` client; with ``client``, a
    pipeline, the result comes from its ``execute``)."""
    return redis.register_script(queue_scripts.CLAIM)(keys=[claim_key(request_id)],
                                                      args=[owner, CLAIM_TTL, REQUEUED], client=client)


def counter_increment_commands(model: str, increments: dict[str, float]) -> list[tuple[str, tuple, dict]]:
    """Redis commands that add ``increments`` (field -> amount) to ``model``'s totals; run them
    in one MULTI/EXEC so the totals never hold half a heartbeat's increments."""
    key = metrics_key(model)
    return [("hsetnx", (key, "created", time.time()), {}), ("sadd", (METRICS_MODELS_KEY, model), {}),
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


async def live_workers(redis, model: str | None = None, include_idle: bool = False) -> list[dict[str, Any]]:
    """Info dicts of the workers whose heartbeat is fresh and that serve a model, optionally
    ``model`` only.

    ``redis`` is a ``redis.asyncio.Redis``. Each dict has at least ``id``, ``model``,
    ``control`` (its control channel), ``max_model_len`` and ``stats``. Workers without a
    model (idle, loading, failed: ``model`` is None) are left out unless ``include_idle``.
    """
    ids = await redis.zrangebyscore(WORKERS_KEY, time.time() - HEARTBEAT_TTL, "+inf")
    raw = await redis.mget([_worker_key(i) for i in ids]) if ids else []
    return [w for w in _decode(raw)
            if (include_idle and model is None) or (w.get("model") and (model is None or w["model"] == model))]


def all_workers(redis) -> list[dict[str, Any]]:
    """Info dicts of every worker with a fresh heartbeat, with or without a model (``state``
    says which: ``idle``, ``loading``, ``ready``, ``unloading``, ``failed``); ``redis`` is a
    synchronous ``redis.Redis``."""
    ids = redis.zrangebyscore(WORKERS_KEY, time.time() - HEARTBEAT_TTL, "+inf")
    return _decode(redis.mget([_worker_key(i) for i in ids]) if ids else [])


def _worker_key(worker_id: bytes | str) -> str:
    return worker_key(worker_id.decode() if isinstance(worker_id, bytes) else worker_id)


def _decode(raw: list[bytes | None]) -> list[dict[str, Any]]:
    return [json.loads(r) for r in raw if r]


async def worker_info(redis, worker_id: str) -> dict[str, Any] | None:
    """The live worker's info, or None when its heartbeat has expired (it died or left)."""
    raw = await redis.get(worker_key(worker_id))
    return json.loads(raw) if raw else None
