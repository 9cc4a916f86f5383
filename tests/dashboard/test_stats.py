"""The dashboard's arithmetic without a stack: a worker's recent figures (what its heartbeat
publishes) and percentiles from histogram counts, as Prometheus computes them."""
from __future__ import annotations

import os

import pytest

from webapp.serving.recent_stats import RecentStats
from webapp.serving.worker_metrics import TTFT_BUCKETS, RequestMetrics


def test_histogram_quantile_interpolates_inside_the_bucket_like_prometheus():
    from dashboard.stats import histogram_quantile

    bounds = (1.0, 2.0, 4.0)
    assert histogram_quantile(0.5, bounds, (0, 4, 0, 0)) == pytest.approx(1.5)  # half-way through (1, 2]
    assert histogram_quantile(0.99, bounds, (0, 4, 0, 0)) == pytest.approx(1.99)
    assert histogram_quantile(0.5, bounds, (2, 0, 2, 0)) == pytest.approx(1.0)  # rank 2 ends the first bucket
    assert histogram_quantile(0.99, bounds, (1, 0, 0, 3)) == 4.0  # in +Inf: the highest finite bound
    assert histogram_quantile(0.5, bounds, (0, 0, 0, 0)) is None
    with pytest.raises(ValueError, match="q must be within"):
        histogram_quantile(1.5, bounds, (0, 1, 0, 0))
    with pytest.raises(ValueError, match="counts must have"):
        histogram_quantile(0.5, bounds, (0, 1))


def test_recent_stats_rates_and_windows():
    metrics = RequestMetrics()
    recent = RecentStats(metrics, window=60.0, rate_window=5.0)
    stats = {"generation_tokens_total": 0, "prefix_cache_queries_total": 0, "prefix_cache_hits_total": 0}
    first = recent.sample(stats, now=100.0)
    assert first["output_tokens_per_s"] is None and sum(first["ttft_bucket_counts"]) == 0

    metrics.on_delta("a", 1, step_time=101.0, metrics={"arrival": 100.0, "first_token": 100.3}, finished=False,
                     finish_reasons=[None])
    for t in range(1, 11):  # 20 tokens a second for 10 s, a prefix-cache hit of 16 of 64 tokens at t=1
        stats = {"generation_tokens_total": 20 * t, "prefix_cache_queries_total": 64, "prefix_cache_hits_total": 16}
        out = recent.sample(stats, now=100.0 + t)
    assert out["output_tokens_per_s"] == pytest.approx(20.0) and out["rate_window_s"] == pytest.approx(5.0)
    assert (out["prefix_cache_queries"], out["prefix_cache_hits"]) == (64, 16)
    assert out["ttft_bucket_counts"][TTFT_BUCKETS.index(0.5)] == 1  # 0.3 s falls in (0.25, 0.5]

    out = recent.sample(stats, now=165.0)  # a minute later, nothing new: the window forgot it all
    assert out["output_tokens_per_s"] == 0.0 and sum(out["ttft_bucket_counts"]) == 0
    assert out["prefix_cache_queries"] == 0 and out["window_s"] <= 60.0


@pytest.fixture
def django_apps():
    """Django's apps loaded (the dashboard's state refers to the tenants' models); no database."""
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "webapp.settings")
    import django

    django.setup()


def test_workers_without_a_model_are_listed_apart_and_rows_are_cut_per_viewer(django_apps):
    from dashboard.access import Viewer, visible_snapshot
    from dashboard.stats_poller import State
    from dashboard.stats import Sample, idle_workers, model_stats

    serving = {"id": "w1", "model": "m", "host": "gpu1", "device": "cuda:0", "state": "ready", "started": 40.0,
               "stats": {"num_running": 3, "num_waiting": 12, "num_total_blocks": 100, "num_free_blocks": 25},
               "recent": {"output_tokens_per_s": 42.0}}
    loading = {"id": "w2", "model": None, "host": "gpu2", "state": "loading", "started": 90.0, "stats": {}}
    sample = Sample(100.0, (serving, loading), {"m": {"num_preemptions_total": 7.0}}, {"m": 5})
    state = State(100.0, model_stats(sample), idle_workers(sample), [])
    staff = visible_snapshot(state, Viewer("ops", True, frozenset(), None))
    (model,) = staff["models"]
    # waiting: the worker's backlog and the requests still queued in Redis
    assert (model["name"], model["num_requests_waiting"], model["kv_cache_usage"]) == ("m", 17, 0.75)
    assert model["output_tokens_per_s"] == 42.0 and model["num_preemptions_total"] == 7.0
    assert model["workers"][0]["uptime_s"] == 60.0 and model["workers"][0]["device"] == "cuda:0"
    assert [(w["id"], w["state"], w["model"]) for w in staff["idle_workers"]] == [("w2", "loading", "")]

    member = visible_snapshot(state, Viewer("alice", False, frozenset({"red"}), frozenset({"m"})))
    assert "workers" not in member["models"][0] and member["idle_workers"] == []
    other = visible_snapshot(state, Viewer("bob", False, frozenset({"blue"}), frozenset({"x"})))
    assert other["models"] == [] and other["totals"]["num_workers"] == 0


def test_recent_stats_never_count_backwards_when_the_engine_is_replaced():
    recent = RecentStats(RequestMetrics())
    recent.sample({"generation_tokens_total": 500, "prefix_cache_queries_total": 64}, now=0.0)
    out = recent.sample({"generation_tokens_total": 10, "prefix_cache_queries_total": 0}, now=1.0)  # a new engine
    assert out["output_tokens_per_s"] == 0.0 and out["prefix_cache_queries"] == 0
