"""GET /health, /version, /metrics, /v1/models and vLLM's /tokenize and /detokenize."""
from __future__ import annotations

import json
import time

import pytest

from tests.webapp.serving_stack import MODEL, Stack, http, metric_value, metrics_text, sse_events


def test_health_and_version(stack):
    status, headers, body = http("GET", stack.base_url + "/health")
    assert status == 200 and headers["Content-Type"] == "application/json"
    assert json.loads(body) == {"status": "ok", "num_workers": 1}
    status, _, body = http("GET", stack.base_url + "/version")
    assert status == 200 and json.loads(body)["version"]
    status, headers, body = http("HEAD", stack.base_url + "/health")  # load balancers' probes
    assert status == 200 and body == b"" and headers["Content-Type"] == "application/json"
    status, headers, body = http("POST", stack.base_url + "/health")  # GET only, as vLLM's
    assert status == 405 and json.loads(body)["error"]["code"] == "method_not_allowed"
    assert headers["Allow"] == "GET, HEAD"
    for method in ("GET", "POST"):  # vLLM's /ping
        status, _, body = http(method, stack.base_url + "/ping")
        assert status == 200 and json.loads(body)["status"] == "ok"
    for path in ("/metrics", "/version", "/v1/models"):  # every GET answers HEAD: scrapers and monitors probe
        got, head = http("GET", stack.base_url + path), http("HEAD", stack.base_url + path)
        assert head[0] == 200 and head[2] == b"", path
        assert head[1]["Content-Type"] == got[1]["Content-Type"], path


def test_health_without_worker_is_503_in_the_error_envelope(tmp_path):
    web_only = Stack(tmp_path, num_workers=0)  # its own Redis: no worker anywhere
    try:
        status, headers, body = http("GET", web_only.base_url + "/health")
        assert http("HEAD", web_only.base_url + "/health")[0] == 503
        # /tokenize answers max_model_len, a worker's setting: without a worker it is the generation endpoints'
        # 503, not a null
        tokenized = http("POST", web_only.base_url + "/tokenize", {"prompt": "Hi"})
        icon = http("GET", web_only.base_url + "/favicon.ico")  # browsers ask for it on the admin's pages
    finally:
        web_only.stop()
    assert status == 503 and headers["Content-Type"] == "application/json"
    error = json.loads(body)["error"]
    assert error["code"] == "service_unavailable" and "No engine worker" in error["message"]
    assert tokenized[0] == 503 and "No worker is serving model" in json.loads(tokenized[2])["error"]["message"]
    assert icon[0] == 200 and icon[1]["Content-Type"].startswith("image/svg+xml")  # redirected to the static icon


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


@pytest.mark.parametrize("extra, field", [
    ({"continue_final_message": True}, "continue_final_message"),  # with add_generation_prompt's default, true
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tool_choice"),  # "auto" needs the server flags
])
def test_tokenize_refuses_chat_options_as_the_chat_endpoint_does(stack, extra, field):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], **extra}
    for path in ("/tokenize", "/v1/chat/completions"):
        status, _, raw = http("POST", stack.base_url + path, body)
        assert status == 400 and json.loads(raw)["error"]["param"] == field, (path, raw)
    good = {**body, "add_generation_prompt": False} if "continue_final_message" in extra else {**body, "tool_choice": "none"}
    assert http("POST", stack.base_url + "/tokenize", good)[0] == 200


def test_detokenize_rejects_bad_ids(stack):
    status, _, body = http("POST", stack.base_url + "/detokenize", {"tokens": [10**9]})
    assert status == 400 and json.loads(body)["error"]["param"] == "tokens"


def test_metrics_use_vllm_names(stack):
    success, ttft, itl = ('vllm:request_success_total{finished_reason="length"',
                          "vllm:time_to_first_token_seconds_count", "vllm:inter_token_latency_seconds_count")
    time.sleep(1.2)  # earlier tests' requests reach the heartbeat first (published every 0.5 s)
    before = metrics_text(stack.base_url)
    completion = stack.openai().completions.create(model=MODEL, prompt="Hello", max_tokens=3,
                                                   extra_body={"ignore_eos": True})
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
                 "vllm:request_generation_tokens_bucket", "vllm:request_prompt_tokens_bucket",
                 "vllm:iteration_tokens_total_bucket", "vllm:cache_config_info"):
        assert any(line.startswith(name + "{") and f'model_name="{MODEL}"' in line for line in lines), name
    assert any(line.startswith("vllm:cache_config_info{") and 'block_size="16"' in line for line in lines)
    # tokens per engine step (vLLM v1's count): the prefill step (the prompt + its first token), then one
    # token in each of the 2 decode steps; the sum grows as prompt_tokens_total + generation_tokens_total
    steps, step_tokens = "vllm:iteration_tokens_total_count", "vllm:iteration_tokens_total_sum"
    while metric_value(text, steps) < metric_value(before, steps) + 3:
        assert time.monotonic() < deadline
        time.sleep(0.1)
        text = metrics_text(stack.base_url)
    assert metric_value(text, steps) == metric_value(before, steps) + 3
    assert metric_value(text, step_tokens) == metric_value(before, step_tokens) + completion.usage.prompt_tokens + 3
    totals = ("vllm:prompt_tokens_total", "vllm:generation_tokens_total")
    assert (metric_value(text, step_tokens) - metric_value(before, step_tokens)
            == sum(metric_value(text, name) - metric_value(before, name) for name in totals))
    assert metric_value(text, ttft) == metric_value(before, ttft) + 1
    for name in ("vllm:request_queue_time_seconds_count", "vllm:request_prefill_time_seconds_count",
                 "vllm:request_decode_time_seconds_count", "vllm:request_inference_time_seconds_count",
                 "vllm:request_generation_tokens_count", "vllm:request_prompt_tokens_count"):
        assert metric_value(text, name) == metric_value(before, name) + 1, name
    prompt_tokens = "vllm:request_prompt_tokens_sum"
    assert metric_value(text, prompt_tokens) == metric_value(before, prompt_tokens) + completion.usage.prompt_tokens
    tokens = "vllm:request_generation_tokens_sum"
    assert metric_value(text, tokens) == metric_value(before, tokens) + 3  # max_tokens=3, ignore_eos
    assert metric_value(text, itl) == metric_value(before, itl) + 2  # 3 tokens: 2 gaps
    assert metric_value(text, "vllm:generation_tokens_total") >= metric_value(before, "vllm:generation_tokens_total") + 3


def test_a_request_with_several_choices_counts_once_in_every_request_metric(stack):
    success, e2e = ('vllm:request_success_total{finished_reason="length"', "vllm:e2e_request_latency_seconds_count")
    time.sleep(1.2)  # earlier tests' requests reach the heartbeat first
    before = metrics_text(stack.base_url)
    stack.openai().completions.create(model=MODEL, prompt="Hello", max_tokens=2, n=3, extra_body={"ignore_eos": True})
    deadline = time.monotonic() + 3
    while metric_value(text := metrics_text(stack.base_url), e2e) < metric_value(before, e2e) + 1:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    time.sleep(0.6)  # one more heartbeat: a per-choice count would show by now
    text = metrics_text(stack.base_url)
    assert metric_value(text, e2e) == metric_value(before, e2e) + 1
    assert metric_value(text, success) == metric_value(before, success) + 1


def test_index_page(stack):
    status, headers, body = http("GET", stack.base_url + "/")
    assert status == 200 and b"Tessera" in body


def test_echo_with_logprobs_and_prompt_logprobs(stack):
    """lm-eval-harness style scoring: ``echo`` + ``logprobs`` puts the prompt's tokens first; vLLM's
    ``prompt_logprobs`` gives each prompt position's logprob (the first has none)."""
    prompt = "The capital of France is Paris"
    status, _, body = http("POST", stack.base_url + "/tokenize", {"model": MODEL, "prompt": prompt})
    prompt_ids = json.loads(body)["tokens"]
    status, _, body = http("POST", stack.base_url + "/v1/completions",
                           {"model": MODEL, "prompt": prompt, "max_tokens": 2, "echo": True, "logprobs": 1,
                            "temperature": 0, "ignore_eos": True})
    assert status == 200, body
    choice = json.loads(body)["choices"][0]
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(prompt_ids) + 2 and "".join(lp["tokens"]) == choice["text"]
    assert choice["text"].startswith(prompt)
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert all(v <= 0 for v in lp["token_logprobs"][1:])
    assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:i]) for i in range(len(lp["tokens"]))]
    status, _, body = http("POST", stack.base_url + "/v1/completions",
                           {"model": MODEL, "prompt": prompt, "max_tokens": 1, "prompt_logprobs": 2,
                            "temperature": 0})
    assert status == 200, body
    positions = json.loads(body)["choices"][0]["prompt_logprobs"]
    assert len(positions) == len(prompt_ids) and positions[0] is None
    for token_id, position, echoed in zip(prompt_ids[1:], positions[1:], lp["token_logprobs"][1:]):
        assert str(token_id) in position and len(position) <= 3  # the prompt's token and the top 2
        assert abs(position[str(token_id)]["logprob"] - echoed) < 1e-4  # the same numbers both ways
    status, _, body = http("POST", stack.base_url + "/v1/completions",
                           {"model": MODEL, "prompt": prompt, "echo": True, "logprobs": 1, "stream": True})
    assert status == 400 and json.loads(body)["error"]["param"] == "echo"


def test_echo_with_max_tokens_0_returns_the_prompt_alone(stack):
    """vLLM's scoring mode: ``echo`` and ``max_tokens: 0`` give the prompt (and its logprobs) with no
    generated token; asking for ``min_tokens`` then is a 400."""
    prompt = "The capital of France is Paris"
    _, _, body = http("POST", stack.base_url + "/tokenize", {"model": MODEL, "prompt": prompt})
    prompt_ids = json.loads(body)["tokens"]
    base = {"model": MODEL, "prompt": prompt, "max_tokens": 0, "echo": True}
    status, _, body = http("POST", stack.base_url + "/v1/completions", {**base, "logprobs": 1})
    assert status == 200, body
    reply = json.loads(body)
    choice = reply["choices"][0]
    assert choice["text"] == prompt and choice["finish_reason"] == "length"
    assert reply["usage"]["completion_tokens"] == 0 and reply["usage"]["prompt_tokens"] == len(prompt_ids)
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(prompt_ids) and "".join(lp["tokens"]) == prompt
    assert lp["token_logprobs"][0] is None and all(v <= 0 for v in lp["token_logprobs"][1:])
    status, _, raw = http("POST", stack.base_url + "/v1/completions", {**base, "stream": True})
    assert status == 200, raw
    chunks = [json.loads(e) for e in sse_events(raw)[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks) == prompt
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    status, _, body = http("POST", stack.base_url + "/v1/completions", {**base, "min_tokens": 2})
    error = json.loads(body)["error"]
    assert status == 400 and error["param"] == "min_tokens", body
    status, _, body = http("POST", stack.base_url + "/v1/completions", {**base, "echo": False})
    assert status == 400 and json.loads(body)["error"]["param"] == "max_tokens"  # without echo: at least 1
    # an emoji is split over tokens that are each part of a character: written as bytes, offsets in characters
    status, _, body = http("POST", stack.base_url + "/v1/completions",
                           {**base, "prompt": "Hello world \U0001F600", "logprobs": 5})
    lp = json.loads(body)["choices"][0]["logprobs"]
    assert lp["tokens"][:2] == ["Hello", " world"] and lp["tokens"][2].startswith("bytes: \\xf0"), lp["tokens"]
    assert lp["text_offset"] == [0, 5, 11] + [12] * (len(lp["tokens"]) - 3)
    assert all(len(top) >= 5 for top in lp["top_logprobs"][1:])  # alternatives that are bytes keep their keys
    # token ids whose text starts inside a character (U+FFFD in the text): the first token is still its own
    status, _, body = http("POST", stack.base_url + "/tokenize", {"model": MODEL, "prompt": "I \U0001F343\u65e5\u672c"})
    ids = json.loads(body)["tokens"]  # 'I', ' \xf0\x9f', '\x8d', '\x83', then 日本
    status, _, body = http("POST", stack.base_url + "/v1/completions", {**base, "prompt": ids[2:], "logprobs": 1})
    lp = json.loads(body)["choices"][0]["logprobs"]
    assert lp["tokens"][:2] == ["bytes:\\x8d", "bytes:\\x83"], lp["tokens"]
    assert lp["text_offset"][:3] == [0, 1, 2], lp  # two lone bytes are two U+FFFD, then 日


def test_browsers_may_call_the_api_from_any_origin_by_default(stack):
    """CORS, as vLLM's defaults (--allowed-origins '["*"]'): a browser app on another origin can call the API,
    preflight included, with an Authorization header (which a bare "*" would not cover)."""
    status, headers, _ = _lower(http("OPTIONS", stack.base_url + "/v1/chat/completions", headers={
        "Origin": "https://app.example.com", "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type, x-stainless-os"}))
    assert status == 200 and headers["access-control-allow-origin"] == "*"
    assert "POST" in headers["access-control-allow-methods"]
    allowed = [h.strip() for h in headers["access-control-allow-headers"].split(",")]
    assert "*" in allowed and "authorization" in allowed
    status, headers, body = _lower(http("GET", stack.base_url + "/v1/models",
                                        headers={"Origin": "https://app.example.com"}))
    assert status == 200 and headers["access-control-allow-origin"] == "*" and json.loads(body)["data"]


def test_only_the_allowed_origins_get_cors_headers(tmp_path):
    web_only = Stack(tmp_path, num_workers=0, TESSERA_ALLOWED_ORIGINS='["https://app.example.com"]',
                     TESSERA_ALLOW_CREDENTIALS="1", TESSERA_ALLOWED_HEADERS='["authorization"]')
    try:
        allowed = _lower(http("GET", web_only.base_url + "/version", headers={"Origin": "https://app.example.com"}))[1]
        ok_preflight = _lower(http("OPTIONS", web_only.base_url + "/v1/completions", headers={
            "Origin": "https://app.example.com", "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization, content-type"}))[1]
        other = _lower(http("GET", web_only.base_url + "/version", headers={"Origin": "https://evil.example"}))[1]
        preflight = _lower(http("OPTIONS", web_only.base_url + "/v1/completions", headers={
            "Origin": "https://evil.example", "Access-Control-Request-Method": "POST"}))[1]
    finally:
        web_only.stop()
    assert allowed["access-control-allow-origin"] == "https://app.example.com"
    assert allowed["access-control-allow-credentials"] == "true"
    listed = {h.strip() for h in ok_preflight["access-control-allow-headers"].split(",")}
    assert {"authorization", "content-type"} <= listed  # a JSON POST passes an explicit header list, as in vLLM
    assert "access-control-allow-origin" not in other and "access-control-allow-origin" not in preflight


def _lower(response: tuple[int, dict, bytes]) -> tuple[int, dict, bytes]:
    """``http``'s answer with lower-case header names (HTTP header names are case-insensitive)."""
    status, headers, body = response
    return status, {name.lower(): value for name, value in headers.items()}, body
