"""GET /health, /version, /metrics, /v1/models and vLLM's /tokenize and /detokenize."""
from __future__ import annotations

import json
import time

from tests.webapp.serving_stack import MODEL, Stack, http, metric_value, metrics_text


def test_health_and_version(stack):
    status, headers, body = http("GET", stack.base_url + "/health")
    assert status == 200 and headers["Content-Type"] == "application/json"
    assert json.loads(body) == {"status": "ok", "num_workers": 1}
    status, _, body = http("GET", stack.base_url + "/version")
    assert status == 200 and json.loads(body)["version"]


def test_health_without_worker_is_503_in_the_error_envelope(tmp_path):
    web_only = Stack(tmp_path, num_workers=0)  # its own Redis: no worker anywhere
    try:
        status, headers, body = http("GET", web_only.base_url + "/health")
    finally:
        web_only.stop()
    assert status == 503 and headers["Content-Type"] == "application/json"
    error = json.loads(body)["error"]
    assert error["code"] == "service_unavailable" and "No engine worker" in error["message"]


def test_tokenize_detokenize_roundtrip(stack):
    status, _, body = http("POST", stack.base_url + "/tokenize", {"model": MODEL, "prompt": "Hello, world!"})
    result = json.loads(body)
    assert status == 200 and result["count"] == len(result["tokens"]) > 1 and result["max_model_len"] == 2048
    status, _, body = http("POST", stack.base_url + "/detokenize", {"model": MODEL, "tokens": result["tokens"]})
    assert status == 200 and json.loads(body)["prompt"] == "Hello, world!"


def test_tokenize_chat_messages_matches_usage(stack):
    messages = [{"role": "user", "content": "Name three colors."}]
    _, _, body = http("POST", stack.base_url + "/tokenize", {"model": MODEL, "messages": messages})
    count = json.loads(body)["count"]
    reply = stack.openai().chat.completions.create(model=MODEL, messages=messages, max_tokens=1)
    assert reply.usage.prompt_tokens == count


def test_detokenize_rejects_bad_ids(stack):
    status, _, body = http("POST", stack.base_url + "/detokenize", {"tokens": [10**9]})
    assert status == 400 and json.loads(body)["error"]["param"] == "tokens"


def test_metrics_use_vllm_names(stack):
    success, ttft, itl = ('vllm:request_success_total{finished_reason="length"',
                          "vllm:time_to_first_token_seconds_count", "vllm:inter_token_latency_seconds_count")
    time.sleep(1.2)  # earlier tests' requests reach the heartbeat first (published every 0.5 s)
    before = metrics_text(stack.base_url)
    stack.openai().completions.create(model=MODEL, prompt="Hello", max_tokens=3, extra_body={"ignore_eos": True})
    deadline = time.monotonic() + 3  # workers publish every heartbeat (0.5 s)
    while metric_value(text := metrics_text(stack.base_url), success) < metric_value(before, success) + 1:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    lines = text.splitlines()
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:num_preemptions_total",
                 "vllm:request_success_total", "vllm:time_to_first_token_seconds_bucket",
                 "vllm:inter_token_latency_seconds_bucket", "vllm:e2e_request_latency_seconds_bucket",
                 "vllm:request_time_per_output_token_seconds_bucket", "vllm:prefix_cache_queries_total",
                 "vllm:prefix_cache_hits_total", "vllm:num_requests_swapped", "vllm:cpu_cache_usage_perc",
                 "vllm:request_queue_time_seconds_bucket", "vllm:request_prefill_time_seconds_bucket",
                 "vllm:request_decode_time_seconds_bucket", "vllm:request_inference_time_seconds_bucket",
                 "vllm:request_generation_tokens_bucket"):
        assert any(line.startswith(name + "{") and f'model_name="{MODEL}"' in line for line in lines), name
    assert metric_value(text, ttft) == metric_value(before, ttft) + 1
    for name in ("vllm:request_queue_time_seconds_count", "vllm:request_prefill_time_seconds_count",
                 "vllm:request_decode_time_seconds_count", "vllm:request_inference_time_seconds_count",
                 "vllm:request_generation_tokens_count"):
        assert metric_value(text, name) == metric_value(before, name) + 1, name
    tokens = "vllm:request_generation_tokens_sum"
    assert metric_value(text, tokens) == metric_value(before, tokens) + 3  # max_tokens=3, ignore_eos
    assert metric_value(text, itl) == metric_value(before, itl) + 2  # 3 tokens: 2 gaps
    assert metric_value(text, "vllm:generation_tokens_total") >= metric_value(before, "vllm:generation_tokens_total") + 3


def test_index_page(stack):
    status, headers, body = http("GET", stack.base_url + "/")
    assert status == 200 and b"Tessera" in body
