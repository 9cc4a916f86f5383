"""Each tenant's share of the tokens the workers served over the last seconds, for the live
share chart (against the tenant's GPU share).

The counts are the ones the workers' dequeue charges the tenants' virtual token counters with
(``served:<tenant>`` of :func:`webapp.transport.keys.fair_key`, :mod:`webapp.serving.ledger`): prompt
tokens at a request's first output, then every output token. A share is the tenant's
increase over ``WINDOW`` seconds divided by every tenant's (requests of no tenant included).
"""
from __future__ import annotations

from collections import deque

from webapp.serving.request_queue import served_tokens
from webapp.transport.keys import fair_key

WINDOW = 10.0  # seconds over which a share is measured


async def read_served(redis, models: list[str]) -> dict[str | None, int]:
    """Tenant slug (None: no tenant) -> tokens served for it by all workers of ``models``, ever."""
    if not models:
        return {}
    pipe = redis.pipeline(transaction=False)
    for model in models:
        pipe.hgetall(fair_key(model))
    total: dict[str | None, int] = {}
    for raw in await pipe.execute():
        for tenant, tokens in served_tokens(raw).items():
            total[tenant] = total.get(tenant, 0) + tokens
    return total


class ServedShares:
    """The served-token counts of the last ``window`` seconds, and the shares they give."""

    def __init__(self, window: float = WINDOW) -> None:
        self.window = window
        self._points: deque[tuple[float, dict[str | None, int]]] = deque()

    def add(self, now: float, served: dict[str | None, int]) -> dict[str, float]:
        """Record the counts read at ``now`` (Unix s); returns tenant slug -> share (0..1) of the
        tokens served since the oldest point within the window (empty when none were served)."""
        self._points.append((now, served))
        while len(self._points) > 2 and now - self._points[1][0] >= self.window:
            self._points.popleft()
        oldest = self._points[0][1]
        grown = {t: n - oldest.get(t, 0) for t, n in served.items()}
        grown = {t: n for t, n in grown.items() if n > 0}  # a Redis restart starts the counts afresh
        total = sum(grown.values())
        return {t: n / total for t, n in grown.items() if t is not None} if total else {}
