"""Request-level metrics a worker accumulates, and the counter increments it adds to its
model's totals in Redis.

Histograms use vLLM's bucket bounds (seconds), so dashboards built for vLLM read them as is.
Every cumulative value (engine token and preemption counters, finished requests by reason,
histogram buckets, sums and counts) is kept flat, ``field -> value`` (see :func:`flat_totals`).
With each heartbeat a worker adds what grew since its previous one to the model's totals hash
in Redis (:class:`CounterDeltas`); ``/metrics`` exports those totals, so they never go
backwards when a worker stops, dies or restarts (a killed worker loses at most the increments
of its last heartbeat interval, which no scraper had seen). The Prometheus text format lives
in :mod:`webapp.metrics`.
"""
from __future__ import annotations

import bisect
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from inference.engine.iteration_stats import ITERATION_TOKEN_BUCKETS

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
               10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
               120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)  # vLLM's 1-2-5
HISTOGRAM_BOUNDS = {  # vLLM's histogram names (without ``vllm:``) -> bucket bounds
    "time_to_first_token_seconds": TTFT_BUCKETS,
    "inter_token_latency_seconds": ITL_BUCKETS,
    "request_time_per_output_token_seconds": ITL_BUCKETS,
    "e2e_request_latency_seconds": E2E_BUCKETS,
    "request_queue_time_seconds": E2E_BUCKETS,
    "request_prefill_time_seconds": E2E_BUCKETS,
    "request_decode_time_seconds": E2E_BUCKETS,
    "request_inference_time_seconds": E2E_BUCKETS,
    "request_generation_tokens": TOKEN_BUCKETS,
    "request_prompt_tokens": TOKEN_BUCKETS,
}
ENGINE_HISTOGRAM_BOUNDS = {  # histograms the engine itself keeps (EngineStats), not the worker
    "iteration_tokens_total": ITERATION_TOKEN_BUCKETS,
}
ENGINE_COUNTERS = ("prompt_tokens_total", "generation_tokens_total", "num_preemptions_total",  # engine stats
                   "prefix_cache_queries_total", "prefix_cache_hits_total", "num_swapped_out_total")
SUCCESS_PREFIX = "request_success:"  # + finish reason


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

    def flat(self, name: str) -> dict[str, float]:
        """``{name}:bucket:{i}`` (non-cumulative counts), ``{name}:sum`` and ``{name}:count``."""
        values: dict[str, float] = {f"{name}:bucket:{i}": c for i, c in enumerate(self.counts) if c}
        values[f"{name}:sum"] = self.sum
        values[f"{name}:count"] = self.count
        return values


class RequestMetrics:
    """TTFT, inter-token latency, time per output token, end-to-end latency, queue time and
    prefill time of requests, and finished requests by reason. Fed by the worker's I/O thread only."""

    def __init__(self) -> None:
        self.histograms = {name: Histogram(bounds) for name, bounds in HISTOGRAM_BOUNDS.items()}
        self.ttft = self.histograms["time_to_first_token_seconds"]
        self.itl = self.histograms["inter_token_latency_seconds"]
        self.tpot = self.histograms["request_time_per_output_token_seconds"]
        self.e2e = self.histograms["e2e_request_latency_seconds"]
        self.queue = self.histograms["request_queue_time_seconds"]  # arrival -> first scheduled
        self.prefill = self.histograms["request_prefill_time_seconds"]  # first scheduled -> first token
        self.decode = self.histograms["request_decode_time_seconds"]  # first token -> last token
        self.inference = self.histograms["request_inference_time_seconds"]  # first scheduled -> finished
        self.generation_tokens = self.histograms["request_generation_tokens"]  # output tokens, all choices
        self.prompt_tokens = self.histograms["request_prompt_tokens"]
        self.success: Counter[str] = Counter()
        # rid -> [time of first token, time of last token, tokens so far] (monotonic seconds)
        self._live: dict[str, list[float]] = {}

    def on_delta(self, rid: str, num_new_tokens: int, step_time: float, metrics: dict[str, float],
                 finished: bool, finish_reasons: list[str | None], num_prompt_tokens: int | None = None) -> None:
        """Account for one delta of request ``rid`` produced by the step that ended at
        ``step_time`` (``time.monotonic`` seconds); ``metrics`` are the engine's timestamps;
        ``num_prompt_tokens`` (when known) goes to the prompt-length histogram once the request finishes."""
        live = self._live.get(rid)
        if num_new_tokens:
            if live is None:
                first = metrics.get("first_token", step_time)
                if "arrival" in metrics:
                    self.ttft.observe(max(0.0, first - metrics["arrival"]))
                if "first_scheduled" in metrics:
                    self.prefill.observe(max(0.0, first - metrics["first_scheduled"]))
                    if "arrival" in metrics:
                        self.queue.observe(max(0.0, metrics["first_scheduled"] - metrics["arrival"]))
                live = self._live[rid] = [first, first, 0]
            else:
                self.itl.observe(step_time - live[1])
                live[1] = step_time
            live[2] += num_new_tokens
        if finished:
            self._live.pop(rid, None)
            # once per request, like every histogram here (a request with n choices: its first choice's reason)
            self.success[(finish_reasons[0] if finish_reasons else None) or "abort"] += 1
            arrival, done = metrics.get("arrival"), metrics.get("finished", step_time)
            if arrival is not None:
                self.e2e.observe(max(0.0, done - arrival))
            if "first_scheduled" in metrics:
                self.inference.observe(max(0.0, done - metrics["first_scheduled"]))
            if num_prompt_tokens:
                self.prompt_tokens.observe(num_prompt_tokens)
            if live is not None:
                self.decode.observe(live[1] - live[0])
                self.generation_tokens.observe(live[2])
            if live is not None and live[2] > 1:
                self.tpot.observe((live[1] - live[0]) / (live[2] - 1))

    def forget(self, rid: str) -> None:
        """Drop the state of a request whose client left (its outputs are not published)."""
        self._live.pop(rid, None)

    def flat(self) -> dict[str, float]:
        """Finished requests by reason and every histogram, flat (see :func:`flat_totals`)."""
        values: dict[str, float] = {SUCCESS_PREFIX + reason: n for reason, n in self.success.items()}
        for name, histogram in self.histograms.items():
            values.update(histogram.flat(name))
        return values


def flat_totals(engine_stats: dict[str, Any], metrics: RequestMetrics) -> dict[str, float]:
    """All cumulative values of one worker: the engine's counters (``ENGINE_COUNTERS``) and its
    tokens-per-step histogram, ``request_success:<reason>``, and ``<histogram>:bucket:<i>`` / ``:sum`` /
    ``:count``."""
    values = {name: engine_stats.get(name, 0) for name in ENGINE_COUNTERS}
    counts = engine_stats.get("iteration_tokens_counts") or ()
    values.update({f"iteration_tokens_total:bucket:{i}": c for i, c in enumerate(counts) if c})
    values["iteration_tokens_total:sum"] = engine_stats.get("iteration_tokens_sum", 0)
    values["iteration_tokens_total:count"] = sum(counts)
    values.update(metrics.flat())
    return values


class CounterDeltas:
    """What a worker's cumulative values grew by since the last increments were committed."""

    def __init__(self) -> None:
        self._committed: dict[str, float] = {}

    def since_commit(self, totals: dict[str, float]) -> dict[str, float]:
        """``field -> increase`` for the fields of ``totals`` that grew (nothing when none did)."""
        return {k: v - self._committed.get(k, 0) for k, v in totals.items() if v != self._committed.get(k, 0)}

    def commit(self, totals: dict[str, float]) -> None:
        """Record that the increments up to ``totals`` are in Redis."""
        self._committed = dict(totals)
