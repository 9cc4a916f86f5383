"""The Prometheus text of heartbeats this machine cannot produce (GPU workers), and the
worker's stats log line, checked on the real renderer and logger (no stack needed)."""
from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from webapp.serving.stat_logger import StatLogger


def test_gpu_gauges_and_tenant_counters_parse_with_their_labels():
    from webapp import metrics

    gpu_worker = {"id": "gpu-host-1-ab12", "model": "m", "stats": {"num_running": 2, "num_total_blocks": 10,
                                                                   "num_free_blocks": 4},
                  "gpus": [{"device": "0", "utilization": 0.75, "memory_used_bytes": 80 * 2**30},
                           {"device": "1", "utilization": 0.0, "memory_used_bytes": 2**20}]}
    idle_worker = {"id": "gpu-host-2-cd34", "model": None, "stats": {},
                   "gpus": [{"device": "0", "utilization": 0.1, "memory_used_bytes": 5}]}
    tenants = [("requests", "team1", "m", "length", 3.0), ("prompt_tokens", "team1", "m", "", 40.0),
               ("generation_tokens", "team1", "m", "", 12.0), ("requests", "team2", "m", "abort", 1.0)]
    text = metrics.render([gpu_worker, idle_worker], {"m": {"prompt_tokens_total": 40.0}}, tenants).decode()
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in text_string_to_metric_families(text) for s in family.samples}
    assert samples[("tessera:gpu_utilization_perc", (("device", "0"), ("worker", "gpu-host-1-ab12")))] == 0.75
    assert samples[("tessera:gpu_memory_used_bytes", (("device", "0"), ("worker", "gpu-host-1-ab12")))] == 80 * 2**30
    assert samples[("tessera:gpu_utilization_perc", (("device", "0"), ("worker", "gpu-host-2-cd34")))] == 0.1
    assert samples[("tessera:tenant_requests_total",
                    (("finished_reason", "length"), ("model_name", "m"), ("tenant", "team1")))] == 3
    assert samples[("tessera:tenant_generation_tokens_total", (("model_name", "m"), ("tenant", "team1")))] == 12
    assert samples[("vllm:kv_cache_usage_perc", (("model_name", "m"),))] == 0.6
    assert samples[("tessera:num_workers", (("model_name", "m"),))] == 1  # the idle worker serves nothing


def test_stats_line_averages_over_the_interval():
    logger = StatLogger()
    start = {"prompt_tokens_total": 100, "generation_tokens_total": 50, "prefix_cache_queries_total": 64,
             "prefix_cache_hits_total": 16, "num_running": 1, "num_waiting": 0, "kv_cache_usage": 0.1}
    assert logger.line(start, 10.0) is None  # nothing to average over yet
    later = dict(start, prompt_tokens_total=600, generation_tokens_total=250, prefix_cache_queries_total=164,
                 prefix_cache_hits_total=91, num_running=12, num_waiting=3, kv_cache_usage=0.412)
    assert logger.line(later, 15.0) == (
        "Avg prompt throughput: 100.0 tokens/s, Avg generation throughput: 40.0 tokens/s, Running: 12 reqs, "
        "Waiting: 3 reqs, GPU KV cache usage: 41.2%, Prefix cache hit rate: 75.0%")
    assert not logger.quiet
    idle = dict(later, num_running=0, num_waiting=0)
    for now, quiet in ((20.0, False), (25.0, True), (30.0, True)):  # one idle line at INFO, then DEBUG
        assert logger.line(idle, now).startswith("Avg prompt throughput: 0.0 tokens/s") and logger.quiet == quiet
    assert logger.line(dict(idle, generation_tokens_total=260), 35.0) and not logger.quiet
    logger.reset()  # a new engine: its counters start from 0 again, never a negative rate
    assert logger.line({"prompt_tokens_total": 5}, 16.0) is None


def test_engine_step_histogram_and_cache_config_from_a_heartbeat():
    from webapp import metrics
    from webapp.serving.worker_metrics import RequestMetrics, flat_totals

    stats = {"iteration_tokens_counts": [0, 2, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1], "iteration_tokens_sum": 20000}
    worker = {"id": "w1", "model": "m", "stats": {}, "cache_config": {
        "block_size": 16, "cache_dtype": "auto", "enable_prefix_caching": True, "gpu_memory_utilization": 0.9,
        "num_gpu_blocks": 4096, "num_cpu_blocks": 0, "swap_space": 0.0}}
    text = metrics.render([worker], {"m": flat_totals(stats, RequestMetrics())}).decode()
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in text_string_to_metric_families(text) for s in family.samples}
    assert samples[("vllm:iteration_tokens_total_bucket", (("le", "8.0"), ("model_name", "m")))] == 2
    assert samples[("vllm:iteration_tokens_total_bucket", (("le", "16384.0"), ("model_name", "m")))] == 2
    assert samples[("vllm:iteration_tokens_total_bucket", (("le", "+Inf"), ("model_name", "m")))] == 3
    assert samples[("vllm:iteration_tokens_total_count", (("model_name", "m"),))] == 3
    assert samples[("vllm:iteration_tokens_total_sum", (("model_name", "m"),))] == 20000
    info = [labels for (name, labels), value in samples.items() if name == "vllm:cache_config_info" and value == 1]
    assert info and dict(info[0])["num_gpu_blocks"] == "4096" and dict(info[0])["enable_prefix_caching"] == "True"
