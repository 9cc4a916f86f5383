"""One reader of the workers' published stats per web process, shared by every dashboard viewer.

While at least one viewer is subscribed, the poller reads Redis every heartbeat interval
(the live workers' heartbeats, with their recent figures, and their models' totals) and hands
each subscriber the new :class:`State`; the tenants' usage comes from the database every
``TENANT_REFRESH`` seconds. So the Redis and database load does not grow with the
number of open pages. With no subscriber it stops; :meth:`StatsPoller.latest` then reads
once more on demand.
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Awaitable, Callable

from asgiref.sync import sync_to_async

from webapp.serving.web_redis import get_redis
from webapp.serving.request_queue import queued_counts
from webapp.serving.worker_registry import HEARTBEAT_INTERVAL, live_workers, model_totals

from .served_shares import ServedShares, read_served
from .stats import ModelStats, Sample, WorkerStats, idle_workers, model_stats
from .tenant_usage import TenantUsage, tenant_usage_today

logger = logging.getLogger(__name__)

TENANT_REFRESH = 5.0  # seconds between reads of the tenants' usage
FRESH = HEARTBEAT_INTERVAL / 2  # seconds within which a sample is recent enough for a new viewer


@dataclass(frozen=True)
class State:
    """What every viewer's snapshot is cut from: the sample ``time`` (Unix s), the models'
    numbers, the workers that serve no model, the tenants' rows and each tenant's share of the
    tokens served over the last seconds (:mod:`.served_shares`; slug -> 0..1)."""

    time: float
    models: list[ModelStats]
    idle_workers: list[WorkerStats]
    tenants: list[TenantUsage]
    served_shares: dict[str, float] = field(default_factory=dict)


Subscriber = Callable[[State], Awaitable[None]]


class StatsPoller:
    """Polls Redis for the subscribers of one event loop (see the module docstring)."""

    def __init__(self, interval: float = HEARTBEAT_INTERVAL) -> None:
        self.interval = interval
        self._subscribers: set[Subscriber] = set()
        self._task: asyncio.Task | None = None
        self._tenants: list[TenantUsage] = []
        self._tenants_read = 0.0
        self._state: State | None = None
        self._shares = ServedShares()

    def subscribe(self, subscriber: Subscriber) -> None:
        """Call ``subscriber`` with every new state until :meth:`unsubscribe`."""
        self._subscribers.add(subscriber)
        if self._task is None or self._task.done():
            self._task = asyncio.ensure_future(self._run())

    def unsubscribe(self, subscriber: Subscriber) -> None:
        self._subscribers.discard(subscriber)

    async def latest(self) -> State:
        """The newest state, read now unless a sample is fresh."""
        if self._state is None or time.time() - self._state.time > FRESH:
            await self._poll()
        return self._state

    async def _run(self) -> None:
        while self._subscribers:
            started = time.monotonic()
            try:
                state = await self._poll()
            except Exception as error:  # Redis down or restarting: the viewers stay connected, retry next time
                logger.warning("reading the workers' stats failed: %s", error)
            else:
                await asyncio.gather(*(s(state) for s in list(self._subscribers)), return_exceptions=True)
            await asyncio.sleep(max(0.0, self.interval - (time.monotonic() - started)))

    async def _poll(self) -> State:
        redis = get_redis()
        workers = await live_workers(redis, include_idle=True)  # idle, loading and failed ones too
        now = time.time()
        names = sorted({w["model"] for w in workers if w.get("model")})
        sample = Sample(now, tuple(workers), await model_totals(redis, names) if names else {},
                        await queued_counts(redis, names) if names else {})
        if now - self._tenants_read >= TENANT_REFRESH:
            self._tenants = await sync_to_async(tenant_usage_today)()
            self._tenants_read = now
        shares = self._shares.add(now, await read_served(redis, names))
        self._state = State(now, model_stats(sample), idle_workers(sample), self._tenants, shares)
        return self._state


_pollers: dict[int, StatsPoller] = {}


def stats_poller() -> StatsPoller:
    """The poller of the running event loop (one per web process under Daphne)."""
    loop = asyncio.get_running_loop()
    poller = _pollers.get(id(loop))
    if poller is None:
        poller = _pollers[id(loop)] = StatsPoller()
    return poller
