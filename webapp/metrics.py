"""``GET /metrics``: vLLM's metric names, per model.

Gauges (running and waiting requests, KV-cache usage) are summed over the live workers'
heartbeats; ``vllm:num_requests_waiting`` adds the requests still queued in Redis for the model
(every accepted request not yet running waits, in an engine's backlog or in the model's queue).
Counters and histograms come from the model's totals in Redis, to which every worker adds its
increments (:mod:`webapp.serving.worker_metrics`): they cover all workers past and present, so a
worker that stops or restarts never makes them go backwards. Each carries ``_created``, the time
the totals started (a new Redis starts them afresh, which Prometheus reads as a counter reset).
Rendered with ``prometheus_client``.

``vllm:cache_config_info`` (value 1) carries each live worker's KV-cache settings as labels;
``vllm:lora_requests_info`` (value: the time of the last heartbeat) the LoRA adapters of each model's
running and waiting requests over its workers, comma-separated, and ``max_lora``, as vLLM's.
Tessera's own series: ``tessera:num_workers``, GPU utilization and memory per device and
worker (``tessera:gpu_utilization_perc`` 0-1, ``tessera:gpu_memory_used_bytes``; NVML,
only where workers have GPUs, see :mod:`webapp.serving.devices`), and per-tenant counters
(``tessera:tenant_*_total``, see :mod:`tenants.counters`).
"""
from __future__ import annotations

from collections import defaultdict
from typing import Any, Iterable

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from tenants.counters import GENERATION, PROMPT, REQUESTS
from webapp.serving.worker_metrics import ENGINE_HISTOGRAM_BOUNDS, HISTOGRAM_BOUNDS, SUCCESS_PREFIX

HISTOGRAMS = {
    "time_to_first_token_seconds": "Histogram of time to first token in seconds.",
    "inter_token_latency_seconds": "Histogram of inter-token latency in seconds.",
    "request_time_per_output_token_seconds": "Histogram of time per output token in seconds (per request).",
    "e2e_request_latency_seconds": "Histogram of end to end request latency in seconds.",
    "request_queue_time_seconds": "Histogram of time spent in WAITING phase for request.",
    "request_prefill_time_seconds": "Histogram of time spent in PREFILL phase for request.",
    "request_decode_time_seconds": "Histogram of time spent in DECODE phase for request.",
    "request_inference_time_seconds": "Histogram of time spent in RUNNING phase for request.",
    "request_generation_tokens": "Number of generation tokens processed.",
    "request_prompt_tokens": "Number of prefill tokens processed.",
    "iteration_tokens_total": "Histogram of number of tokens per engine_step.",
}
BOUNDS = {**HISTOGRAM_BOUNDS, **ENGINE_HISTOGRAM_BOUNDS}
CACHE_CONFIG_LABELS = ("block_size", "cache_dtype", "enable_prefix_caching", "gpu_memory_utilization",
                       "num_gpu_blocks", "num_cpu_blocks", "swap_space")
GAUGES = {  # metric -> (stats field, help)
    "vllm:num_requests_running": ("num_running", "Number of requests in model execution batches."),
    "vllm:num_requests_waiting": ("num_waiting", "Number of requests waiting to be processed."),
    "vllm:num_requests_swapped": ("num_swapped", "Number of requests swapped to CPU."),
}
COUNTERS = {  # metric -> (totals field, help)
    "vllm:prompt_tokens": ("prompt_tokens_total", "Number of prefill tokens processed."),
    "vllm:generation_tokens": ("generation_tokens_total", "Number of generation tokens processed."),
    "vllm:num_preemptions": ("num_preemptions_total", "Cumulative number of preemptions from the engine."),
    "tessera:num_swapped_out": ("num_swapped_out_total", "Preemptions that swapped the request's KV to CPU."),
    "vllm:prefix_cache_queries": ("prefix_cache_queries_total",
                                  "Prefix cache queries, in terms of number of queried tokens."),
    "vllm:prefix_cache_hits": ("prefix_cache_hits_total", "Prefix cache hits, in terms of number of cached tokens."),
}


TENANT_COUNTERS = {  # tenants.counters name -> (metric, help)
    PROMPT: ("tessera:tenant_prompt_tokens", "Prompt tokens of a tenant's finished requests."),
    GENERATION: ("tessera:tenant_generation_tokens", "Generated tokens of a tenant's finished requests."),
}


class WorkersCollector:
    """A one-shot prometheus_client collector over worker heartbeats (gauges) and the models'
    totals (counters, histograms), and the tenants' counters."""

    def __init__(self, workers: list[dict[str, Any]], totals: dict[str, dict[str, float]],
                 tenant_counters: list[tuple[str, str, str, str, float]] = (),
                 queued: dict[str, int] | None = None) -> None:
        self.by_model: dict[str, list[dict[str, Any]]] = defaultdict(list)
        self.queued = queued or {}
        self.totals = {model: dict(values) for model, values in totals.items()}
        self.workers = workers
        self.tenant_counters = tenant_counters
        for model in totals:
            self.by_model[model]
        for worker in workers:
            if worker.get("model"):
                self.by_model[worker["model"]].append(worker)
                self.totals.setdefault(worker["model"], {})

    def collect(self):
        yield from self._model_metrics()
        yield from self._gpu_metrics()
        yield from self._tenant_metrics()

    def _gpu_metrics(self):
        utilization = GaugeMetricFamily("tessera:gpu_utilization_perc",
                                        "GPU utilization (fraction of the last sample period a kernel ran), "
                                        "1 means 100 percent.", labels=["device", "worker"])
        memory = GaugeMetricFamily("tessera:gpu_memory_used_bytes", "GPU memory in use (the whole device).",
                                   labels=["device", "worker"])
        for worker in self.workers:
            for gpu in worker.get("gpus") or ():
                utilization.add_metric([gpu["device"], worker["id"]], gpu["utilization"])
                memory.add_metric([gpu["device"], worker["id"]], gpu["memory_used_bytes"])
        yield utilization
        yield memory

    def _tenant_metrics(self):
        families = {name: CounterMetricFamily(metric, doc, labels=["tenant", "model_name"])
                    for name, (metric, doc) in TENANT_COUNTERS.items()}
        requests = CounterMetricFamily("tessera:tenant_requests", "A tenant's finished requests, by how they ended.",
                                       labels=["tenant", "model_name", "finished_reason"])
        for counter, tenant, model, reason, value in sorted(self.tenant_counters):
            if counter == REQUESTS:
                requests.add_metric([tenant, model, reason], value)
            elif counter in families:
                families[counter].add_metric([tenant, model], value)
        yield from families.values()
        yield requests

    def _model_metrics(self):
        live = GaugeMetricFamily("tessera:num_workers", "Number of live engine workers.", labels=["model_name"])
        for model, workers in self.by_model.items():
            live.add_metric([model], len(workers))
        yield live
        for name, (field, doc) in GAUGES.items():
            yield self._gauge(name, doc, lambda ws, f=field: sum(w["stats"].get(f, 0) for w in ws),
                              self.queued if name == "vllm:num_requests_waiting" else None)
        yield self._gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
                          _usage("num_total_blocks", "num_free_blocks"))
        yield self._gauge("tessera:kv_cache_free_blocks", "Free KV-cache blocks over the live workers.",
                          lambda ws: sum(w["stats"].get("num_free_blocks", 0) for w in ws))
        cache = GaugeMetricFamily("vllm:cache_config_info", "Information of the LLMEngine CacheConfig",
                                  labels=["model_name", "worker", *CACHE_CONFIG_LABELS])
        for model, workers in self.by_model.items():
            for worker in workers:
                if worker.get("cache_config"):
                    cache.add_metric([model, worker["id"], *(str(worker["cache_config"].get(k, ""))
                                                             for k in CACHE_CONFIG_LABELS)], 1.0)
        yield cache
        yield self._lora_info()
        yield self._gauge("vllm:cpu_cache_usage_perc", "CPU-cache (swap space) usage. 1 means 100 percent usage.",
                          _usage("num_cpu_blocks", "num_free_cpu_blocks"))
        for name, (field, doc) in COUNTERS.items():
            family = CounterMetricFamily(name, doc, labels=["model_name"])
            for model, values in self.totals.items():
                family.add_metric([model], values.get(field, 0.0), created=values.get("created"))
            yield family
        success = CounterMetricFamily("vllm:request_success", "Count of successfully processed requests.",
                                      labels=["model_name", "finished_reason"])
        for model, values in self.totals.items():
            reasons = {k[len(SUCCESS_PREFIX):]: v for k, v in values.items() if k.startswith(SUCCESS_PREFIX)}
            for reason in ("stop", "length", "abort", *sorted(set(reasons) - {"stop", "length", "abort"})):
                success.add_metric([model, reason], reasons.get(reason, 0.0), created=values.get("created"))
        yield success
        for short, doc in HISTOGRAMS.items():
            yield self._histogram("vllm:" + short, doc, short)

    def _lora_info(self) -> GaugeMetricFamily:
        family = GaugeMetricFamily("vllm:lora_requests_info", "Running stats on lora requests.",
                                   labels=["model_name", "max_lora", "waiting_lora_adapters", "running_lora_adapters"])
        for model, workers in self.by_model.items():
            stats = [w["stats"] for w in workers if w["stats"].get("max_lora")]
            if not stats:
                continue
            running = sorted({name for s in stats for name in s.get("lora_running_adapters", ())})
            waiting = sorted({name for s in stats for name in s.get("lora_waiting_adapters", ())})
            family.add_metric([model, str(max(s["max_lora"] for s in stats)), ",".join(waiting), ",".join(running)],
                              max(w.get("time", 0.0) for w in workers))
        return family

    def _gauge(self, name: str, doc: str, value, extra: dict[str, int] | None = None) -> GaugeMetricFamily:
        """``value(workers)`` per model, plus ``extra[model]`` where given."""
        family = GaugeMetricFamily(name, doc, labels=["model_name"])
        for model, workers in self.by_model.items():
            family.add_metric([model], value(workers) + (extra or {}).get(model, 0))
        return family

    def _histogram(self, name: str, doc: str, short: str) -> HistogramMetricFamily:
        family = HistogramMetricFamily(name, doc, labels=["model_name"])
        bounds = BOUNDS[short]
        for model, values in self.totals.items():
            cumulative, buckets = 0.0, []
            for i, bound in enumerate([*map(_le, bounds), "+Inf"]):
                cumulative += values.get(f"{short}:bucket:{i}", 0.0)
                buckets.append((bound, cumulative))
            family.add_metric([model], buckets, sum_value=values.get(f"{short}:sum", 0.0))
            if "created" in values:
                family.add_sample(name + "_created", {"model_name": model}, values["created"])
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


def render(workers: list[dict[str, Any]], totals: dict[str, dict[str, float]],
           tenant_counters: list[tuple[str, str, str, str, float]] = (), queued: dict[str, int] | None = None) -> bytes:
    """Prometheus text exposition, labelled by ``model_name``.

    Args:
        workers: the live workers' heartbeat dicts (gauges; those without a model count
            only for the GPU gauges).
        totals: ``model -> {field: value}`` from :func:`webapp.serving.worker_registry.model_totals`
            for every served model (counters and histograms).
        tenant_counters: :func:`tenants.counters.read`'s rows.
        queued: model -> requests queued in Redis (:func:`webapp.serving.request_queue.queued_counts`).
    """
    registry = CollectorRegistry(auto_describe=False)
    registry.register(WorkersCollector(workers, totals, tenant_counters, queued))
    return generate_latest(registry)
