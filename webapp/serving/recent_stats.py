"""What a worker did over the last seconds, published with each heartbeat for the dashboard.

The heartbeat's engine stats and the worker's request metrics are cumulative; a page needs
recent figures: output tokens/s, the prefix-cache hit rate, and the TTFT and TPOT
observations of the last minute. :class:`RecentStats` keeps one snapshot of the cumulative
values per heartbeat for ``WINDOW`` seconds and publishes the differences, so any reader
(a web process that just started, ``/dashboard/`` rendered once) gets them from the
newest heartbeat alone. Latencies are published as histogram bucket counts
(vLLM's bounds, :mod:`.worker_metrics`) rather than percentiles, because counts of several
workers add up and percentiles do not.
"""
from __future__ import annotations

import time
from collections import deque
from typing import Any

from .worker_metrics import RequestMetrics

WINDOW = 60.0  # seconds behind the latency counts and the prefix-cache figures
RATE_WINDOW = 5.0  # seconds behind output tokens/s


class RecentStats:
    """Recent figures of one worker; fed by its I/O thread at each heartbeat.

    Args:
        metrics: the worker's request metrics (TTFT and TPOT histograms).
        window: seconds behind the latency counts and prefix-cache figures.
        rate_window: seconds behind ``output_tokens_per_s``.
    """

    def __init__(self, metrics: RequestMetrics, window: float = WINDOW, rate_window: float = RATE_WINDOW) -> None:
        self.metrics = metrics
        self.window = window
        self.rate_window = rate_window
        # (monotonic s, generation tokens, prefix-cache queries, hits, TTFT counts, TPOT counts)
        self._history: deque[tuple[float, int, int, int, list[int], list[int]]] = deque()

    def sample(self, stats: dict[str, Any], now: float | None = None) -> dict[str, Any]:
        """Record the cumulative values now and return the recent figures.

        Args:
            stats: the engine stats of the heartbeat (``generation_tokens_total``,
                ``prefix_cache_queries_total``, ``prefix_cache_hits_total``: tokens).
            now: ``time.monotonic()`` seconds (tests pass their own).

        Returns:
            ``window_s`` and ``rate_window_s`` (the seconds actually covered, 0 at the first
            heartbeat), ``output_tokens_per_s`` (None at the first heartbeat),
            ``prefix_cache_queries`` and ``prefix_cache_hits`` (tokens over the window),
            ``ttft_bucket_counts`` and ``tpot_bucket_counts`` (observations per bucket of
            ``worker_metrics.TTFT_BUCKETS`` / ``ITL_BUCKETS``, ``+Inf`` last, over the window).
        """
        now = time.monotonic() if now is None else now  # engine counters restart with a new engine: clamped
        current = (now, int(stats.get("generation_tokens_total", 0)), int(stats.get("prefix_cache_queries_total", 0)),
                   int(stats.get("prefix_cache_hits_total", 0)), list(self.metrics.ttft.counts),
                   list(self.metrics.tpot.counts))
        self._history.append(current)
        while now - self._history[0][0] > self.window:
            self._history.popleft()
        oldest = self._history[0]
        rate_base = next(h for h in self._history if now - h[0] <= self.rate_window)
        if rate_base is current and len(self._history) > 1:  # heartbeats further apart than the rate window
            rate_base = self._history[-2]
        elapsed = now - rate_base[0]
        return {
            "window_s": now - oldest[0],
            "rate_window_s": elapsed,
            "output_tokens_per_s": max(0, current[1] - rate_base[1]) / elapsed if elapsed > 0 else None,
            "prefix_cache_queries": max(0, current[2] - oldest[2]),
            "prefix_cache_hits": max(0, current[3] - oldest[3]),
            "ttft_bucket_counts": [a - b for a, b in zip(current[4], oldest[4])],
            "tpot_bucket_counts": [a - b for a, b in zip(current[5], oldest[5])],
        }
