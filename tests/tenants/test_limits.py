"""Tenants' gateway limits, enforced in Redis across several Daphne processes: 429 in OpenAI's
envelope with ``Retry-After``; a request that fails or is aborted frees its slot and counts
what it actually used."""
from __future__ import annotations

import concurrent.futures
import datetime as dt
import json
import socket
import time
from http.client import HTTPConnection
from urllib.parse import urlsplit

import openai
import pytest

from tests.tenants.helpers import (  # noqa: F401 (fixtures)
    HeldStream, completion, make_tenant, orm, tenant_web, usage_totals, wait_for, wait_usage, web)
from tests.webapp.serving_stack import MODEL, http


@pytest.fixture(scope="module")
def second_web(stack, orm, tmp_path_factory):
    """A second Daphne on the same Redis and database: limits must hold across processes."""
    s = web(stack, orm, tmp_path_factory, "tenant-web-2")
    yield s
    s.stop()


def _rate_limited(result, kind: str) -> int:
    status, headers, body = result
    assert status == 429, body
    error = body["error"]
    assert error["code"] == "rate_limit_exceeded" and error["type"] == kind, error
    retry_after = {k.lower(): v for k, v in headers.items()}["retry-after"]
    assert int(retry_after) >= 1
    return int(retry_after)


def test_requests_per_minute_is_atomic_across_web_processes(tenant_web, second_web):
    team = make_tenant(requests_per_minute=5)
    headers = {"X-Tenant-ID": team.slug}
    urls = [tenant_web.base_url, second_web.base_url] * 8
    started = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        results = list(pool.map(lambda url: completion(url, headers, max_tokens=1), urls))
    # The bucket holds 5 and refills one request every 12 s: on a slow machine the 16 admissions
    # can spread over more than 12 s, and each full 12 s admits one more, never more than that.
    refills = int((time.monotonic() - started) / 12)
    admitted = [r[0] for r in results].count(200)
    assert 5 <= admitted <= 5 + refills, ([r[0] for r in results], refills)
    refused = [r for r in results if r[0] != 200]
    assert len(refused) == 16 - admitted
    for result in refused:
        assert 1 <= _rate_limited(result, "requests") <= 12  # the next request is back within 60/5 s
    usage = wait_usage(team, 16)
    assert usage["errors_rate_limited"] == len(refused) and usage["requests"] == 16


def test_openai_sdk_sees_a_rate_limit_error(tenant_web):
    team = make_tenant(requests_per_minute=1)
    client = tenant_web.openai()
    client.completions.create(model=MODEL, prompt="Hi", max_tokens=1, extra_headers={"X-Tenant-ID": team.slug})
    with pytest.raises(openai.RateLimitError) as error:
        client.completions.create(model=MODEL, prompt="Hi", max_tokens=1, extra_headers={"X-Tenant-ID": team.slug})
    assert error.value.code == "rate_limit_exceeded" and "requests per min" in error.value.message
    assert int(error.value.response.headers["retry-after"]) >= 1


def test_concurrent_requests_across_processes_and_aborts_free_the_slot(tenant_web, second_web):
    team = make_tenant(max_concurrent_requests=1)
    headers = {"X-Tenant-ID": team.slug}
    held = HeldStream(tenant_web.base_url, headers)
    assert held.status == 200
    _rate_limited(completion(second_web.base_url, headers, max_tokens=1), "requests")
    _rate_limited(completion(tenant_web.base_url, headers, max_tokens=1), "requests")
    held.close()  # the client leaves: the engine request is aborted and the slot freed
    status = wait_for(lambda: completion(second_web.base_url, headers, max_tokens=1)[0] == 200, timeout=20)
    assert status
    usage = wait_for(lambda: (lambda u: u if u["errors_aborted"] == 1 and u["requests"] - u["errors_aborted"]
                              - u["errors_rate_limited"] == 1 else None)(usage_totals(team)))
    # The aborted stream counts what it used: its prompt and the token(s) it delivered, besides
    # the one token of the request that succeeded afterwards.
    assert usage["prompt_tokens"] > 0 and usage["completion_tokens"] >= 2


@pytest.mark.parametrize("stream", [False, True])
def test_clients_that_leave_right_after_sending_free_their_slots(tenant_web, stream):
    """The client closes the connection as soon as the request is written: Django cancels the view,
    before the stream's first chunk or while admission waits for Redis; the slot is freed then."""
    team = make_tenant(max_concurrent_requests=1)
    body = json.dumps({"model": MODEL, "prompt": "Hello there my friend", "max_tokens": 16, "stream": stream})
    raw = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
           f"X-Tenant-ID: {team.slug}\r\nContent-Length: {len(body)}\r\n\r\n{body}").encode()
    url = urlsplit(tenant_web.base_url)
    for _ in range(10):
        with socket.create_connection((url.hostname, url.port)) as client:
            client.sendall(raw)
        time.sleep(0.3)
    headers = {"X-Tenant-ID": team.slug}
    assert wait_for(lambda: completion(tenant_web.base_url, headers, max_tokens=1)[0] == 200, timeout=30)
    # Each request that reached the view counts as aborted (one that Django dropped while reading its body,
    # none); the one after them succeeded.
    usage = wait_for(lambda: (lambda u: u if u["requests"] - u["errors_aborted"] == 1 else None)(usage_totals(team)))
    assert usage["requests"] <= 11, usage


def test_a_client_that_leaves_while_redis_admits_it_frees_its_slot_and_reservation(tenant_web, stack):
    """Redis pauses writes, so the admission script waits; the client leaves meanwhile (Django cancels the view);
    the admission Redis grants once writes resume is settled at once, not held for its 600 s lease."""
    team = make_tenant(max_concurrent_requests=1, daily_token_budget=10_000)
    body = json.dumps({"model": MODEL, "prompt": "Hello", "max_tokens": 2000, "n": 4})
    raw = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
           f"X-Tenant-ID: {team.slug}\r\nContent-Length: {len(body)}\r\n\r\n{body}").encode()
    url = urlsplit(tenant_web.base_url)
    completion(tenant_web.base_url, {"X-Tenant-ID": team.slug}, max_tokens=1)  # the day counter exists
    inflight, reservations = f"tessera:limits:{team.id}:inflight", f"tessera:limits:{team.id}:reserved"
    wait_for(lambda: stack.redis.zcard(inflight) == 0)  # the warm-up request is settled

    def admission_blocked() -> bool:  # the admission script waits for the pause
        return any(c["cmd"] == "evalsha" and "b" in c["flags"] for c in stack.redis.client_list())
    stack.redis.execute_command("CLIENT", "PAUSE", 3000, "WRITE")  # under the workers' 4 s heartbeat TTL
    try:
        with socket.create_connection((url.hostname, url.port)) as client:
            client.sendall(raw)
            wait_for(admission_blocked, timeout=2.5, interval=0.02)
        time.sleep(0.3)  # Daphne sees the disconnect; Django cancels the view while it waits for Redis
    finally:
        stack.redis.execute_command("CLIENT", "UNPAUSE")
    assert wait_for(lambda: stack.redis.hlen(reservations) == 0, timeout=10)
    assert wait_for(lambda: completion(tenant_web.base_url, {"X-Tenant-ID": team.slug}, max_tokens=1)[0] == 200,
                    timeout=10)


def test_a_failed_request_frees_its_slot(tenant_web):
    team = make_tenant(max_concurrent_requests=1)
    headers = {"X-Tenant-ID": team.slug}
    status, _, body = completion(tenant_web.base_url, headers, prompt="hi " * 3000)  # beyond the context
    assert status == 400, body
    assert completion(tenant_web.base_url, headers, max_tokens=1)[0] == 200
    assert completion(tenant_web.base_url, headers, max_tokens=1)[0] == 200


def test_tokens_per_minute_counts_actual_tokens(tenant_web):
    team = make_tenant(tokens_per_minute=40)
    headers = {"X-Tenant-ID": team.slug}
    status, _, body = completion(tenant_web.base_url, headers, max_tokens=45, ignore_eos=True)
    assert status == 200 and body["usage"]["total_tokens"] > 40
    # The bucket is in debt by what the first request used beyond 40 tokens: retry when it refilled.
    wait_for(lambda: usage_totals(team)["requests"] == 1)
    retry_after = wait_for(lambda: (lambda r: r if r[0] == 429 else None)(
        completion(tenant_web.base_url, headers, max_tokens=1)), timeout=5)
    seconds = _rate_limited(retry_after, "tokens")
    debt = body["usage"]["total_tokens"] - 40
    assert seconds <= (debt + 1) * 60 / 40 + 2


def test_daily_budget_refuses_until_midnight_utc(tenant_web):
    team = make_tenant(daily_token_budget=20)
    headers = {"X-Tenant-ID": team.slug}
    status, _, body = completion(tenant_web.base_url, headers, max_tokens=20, ignore_eos=True)
    assert status == 200
    wait_for(lambda: usage_totals(team)["requests"] == 1)
    result = wait_for(lambda: (lambda r: r if r[0] == 429 else None)(completion(tenant_web.base_url, headers)),
                      timeout=5)
    seconds = _rate_limited(result, "tokens")
    now = dt.datetime.now(dt.timezone.utc)
    midnight = (now + dt.timedelta(days=1)).replace(hour=0, minute=0, second=0, microsecond=0)
    assert abs(seconds - (midnight - now).total_seconds()) < 30
    assert "daily budget" in result[2]["error"]["message"]


def test_daily_budget_is_a_hard_cap_on_generated_tokens_too(tenant_web):
    """n answers of max_tokens each may not run past the budget: their max_tokens is capped to what is left
    (finish reason length), and once nothing is left the tenant is refused until midnight."""
    team = make_tenant(daily_token_budget=100)
    headers = {"X-Tenant-ID": team.slug}
    status, _, body = completion(tenant_web.base_url, headers, max_tokens=16, n=8, ignore_eos=True)
    assert status == 200, body
    assert 90 <= body["usage"]["total_tokens"] <= 100, body["usage"]  # 8 x 16 = 128 asked for
    assert {c["finish_reason"] for c in body["choices"]} == {"length"}
    results = []
    while not results or results[-1][0] == 200:
        results.append(completion(tenant_web.base_url, headers, max_tokens=16, n=2, ignore_eos=True))
        assert len(results) <= 10, [r[0] for r in results]
    _rate_limited(results[-1], "tokens")
    assert "daily budget" in results[-1][2]["error"]["message"]
    assert "Counted today" in results[-1][2]["error"]["message"]
    usage = wait_usage(team, 1 + len(results))
    assert usage["prompt_tokens"] + usage["completion_tokens"] <= 100, usage


def test_daily_budget_held_by_a_request_in_flight_is_a_short_wait_not_until_midnight(tenant_web):
    team = make_tenant(daily_token_budget=1500)
    headers = {"X-Tenant-ID": team.slug}
    held = HeldStream(tenant_web.base_url, headers, max_tokens=1200)  # reserves 1,200 while it streams
    assert held.status == 200
    try:  # about 300 prompt tokens and 32 answers: more than the 1,500 - 1,200 - its prompt left, less than 1,500
        result = completion(tenant_web.base_url, headers, prompt="hello " * 300, max_tokens=5, n=32)
        seconds = _rate_limited(result, "tokens")
        assert seconds <= 5 and "held by requests in flight" in result[2]["error"]["message"], result
    finally:
        held.close()
    # Fits even if the held stream used all of its 1,200 tokens before its abort.
    assert wait_for(lambda: completion(tenant_web.base_url, headers, max_tokens=1, n=32)[0] == 200)


def test_daily_budget_reservations_come_back_when_answers_end_early(tenant_web):
    """A request reserves n x max_tokens while it runs; what its answers did not use is free again after it."""
    team = make_tenant(daily_token_budget=200)
    headers = {"X-Tenant-ID": team.slug}
    for _ in range(3):  # each reserves 150 of the 200 but uses a few tokens: no later one is capped
        status, _, body = completion(tenant_web.base_url, headers, max_tokens=150, stop_token_ids=list(range(49152)))
        assert status == 200 and body["usage"]["completion_tokens"] == 1, body
    wait_for(lambda: usage_totals(team)["requests"] == 3)
    status, _, body = completion(tenant_web.base_url, headers, max_tokens=20, n=2, ignore_eos=True)
    assert status == 200 and body["usage"]["completion_tokens"] == 40, body  # not capped: 40 fit what is left


def test_daily_budget_counts_the_days_recorded_usage_when_its_counter_is_missing(tenant_web, stack):
    """A budget's day counter that Redis lost (a restart of a private Redis), or that never existed (a
    budget set during the day), starts from the day's usage records, as the dashboard counts."""
    team = make_tenant(daily_token_budget=20)
    headers = {"X-Tenant-ID": team.slug}
    status, _, body = completion(tenant_web.base_url, headers, max_tokens=20, ignore_eos=True)
    assert status == 200 and body["usage"]["total_tokens"] >= 20
    wait_for(lambda: usage_totals(team)["requests"] == 1)
    day = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%d")
    assert stack.redis.delete(f"tessera:limits:{team.pk}:day:{day}") == 1
    status, _, body = completion(tenant_web.base_url, headers)
    assert status == 429 and "daily budget" in body["error"]["message"], body


def _post(base_url: str, path: str, body: dict, headers: dict[str, str]) -> tuple[int, str, dict[str, str], dict]:
    """POST over http.client: (status, reason phrase of the status line, headers lower-cased, JSON body)."""
    host, port = base_url.removeprefix("http://").split(":")
    conn = HTTPConnection(host, int(port), timeout=60)
    try:
        conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json", **headers})
        response = conn.getresponse()
        return (response.status, response.reason, {k.lower(): v for k, v in response.getheaders()},
                json.loads(response.read()))
    finally:
        conn.close()


@pytest.mark.parametrize("limit, what", [("tokens_per_minute", "tokens per min (TPM)"),
                                         ("daily_token_budget", "tokens per UTC day (daily budget)")])
def test_a_prompt_larger_than_a_token_limit_is_refused_without_retry_after(tenant_web, limit, what):
    """No retry can serve a prompt larger than the limit itself: a 429 that says so, without
    Retry-After, and the limit is left untouched for the next request."""
    team = make_tenant(**{limit: 10})
    headers = {"X-Tenant-ID": team.slug}
    prompt = "hello " * 30
    _, _, raw = http("POST", tenant_web.base_url + "/tokenize", {"model": MODEL, "prompt": prompt})
    prompt_tokens = json.loads(raw)["count"]
    status, reason, response_headers, body = _post(tenant_web.base_url, "/v1/completions",
                                                   {"model": MODEL, "prompt": prompt, "max_tokens": 1}, headers)
    assert status == 429 and reason == "Too Many Requests", (status, reason, body)
    error = body["error"]
    assert error["code"] == "rate_limit_exceeded" and error["type"] == "tokens", error
    assert "too large" in error["message"] and what in error["message"], error
    # The day's budget must also hold the one token the answer generates at least.
    requested = prompt_tokens + (limit == "daily_token_budget")
    assert f"Limit 10, Requested {requested} (" in error["message"], error
    assert "retry-after" not in response_headers
    assert completion(tenant_web.base_url, headers, prompt="Hi", max_tokens=1)[0] == 200
    assert wait_usage(team, 2)["errors_rate_limited"] == 1


def test_rate_limit_status_line_says_too_many_requests(tenant_web):
    """The status line's reason phrase is the standard one (it was "429 Unknown Status")."""
    team = make_tenant(requests_per_minute=1)
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 1}
    assert _post(tenant_web.base_url, "/v1/completions", body, {"X-Tenant-ID": team.slug})[0] == 200
    status, reason, response_headers, _ = _post(tenant_web.base_url, "/v1/completions", body,
                                                {"X-Tenant-ID": team.slug})
    assert (status, reason) == (429, "Too Many Requests") and int(response_headers["retry-after"]) >= 1
