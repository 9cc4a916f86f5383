"""GPU shares on the running server: two tenants at 30% and 70% that both flood the workers get
their completion tokens in a 30/70 split, counted from their streamed responses, on one worker
and on two workers of the model together.

Every request asks for the same number of tokens, so the engine's running requests finish in
waves and the scheduler admits its whole backlog at once: the split then comes from which
tenant's queue the workers take from (:mod:`webapp.serving.request_queue`), not from the
scheduler's choice among what it holds. (With the queues taken in turn, round robin, the
30% tenant got about 50%.) Also: a worker that stops ends its backlogged requests like its
running ones. Real stack (Redis, Celery workers with the packaged SmolLM2, Daphne), no mocks.
"""
from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time

import pytest

from tests.webapp.raw_http import open_stream
from tests.webapp.serving_stack import MODEL, Stack, http
from webapp import launcher

MAX_NUM_SEQS = 4
BACKLOG = 4  # --max-waiting-requests: a wave of MAX_NUM_SEQS admits the whole backlog
CONCURRENCY = 12  # streams each tenant keeps open: 3 x max_num_seqs
MAX_TOKENS = 16
WARMUP_TOKENS = 300  # served (both tenants together) before the window opens: time for the shares to even out
WINDOW_TOKENS = 600  # served in the window
SHARES = {"share-low": 30, "share-high": 70}


def _create_tenants(s: Stack) -> None:
    """The tenants, as an operator creates them (saving publishes the shares to the workers)."""
    code = ("from tenants.models import Tenant\n"
            + "".join(f"Tenant.objects.create(slug={slug!r}, name={slug!r}, gpu_share={share})\n"
                      for slug, share in SHARES.items()))
    subprocess.run([sys.executable, launcher.MANAGE, "shell", "-c", code], env=s.env, check=True,
                   cwd=launcher.BASE_DIR)
    deadline = time.monotonic() + 30
    while not all((w.get("tenant_shares") or {}).get(slug) == share
                  for w in s.worker_infos() for slug, share in SHARES.items()):
        assert time.monotonic() < deadline, s.worker_infos()
        time.sleep(0.1)


def _engine_argv(max_num_seqs: int, backlog: int) -> list[str]:
    return [MODEL, "--max-model-len", "256", "--kv-cache-space", "0.25", "--max-num-seqs", str(max_num_seqs),
            "--max-waiting-requests", str(backlog)]


@pytest.fixture(scope="module")
def share_stack(tmp_path_factory):
    s = Stack(tmp_path_factory.mktemp("gpu-share"), engine_argv=_engine_argv(MAX_NUM_SEQS, BACKLOG),
              OMP_NUM_THREADS="1")  # on a shared CPU, OpenMP threads spinning against other processes cost 10x
    _create_tenants(s)
    yield s
    s.stop()


async def _flood(base_url: str, tenant: str, served: list[tuple[str, int]], stop: asyncio.Event) -> None:
    """Keep one streaming completion of ``tenant`` open until ``stop``; append ``(tenant, tokens)``
    for every streamed chunk (tokens counted from the chunk's logprobs)."""
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": MAX_TOKENS, "ignore_eos": True, "stream": True,
            "logprobs": 0, "temperature": 0}
    while not stop.is_set():
        reader, writer, status = await open_stream(base_url, "/v1/completions", body,
                                                   headers={"X-Tenant-ID": tenant})
        assert status == 200
        try:
            while not stop.is_set():
                line = await reader.readline()
                if not line or line.strip() == b"data: [DONE]":
                    break
                if line.startswith(b"data: "):
                    chunk = json.loads(line[6:])
                    assert "error" not in chunk, chunk
                    logprobs = chunk["choices"][0].get("logprobs") or {}
                    served.append((tenant, len(logprobs.get("tokens") or ())))
        finally:
            writer.close()


def _window_share(base_url: str, concurrency: int, window_tokens: int = WINDOW_TOKENS) -> dict[str, int]:
    """Both tenants keep ``concurrency`` streams each open; the tokens each got in the window (after
    ``WARMUP_TOKENS``, for ``WINDOW_TOKENS``), while both still flood. The clients then leave."""
    async def run() -> dict[str, int]:
        served: list[tuple[str, int]] = []
        stop = asyncio.Event()
        # Interleaved, as two teams' clients arrive.
        streams = [asyncio.ensure_future(_flood(base_url, tenant, served, stop))
                   for _ in range(concurrency) for tenant in SHARES]
        deadline = time.monotonic() + 300
        while sum(n for _, n in served) < WARMUP_TOKENS + window_tokens:
            assert time.monotonic() < deadline, f"only {sum(n for _, n in served)} tokens served"
            done = [f for f in streams if f.done()]
            assert not done, done[0].exception()
            await asyncio.sleep(0.05)
        # The window: from the token after the warm-up to now, while both tenants still flood.
        window, total = {tenant: 0 for tenant in SHARES}, 0
        for tenant, n in list(served):
            total += n
            if total > WARMUP_TOKENS:
                window[tenant] += n
        stop.set()
        await asyncio.gather(*streams, return_exceptions=True)
        return window

    return asyncio.run(run())


def _assert_30_70(base_url: str, what: str, window_tokens: int = WINDOW_TOKENS) -> None:
    window = _window_share(base_url, CONCURRENCY, window_tokens)
    total = sum(window.values())
    low = 100 * window["share-low"] / total
    print(f"{what}, served in the window: {window} -> {low:.1f}% / {100 - low:.1f}%")
    assert total >= window_tokens
    assert abs(low - 30) <= 5, window


def test_two_flooding_tenants_are_served_in_their_shares(share_stack):
    s = share_stack
    _assert_30_70(s.base_url, "one worker")

    # The clients left: their requests, running, in the backlog or still in Redis, were aborted;
    # the engine empties, with every KV block free and no request left held ...
    held_key = f"tessera:held:{MODEL}"
    deadline = time.monotonic() + 120
    while True:
        stats = s.worker_infos()[0]["stats"]
        if ((stats["num_running"], stats["num_waiting"], s.redis.hlen(held_key)) == (0, 0, 0)
                and stats["num_free_blocks"] == stats["num_total_blocks"]):
            break
        assert time.monotonic() < deadline, (stats, s.redis.hgetall(held_key))
        time.sleep(0.2)
    # ... and the places of the aborted requests are free again: all of them at once.
    async def fill() -> list[int]:
        body = {"model": MODEL, "prompt": "Hi", "max_tokens": 2}
        replies = await asyncio.gather(*[asyncio.to_thread(http, "POST", s.base_url + "/v1/completions", body,
                                                           {"X-Tenant-ID": "share-low"}, 120)
                                         for _ in range(2 * CONCURRENCY)])
        return [status for status, _, _ in replies]

    assert asyncio.run(fill()) == [200] * (2 * CONCURRENCY)


BATCH = 120  # prompts of one request: 12 enter the engine (running and backlog), the rest wait in Redis


def test_one_tenants_batch_neither_holds_up_another_nor_stays_queued_after_its_client_left(share_stack):
    """share-low sends one completions request of BATCH prompts; share-high's single request, sent
    once the batch waits in Redis, is answered while most of the batch still waits there (each
    tenant has its queue, taken from in turn). When the batch's client leaves, its waiting
    messages are taken off the queue at once."""
    s = share_stack
    queue = f"tessera:queue:{MODEL}:share-low"

    def wait_queue(condition, timeout: float) -> int:
        deadline = time.monotonic() + timeout
        while not condition(length := s.redis.llen(queue)):
            assert time.monotonic() < deadline, length
            time.sleep(0.02)
        return length

    async def run() -> tuple[int, float, int]:
        batch = {"model": MODEL, "prompt": ["Hi"] * BATCH, "max_tokens": 8, "ignore_eos": True, "stream": True}
        reader, writer, status = await open_stream(s.base_url, "/v1/completions", batch,
                                                   headers={"X-Tenant-ID": "share-low"})
        assert status == 200
        try:
            await asyncio.to_thread(wait_queue, lambda n: n >= BATCH // 2, 30)
            start = time.monotonic()
            single = {"model": MODEL, "prompt": "Hello", "max_tokens": 4, "ignore_eos": True}
            answer = await asyncio.to_thread(http, "POST", s.base_url + "/v1/completions", single,
                                             {"X-Tenant-ID": "share-high"})
            took, still_queued = time.monotonic() - start, s.redis.llen(queue)
        finally:
            writer.transport.abort()  # the batch's client leaves
        await asyncio.to_thread(wait_queue, lambda n: n == 0, 10)
        return answer[0], took, still_queued

    status, took, still_queued = asyncio.run(run())
    assert status == 200
    assert still_queued >= BATCH // 3, (took, still_queued)  # answered long before the batch's turn


def test_worker_shutdown_ends_backlogged_requests_like_running_ones(share_stack):
    """Last in this module: it stops the worker. The streams of the running and of the
    backlogged requests all end with the same error event."""
    s = share_stack
    body = {"model": MODEL, "prompt": "Tell me a long story.", "max_tokens": 200, "ignore_eos": True, "stream": True}
    held_key = f"tessera:held:{MODEL}"

    async def response(head: asyncio.Future) -> tuple[int, str]:
        reader, writer, status = await head
        rest = (await reader.read()).decode()
        writer.close()
        return status, rest

    async def run() -> list[tuple[int, str]]:
        heads = [asyncio.ensure_future(open_stream(s.base_url, "/v1/completions", body,
                                                   headers={"X-Tenant-ID": "share-low"}))
                 for _ in range(MAX_NUM_SEQS + 2)]
        deadline = time.monotonic() + 60
        # Running requests that sent their first token, and two backlogged ones, still held.
        while (s.worker_infos()[0]["stats"]["num_running"], s.worker_infos()[0]["stats"]["num_waiting"],
               s.redis.hlen(held_key)) != (MAX_NUM_SEQS, 2, 2):
            assert time.monotonic() < deadline, (s.worker_infos()[0]["stats"], s.redis.hlen(held_key))
            await asyncio.sleep(0.05)
        stopping = asyncio.ensure_future(asyncio.to_thread(s.workers[0].stop, 60))  # SIGTERM: warm shutdown
        responses = await asyncio.wait_for(asyncio.gather(*[response(h) for h in heads]), 60)
        assert await stopping == 0
        return responses

    responses = asyncio.run(run())
    for status, rest in responses:
        assert status == 200, rest
        events = [line[6:] for line in rest.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]", events[-3:]
        error = json.loads(events[-2])["error"]
        assert error["code"] == "service_unavailable" and "shutting down" in error["message"], error
    assert s.redis.hlen(held_key) == 0  # ended, not left to be requeued


def test_two_workers_hold_the_shares_in_aggregate(tmp_path_factory):
    """Two workers of the model, each with its own engine and backlog: the split holds over both
    together (the counters that decide which tenant's queue a worker takes from are shared in
    Redis), not per worker."""
    s = Stack(tmp_path_factory.mktemp("gpu-share-two"), num_workers=2, engine_argv=_engine_argv(2, 2),
              OMP_NUM_THREADS="1")
    try:
        deadline = time.monotonic() + 300
        while sum(bool(w.get("live")) for w in s.worker_infos()) < 2:
            assert time.monotonic() < deadline
            time.sleep(0.2)
        _create_tenants(s)
        # Two engines interleave their steps at random: a longer window, as the split's noise is larger.
        _assert_30_70(s.base_url, "two workers", window_tokens=3 * WINDOW_TOKENS)
        served = {w["id"]: w["stats"]["generation_tokens_total"] for w in s.worker_infos()}
        assert all(tokens > WINDOW_TOKENS / 4 for tokens in served.values()), served  # both served
    finally:
        s.stop()
