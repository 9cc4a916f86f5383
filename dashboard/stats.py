"""The dashboard's numbers, computed from what the workers publish to Redis.

A :class:`Sample` is one read of Redis: the live workers' heartbeats (engine stats) and the
models' cumulative totals (:mod:`webapp.serving.worker_metrics`). From the samples of the
last seconds, :func:`model_stats` derives

* output tokens/s of each worker: how much ``generation_tokens_total`` of its heartbeat grew
  over the last ``RATE_WINDOW`` seconds (a restarted worker has a new id, so it never counts
  backwards);
* the prefix-cache hit rate: hits over queries (tokens) of the heartbeats over ``WINDOW``;
* TTFT and TPOT p50/p99: of the histogram observations the model's totals gained over
  ``WINDOW``, interpolated inside a bucket as Prometheus' ``histogram_quantile`` does, so the
  page and a Grafana panel of ``histogram_quantile(0.99, rate(..._bucket[1m]))`` agree.

Everything here is plain data; :mod:`.sampler` reads Redis, :mod:`.access` filters per viewer.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from webapp.serving.worker_metrics import HISTOGRAM_BOUNDS

WINDOW = 60.0  # seconds of history behind the latency percentiles and the hit rate
RATE_WINDOW = 5.0  # seconds behind the tokens/s figures
TTFT = "time_to_first_token_seconds"
TPOT = "request_time_per_output_token_seconds"


@dataclass(frozen=True)
class Sample:
    """One read of Redis at ``time`` (Unix seconds): ``workers`` are the live heartbeat dicts
    (:func:`webapp.serving.registry.live_workers`), ``totals`` maps model -> totals field -> value."""

    time: float
    workers: tuple[dict[str, Any], ...]
    totals: dict[str, dict[str, float]]


@dataclass(frozen=True)
class WorkerStats:
    """One live worker as the overview lists it; ``output_tokens_per_s`` is None until two
    samples are ``RATE_WINDOW`` apart or less."""

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

    ``ttft_counts`` / ``tpot_counts`` are the (non-cumulative) histogram bucket counts gained
    over the window, per bucket of ``HISTOGRAM_BOUNDS``; the ``prefix_cache_*`` figures are
    tokens over the window.
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


def _bucket_counts(totals: dict[str, float], name: str) -> list[float]:
    return [totals.get(f"{name}:bucket:{i}", 0.0) for i in range(len(HISTOGRAM_BOUNDS[name]) + 1)]


def _window_counts(old: dict[str, float], new: dict[str, float], name: str) -> tuple[float, ...]:
    """Bucket counts gained from ``old`` to ``new``; all of ``new`` when the totals restarted
    (a new Redis) in between."""
    before, after = _bucket_counts(old, name), _bucket_counts(new, name)
    if any(a < b for a, b in zip(after, before)):
        return tuple(after)
    return tuple(a - b for a, b in zip(after, before))


def _oldest_within(samples: list[Sample], seconds: float) -> Sample:
    newest = samples[-1]
    for sample in samples:
        if newest.time - sample.time <= seconds:
            return sample
    return newest


def _worker_stat(sample: Sample, worker_id: str) -> dict[str, Any] | None:
    for worker in sample.workers:
        if worker.get("id") == worker_id:
            return worker.get("stats", {})
    return None


def _growth(samples: list[Sample], worker_id: str, field: str, seconds: float) -> tuple[float, float] | None:
    """(increase of the worker's stats ``field``, seconds) over the last ``seconds``; None
    when no older sample has the worker."""
    newest = samples[-1]
    now = _worker_stat(newest, worker_id)
    for sample in samples:
        if sample is newest or newest.time - sample.time > seconds:
            continue
        then = _worker_stat(sample, worker_id)
        if then is not None:
            return max(0.0, now.get(field, 0) - then.get(field, 0)), newest.time - sample.time
    return None


def worker_stats(samples: list[Sample], worker: dict[str, Any]) -> WorkerStats:
    """The overview row of ``worker`` (a heartbeat dict of the newest sample)."""
    stats = worker.get("stats", {})
    growth = _growth(samples, worker["id"], "generation_tokens_total", RATE_WINDOW)
    total = stats.get("num_total_blocks", 0)
    state = worker.get("state") or ("serving" if worker.get("live", True) else "stopping")
    return WorkerStats(
        id=worker["id"], model=worker["model"], host=worker.get("host", ""), pid=worker.get("pid"),
        device=str(worker.get("device") or ""), state=state,
        uptime_s=max(0.0, samples[-1].time - worker.get("started", samples[-1].time)),
        num_running=int(stats.get("num_running", 0)), num_waiting=int(stats.get("num_waiting", 0)),
        kv_cache_usage=(total - stats.get("num_free_blocks", 0)) / total if total else 0.0,
        output_tokens_per_s=growth[0] / growth[1] if growth and growth[1] > 0 else None,
        num_preemptions_total=int(stats.get("num_preemptions_total", 0)))


def model_stats(samples: list[Sample]) -> list[ModelStats]:
    """Every model with a live worker or totals in the newest of ``samples`` (oldest first;
    at least one), by name."""
    newest, oldest = samples[-1], _oldest_within(samples, WINDOW)
    names = sorted({w["model"] for w in newest.workers} | set(newest.totals))
    models = []
    for name in names:
        live = [w for w in newest.workers if w["model"] == name]
        queries = hits = 0.0
        for worker in live:
            queries += (_growth(samples, worker["id"], "prefix_cache_queries_total", WINDOW) or (0.0, 0.0))[0]
            hits += (_growth(samples, worker["id"], "prefix_cache_hits_total", WINDOW) or (0.0, 0.0))[0]
        new_totals, old_totals = newest.totals.get(name, {}), oldest.totals.get(name, {})
        models.append(ModelStats(
            name=name, workers=tuple(worker_stats(samples, w) for w in live),
            num_total_blocks=sum(w["stats"].get("num_total_blocks", 0) for w in live),
            num_free_blocks=sum(w["stats"].get("num_free_blocks", 0) for w in live),
            prefix_cache_queries=queries, prefix_cache_hits=hits,
            num_preemptions_total=new_totals.get("num_preemptions_total", 0.0),
            ttft_counts=_window_counts(old_totals, new_totals, TTFT),
            tpot_counts=_window_counts(old_totals, new_totals, TPOT)))
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
        "num_requests_waiting": sum(w.num_waiting for w in workers),
        "output_tokens_per_s": sum(rates) if rates else None,
        "kv_cache_usage": (total - sum(m.num_free_blocks for m in models)) / total if total else 0.0,
        "prefix_cache_hit_rate": sum(m.prefix_cache_hits for m in models) / queries if queries else None,
        "num_preemptions_total": sum(m.num_preemptions_total for m in models),
    }
    for short, name, field in (("ttft", TTFT, "ttft_counts"), ("tpot", TPOT, "tpot_counts")):
        counts = tuple(map(sum, zip(*(getattr(m, field) for m in models)))) or (0.0,) * (len(HISTOGRAM_BOUNDS[name]) + 1)
        for q in (50, 99):
            summary[f"{short}_p{q}_s"] = histogram_quantile(q / 100, HISTOGRAM_BOUNDS[name], counts)
    return summary
