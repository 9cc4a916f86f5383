"""Request-level metrics a worker accumulates and publishes with its heartbeat.

Histograms use vLLM's bucket bounds (seconds), so dashboards built for vLLM read them as is.
Aggregation across workers and the Prometheus text format live in :mod:`webapp.metrics`.
"""
from __future__ import annotations

import bisect
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
               10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
               120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


@dataclass
class Histogram:
    """Cumulative-on-export histogram: ``counts[i]`` observations fell in bucket ``i``
    (``bounds[i-1] < x <= bounds[i]``); the last count is the ``+Inf`` bucket."""

    bounds: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    sum: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        if not self.counts:
            self.counts = [0] * (len(self.bounds) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value
        self.count += 1

    def snapshot(self) -> dict[str, Any]:
        return {"bounds": list(self.bounds), "counts": list(self.counts), "sum": self.sum, "count": self.count}


class RequestMetrics:
    """TTFT, inter-token latency, time per output token and end-to-end latency of finished
    requests, and finished requests by reason. Fed by the worker's I/O thread only."""

    def __init__(self) -> None:
        self.ttft = Histogram(TTFT_BUCKETS)
        self.itl = Histogram(ITL_BUCKETS)
        self.tpot = Histogram(ITL_BUCKETS)
        self.e2e = Histogram(E2E_BUCKETS)
        self.success: Counter[str] = Counter()
        # rid -> [time of first token, time of last token, tokens so far] (monotonic seconds)
        self._live: dict[str, list[float]] = {}

    def on_delta(self, rid: str, num_new_tokens: int, step_time: float, metrics: dict[str, float],
                 finished: bool, finish_reasons: list[str | None]) -> None:
        """Account for one delta of request ``rid`` produced by the step that ended at
        ``step_time`` (``time.monotonic`` seconds); ``metrics`` are the engine's timestamps."""
        live = self._live.get(rid)
        if num_new_tokens:
            if live is None:
                first = metrics.get("first_token", step_time)
                if "arrival" in metrics:
                    self.ttft.observe(max(0.0, first - metrics["arrival"]))
                live = self._live[rid] = [first, first, 0]
            else:
                self.itl.observe(step_time - live[1])
                live[1] = step_time
            live[2] += num_new_tokens
        if finished:
            self._live.pop(rid, None)
            for reason in finish_reasons:
                self.success[reason or "abort"] += 1
            arrival, done = metrics.get("arrival"), metrics.get("finished", step_time)
            if arrival is not None:
                self.e2e.observe(max(0.0, done - arrival))
            if live is not None and live[2] > 1:
                self.tpot.observe((live[1] - live[0]) / (live[2] - 1))

    def forget(self, rid: str) -> None:
        """Drop the state of a request whose client left (its outputs are not published)."""
        self._live.pop(rid, None)

    def snapshot(self) -> dict[str, Any]:
        return {
            "request_success": dict(self.success),
            "histograms": {
                "time_to_first_token_seconds": self.ttft.snapshot(),
                "inter_token_latency_seconds": self.itl.snapshot(),
                "request_time_per_output_token_seconds": self.tpot.snapshot(),
                "e2e_request_latency_seconds": self.e2e.snapshot(),
            },
        }
