"""The dashboard's numbers, from what the workers publish to Redis.

A :class:`Sample` is one read of Redis: the live workers' heartbeats and the models'
cumulative totals (:mod:`webapp.serving.worker_metrics`). Each heartbeat carries the worker's
recent figures (:mod:`webapp.serving.recent_stats`): output tokens/s over the last seconds,
prefix-cache queries and hits and the TTFT and TPOT histogram counts of the last minute.
:func:`summarize` adds those up over workers and models and takes the percentiles from the
summed counts, interpolating inside a bucket as Prometheus' ``histogram_quantile`` does, so
the page and a Grafana panel of ``histogram_quantile(0.99, rate(..._bucket[1m]))`` agree.

Everything here is plain data; :mod:`.stats_poller` reads Redis, :mod:`.access` filters per viewer.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from webapp.serving.worker_metrics import HISTOGRAM_BOUNDS

TTFT = "time_to_first_token_seconds"
TPOT = "request_time_per_output_token_seconds"


@dataclass(frozen=True)
class Sample:
    """One read of Redis at ``time`` (Unix seconds): ``workers`` are the live heartbeat dicts
    (:func:`webapp.serving.worker_registry.live_workers`), ``totals`` maps model -> totals field -> value,
    ``queued`` model -> requests queued in Redis, not yet taken by a worker."""

    time: float
    workers: tuple[dict[str, Any], ...]
    totals: dict[str, dict[str, float]]
    queued: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class WorkerStats:
    """One live worker as the overview lists it; ``output_tokens_per_s`` is None until its
    second heartbeat."""

    id: str
    model: str
    host: str
    pid: int | None
    device: str
    state: str
    uptime_s: float
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    output_tokens_per_s: float | None
    num_preemptions_total: int


@dataclass(frozen=True)
class ModelStats:
    """One served model over its live workers.

    ``ttft_counts`` / ``tpot_counts`` are the workers' histogram bucket counts of the last
    ``recent_stats.WINDOW`` seconds, per bucket of ``HISTOGRAM_BOUNDS`` (``+Inf`` last); the
    ``prefix_cache_*`` figures are tokens over the same window; ``num_preemptions_total`` is
    cumulative over all the model's workers, past ones included; ``num_queued`` the requests waiting in
    Redis for a worker (counted as waiting besides the workers' own backlogs).
    """

    name: str
    workers: tuple[WorkerStats, ...]
    num_total_blocks: int
    num_free_blocks: int
    prefix_cache_queries: float
    prefix_cache_hits: float
    num_preemptions_total: float
    ttft_counts: tuple[float, ...]
    tpot_counts: tuple[float, ...]
    num_queued: int = 0


def histogram_quantile(q: float, bounds: tuple[float, ...], counts: tuple[float, ...]) -> float | None:
    """The ``q``-quantile (0..1) of observations binned in ``counts`` (non-cumulative; one more
    than ``bounds``, the last being ``+Inf``), in the unit of ``bounds``; None when empty.

    As Prometheus' ``histogram_quantile``: linear inside the bucket that holds the rank, the
    first bucket starting at 0, and the highest finite bound for ranks in ``+Inf``.

    Raises:
        ValueError: ``q`` outside [0, 1] or ``counts`` of the wrong length.
    """
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"q must be within [0, 1], got {q}")
    if len(counts) != len(bounds) + 1:
        raise ValueError(f"counts must have len(bounds) + 1 = {len(bounds) + 1} entries, got {len(counts)}")
    total = sum(counts)
    if total <= 0:
        return None
    rank, below = q * total, 0.0
    for i, count in enumerate(counts[:-1]):
        if count > 0 and below + count >= rank:
            lower = bounds[i - 1] if i else 0.0
            return lower + (bounds[i] - lower) * (rank - below) / count
        below += count
    return bounds[-1]


def _zeros(name: str) -> tuple[float, ...]:
    return (0.0,) * (len(HISTOGRAM_BOUNDS[name]) + 1)


def _counts(recent: dict[str, Any], field: str, name: str) -> tuple[float, ...]:
    counts = recent.get(field) or []
    return tuple(counts) if len(counts) == len(HISTOGRAM_BOUNDS[name]) + 1 else _zeros(name)


def _add(a: tuple[float, ...], b: tuple[float, ...]) -> tuple[float, ...]:
    return tuple(x + y for x, y in zip(a, b))


def worker_stats(sample: Sample, worker: dict[str, Any]) -> WorkerStats:
    """The overview row of ``worker`` (a heartbeat dict of ``sample``; ``model`` is "" for a
    worker that holds no model, e.g. while it loads one)."""
    stats, recent = worker.get("stats", {}), worker.get("recent", {})
    total = stats.get("num_total_blocks", 0)
    state = worker.get("state") or ("ready" if worker.get("live", True) else "stopping")  # workers before states
    return WorkerStats(
        id=worker["id"], model=worker.get("model") or "", host=worker.get("host", ""), pid=worker.get("pid"),
        device=str(worker.get("device") or ""), state=state,
        uptime_s=max(0.0, sample.time - worker.get("started", sample.time)),
        num_running=int(stats.get("num_running", 0)), num_waiting=int(stats.get("num_waiting", 0)),
        kv_cache_usage=(total - stats.get("num_free_blocks", 0)) / total if total else 0.0,
        output_tokens_per_s=recent.get("output_tokens_per_s"),
        num_preemptions_total=int(stats.get("num_preemptions_total", 0)))


def idle_workers(sample: Sample) -> list[WorkerStats]:
    """The rows of the live workers in ``sample`` that serve no model (idle, loading, failed)."""
    return [worker_stats(sample, w) for w in sample.workers if not w.get("model")]


def model_stats(sample: Sample) -> list[ModelStats]:
    """Every model with a live worker in ``sample``, by name."""
    models = []
    for name in sorted({w["model"] for w in sample.workers if w.get("model")}):
        live = [w for w in sample.workers if w["model"] == name]
        recents = [w.get("recent", {}) for w in live]
        ttft, tpot = _zeros(TTFT), _zeros(TPOT)
        for recent in recents:
            ttft = _add(ttft, _counts(recent, "ttft_bucket_counts", TTFT))
            tpot = _add(tpot, _counts(recent, "tpot_bucket_counts", TPOT))
        models.append(ModelStats(
            name=name, workers=tuple(worker_stats(sample, w) for w in live),
            num_total_blocks=sum(w["stats"].get("num_total_blocks", 0) for w in live),
            num_free_blocks=sum(w["stats"].get("num_free_blocks", 0) for w in live),
            prefix_cache_queries=sum(r.get("prefix_cache_queries", 0) for r in recents),
            prefix_cache_hits=sum(r.get("prefix_cache_hits", 0) for r in recents),
            num_preemptions_total=sample.totals.get(name, {}).get("num_preemptions_total", 0.0),
            ttft_counts=ttft, tpot_counts=tpot, num_queued=sample.queued.get(name, 0)))
    return models


def summarize(models: list[ModelStats]) -> dict[str, Any]:
    """The headline numbers over ``models``: requests running and waiting, output tokens/s,
    KV-cache usage (0..1), prefix-cache hit rate (0..1 or None), TTFT/TPOT p50/p99 (seconds or
    None), preemptions (cumulative) and the number of live workers."""
    workers = [w for m in models for w in m.workers]
    rates = [w.output_tokens_per_s for w in workers if w.output_tokens_per_s is not None]
    total = sum(m.num_total_blocks for m in models)
    queries = sum(m.prefix_cache_queries for m in models)
    summary = {
        "num_workers": len(workers),
        "num_requests_running": sum(w.num_running for w in workers),
        "num_requests_waiting": sum(w.num_waiting for w in workers) + sum(m.num_queued for m in models),
        "output_tokens_per_s": sum(rates) if rates else None,
        "kv_cache_usage": (total - sum(m.num_free_blocks for m in models)) / total if total else 0.0,
        "prefix_cache_hit_rate": sum(m.prefix_cache_hits for m in models) / queries if queries else None,
        "num_preemptions_total": sum(m.num_preemptions_total for m in models),
    }
    for short, name, field in (("ttft", TTFT, "ttft_counts"), ("tpot", TPOT, "tpot_counts")):
        counts = _zeros(name)
        for model in models:
            counts = _add(counts, getattr(model, field))
        for q in (50, 99):
            summary[f"{short}_p{q}_s"] = histogram_quantile(q / 100, HISTOGRAM_BOUNDS[name], counts)
    return summary
