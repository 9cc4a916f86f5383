"""``GET /metrics``: vLLM's metric names, aggregated per model over the live workers.

Workers publish engine stats and request histograms with every heartbeat
(:mod:`webapp.serving.worker_metrics`); this module sums them per ``model_name`` and
renders Prometheus' text format with ``prometheus_client``. Counters of a worker that
stopped leave the sums, which Prometheus treats as a counter reset.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Any, Iterable

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

HISTOGRAMS = {
    "time_to_first_token_seconds": "Histogram of time to first token in seconds.",
    "inter_token_latency_seconds": "Histogram of inter-token latency in seconds.",
    "request_time_per_output_token_seconds": "Histogram of time per output token in seconds (per request).",
    "e2e_request_latency_seconds": "Histogram of end to end request latency in seconds.",
}
GAUGES = {  # metric -> (stats field, help)
    "vllm:num_requests_running": ("num_running", "Number of requests in model execution batches."),
    "vllm:num_requests_waiting": ("num_waiting", "Number of requests waiting to be processed."),
    "vllm:num_requests_swapped": ("num_swapped", "Number of requests swapped to CPU."),
}
COUNTERS = {
    "vllm:prompt_tokens": ("prompt_tokens_total", "Number of prefill tokens processed."),
    "vllm:generation_tokens": ("generation_tokens_total", "Number of generation tokens processed."),
    "vllm:num_preemptions": ("num_preemptions_total", "Cumulative number of preemptions from the engine."),
    "tessera:num_swapped_out": ("num_swapped_out_total", "Preemptions that swapped the request's KV to CPU."),
    "vllm:prefix_cache_queries": ("prefix_cache_queries_total",
                                  "Prefix cache queries, in terms of number of queried tokens."),
    "vllm:prefix_cache_hits": ("prefix_cache_hits_total", "Prefix cache hits, in terms of number of cached tokens."),
}


class WorkersCollector:
    """A one-shot prometheus_client collector over worker heartbeat dicts."""

    def __init__(self, workers: list[dict[str, Any]], models: Iterable[str]) -> None:
        self.by_model: dict[str, list[dict[str, Any]]] = defaultdict(list)
        for model in models:
            self.by_model[model]
        for worker in workers:
            self.by_model[worker["model"]].append(worker)

    def collect(self):
        live = GaugeMetricFamily("tessera:num_workers", "Number of live engine workers.", labels=["model_name"])
        for model, workers in self.by_model.items():
            live.add_metric([model], len(workers))
        yield live
        for name, (field, doc) in GAUGES.items():
            yield self._gauge(name, doc, lambda ws, f=field: sum(w["stats"].get(f, 0) for w in ws))
        yield self._gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
                          _usage("num_total_blocks", "num_free_blocks"))
        yield self._gauge("tessera:kv_cache_free_blocks", "Free KV-cache blocks over the live workers.",
                          lambda ws: sum(w["stats"].get("num_free_blocks", 0) for w in ws))
        yield self._gauge("vllm:cpu_cache_usage_perc", "CPU-cache (swap space) usage. 1 means 100 percent usage.",
                          _usage("num_cpu_blocks", "num_free_cpu_blocks"))
        for name, (field, doc) in COUNTERS.items():
            family = CounterMetricFamily(name, doc, labels=["model_name"])
            for model, workers in self.by_model.items():
                family.add_metric([model], sum(w["stats"].get(field, 0) for w in workers))
            yield family
        success = CounterMetricFamily("vllm:request_success", "Count of successfully processed requests.",
                                      labels=["model_name", "finished_reason"])
        for model, workers in self.by_model.items():
            reasons: dict[str, int] = defaultdict(int)
            for w in workers:
                for reason, count in w.get("metrics", {}).get("request_success", {}).items():
                    reasons[reason] += count
            for reason in ("stop", "length", "abort", *sorted(set(reasons) - {"stop", "length", "abort"})):
                success.add_metric([model, reason], reasons.get(reason, 0))
        yield success
        for short, doc in HISTOGRAMS.items():
            yield self._histogram("vllm:" + short, doc, short)

    def _gauge(self, name: str, doc: str, value) -> GaugeMetricFamily:
        family = GaugeMetricFamily(name, doc, labels=["model_name"])
        for model, workers in self.by_model.items():
            family.add_metric([model], value(workers))
        return family

    def _histogram(self, name: str, doc: str, short: str) -> HistogramMetricFamily:
        family = HistogramMetricFamily(name, doc, labels=["model_name"])
        for model, workers in self.by_model.items():
            snapshots = [w.get("metrics", {}).get("histograms", {}).get(short) for w in workers]
            snapshots = [s for s in snapshots if s]
            if not snapshots:
                continue
            bounds = snapshots[0]["bounds"]
            counts = [sum(s["counts"][i] for s in snapshots) for i in range(len(bounds) + 1)]
            cumulative, buckets = 0, []
            for bound, count in zip([*map(_le, bounds), "+Inf"], counts):
                cumulative += count
                buckets.append((bound, cumulative))
            family.add_metric([model], buckets, sum_value=sum(s["sum"] for s in snapshots))
        return family


def _le(bound: float) -> str:
    return repr(float(bound))


def _usage(total_field: str, free_field: str):
    """Used fraction of a block pool summed over workers, from two stats fields."""
    def usage(workers: list[dict[str, Any]]) -> float:
        total = sum(w["stats"].get(total_field, 0) for w in workers)
        free = sum(w["stats"].get(free_field, 0) for w in workers)
        return (total - free) / total if total else 0.0
    return usage


def render(workers: list[dict[str, Any]], models: Iterable[str]) -> bytes:
    """Prometheus text exposition of the workers' metrics, labelled by ``model_name``."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(WorkersCollector(workers, models))
    return generate_latest(registry)
