"""/metrics counters and histograms never go backwards when a worker stops, dies or restarts."""
from __future__ import annotations

import time

import pytest

from tests.webapp.serving_stack import MODEL, Stack, metric_value, metrics_text

LABEL = f'{{model_name="{MODEL}"}}'
COUNTERS = {  # sample prefix -> what one request of 5 output tokens adds
    "vllm:generation_tokens_total" + LABEL: 5,
    f'vllm:request_success_total{{finished_reason="length",model_name="{MODEL}"}}': 1,
    "vllm:time_to_first_token_seconds_count" + LABEL: 1,
    "vllm:inter_token_latency_seconds_count" + LABEL: 4,
    "vllm:e2e_request_latency_seconds_count" + LABEL: 1,
}


@pytest.fixture(scope="module")
def own_stack(tmp_path_factory):
    s = Stack(tmp_path_factory.mktemp("metrics-restarts"))
    yield s
    s.stop()


def _counters(s: Stack) -> dict[str, float]:
    text = metrics_text(s.base_url)
    return {name: metric_value(text, name) for name in COUNTERS}


def _one_request(s: Stack) -> None:
    reply = s.openai().completions.create(model=MODEL, prompt="Count:", max_tokens=5, temperature=0,
                                          extra_body={"ignore_eos": True})
    assert reply.usage.completion_tokens == 5


def _wait_for(s: Stack, expected: dict[str, float], timeout: float = 5.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while (got := _counters(s)) != expected:
        assert time.monotonic() < deadline, (got, expected)
        time.sleep(0.1)
    return got


def _plus_one_request(counters: dict[str, float]) -> dict[str, float]:
    return {name: value + COUNTERS[name] for name, value in counters.items()}


def _wait_no_worker(s: Stack) -> None:
    deadline = time.monotonic() + 10
    while s.worker_infos():  # a killed worker's heartbeat expires after 4 s
        assert time.monotonic() < deadline
        time.sleep(0.1)


def test_counters_survive_a_killed_and_a_stopped_worker(own_stack):
    s = own_stack
    _one_request(s)
    counted = _wait_for(s, _plus_one_request({name: 0.0 for name in COUNTERS}))

    # Killed: what it had published stays counted, with no worker left and after a new one starts.
    s.workers[-1].kill()
    _wait_no_worker(s)
    assert metric_value(metrics_text(s.base_url), "tessera:num_workers" + LABEL) == 0
    assert _counters(s) == counted
    s.add_worker()
    s.wait_live()
    assert _counters(s) == counted
    _one_request(s)
    counted = _wait_for(s, _plus_one_request(counted))

    # Stopped right after answering (SIGTERM): its last increments are flushed on the way out.
    _one_request(s)
    s.workers[-1].stop()
    assert _counters(s) == _plus_one_request(counted)
    s.add_worker()
    s.wait_live()


def test_counters_carry_their_created_time(own_stack):
    text = metrics_text(own_stack.base_url)
    created = metric_value(text, "vllm:generation_tokens_created" + LABEL)
    assert 0 < time.time() - created < 3600
    assert metric_value(text, "vllm:time_to_first_token_seconds_created" + LABEL) == created
