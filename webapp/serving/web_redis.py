"""A web process's Redis: one asyncio client per event loop, and the live workers of each model read through
it, cached for a fraction of a second so that requests rarely wait for Redis to know where they can go."""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

import redis.asyncio as aioredis
from django.conf import settings

from . import worker_registry

_redis_by_loop: dict[int, aioredis.Redis] = {}


def get_redis() -> aioredis.Redis:
    """An asyncio Redis client bound to the running event loop."""
    loop = asyncio.get_running_loop()
    client = _redis_by_loop.get(id(loop))
    if client is None:
        pool = aioredis.BlockingConnectionPool.from_url(settings.CELERY_BROKER_URL, max_connections=64, timeout=10)
        client = _redis_by_loop[id(loop)] = aioredis.Redis(connection_pool=pool)
    return client


WORKERS_FRESH = 0.25  # seconds a read of the live workers is used as it is
WORKERS_STALE = 1.0  # seconds an older read still answers, while a new one runs in the background


@dataclass
class _LiveWorkers:
    workers: list[dict[str, Any]] = field(default_factory=list)
    read_at: float = float("-inf")  # time.monotonic() when the last successful read started
    reading: asyncio.Future | None = None


_live_workers: dict[tuple[int, str], _LiveWorkers] = {}


async def _read_live_workers(entry: _LiveWorkers, model: str) -> None:
    started = time.monotonic()
    try:
        entry.workers = await worker_registry.live_workers(get_redis(), model)
        entry.read_at = started
    finally:
        entry.reading = None


def retrieve_exception(future: asyncio.Future) -> None:
    """A done callback that retrieves a background future's exception (it was logged or is reported to
    the next caller), so that asyncio does not warn of it as never retrieved."""
    if not future.cancelled():
        future.exception()  # a failed background read is reported to the next caller that waits


async def heartbeating_workers(model: str, stale: float = WORKERS_STALE) -> list[dict[str, Any]]:
    """Workers of ``model`` with a fresh heartbeat, admitting requests or shutting down.

    Read from Redis at most every ``WORKERS_FRESH`` seconds per process (concurrent callers
    share one read); a read up to ``WORKERS_STALE`` seconds old answers at once while the next
    one runs in the background, so a request rarely waits for Redis here; unless it found no
    worker, which is answered fresh. ``stale``: the age up to which a read answers at once.

    Raises:
        RedisError: Redis could not be read and no recent enough answer is at hand.
    """
    entry = _live_workers.setdefault((id(asyncio.get_running_loop()), model), _LiveWorkers())
    age = time.monotonic() - entry.read_at
    if age > WORKERS_FRESH and entry.reading is None:
        entry.reading = asyncio.ensure_future(_read_live_workers(entry, model))
        entry.reading.add_done_callback(retrieve_exception)
    # A stale empty answer is not given: it would turn into a 503 just after a worker became ready.
    if age > max(stale, WORKERS_FRESH) or (age > WORKERS_FRESH and not entry.workers):
        await asyncio.shield(entry.reading)
    return entry.workers


async def model_workers(model: str, stale: float = WORKERS_STALE) -> list[dict[str, Any]]:
    """Live workers of ``model`` that admit requests (not shutting down); see
    :func:`heartbeating_workers` for how fresh the answer is (``stale=0``: at most
    ``WORKERS_FRESH`` seconds old, as a new request wants it: a worker unloaded a moment ago must
    not take it, or it waits for a worker of the model to come back).

    Raises:
        RedisError: Redis could not be read and no recent enough answer is at hand.
    """
    return [w for w in await heartbeating_workers(model, stale) if w.get("live")]
