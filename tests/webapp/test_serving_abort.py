"""A client that disconnects has its engine requests aborted and its KV blocks returned,
whenever it leaves: mid-stream, during a long prefill, or while its requests are being enqueued."""
from __future__ import annotations

import asyncio
import random
import time

import pytest

from tests.webapp.raw_http import open_stream, read_events
from tests.webapp.serving_stack import MODEL

LONG = {"model": MODEL, "prompt": "Write a long story about a dragon.", "max_tokens": 1500, "ignore_eos": True,
        "temperature": 0}


def _stats(stack) -> dict:
    (info,) = stack.worker_infos()
    return info["stats"]


def _wait_idle(stack, timeout: float) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        stats = _stats(stack)
        if stats["num_running"] == 0 and stats["num_free_blocks"] == stats["num_total_blocks"]:
            return stats
        assert time.monotonic() < deadline, stats
        time.sleep(0.05)


def _wait_running(stack, timeout: float) -> dict:
    """Stats once the worker's heartbeat shows the request running (heartbeats lag up to 0.5 s)."""
    deadline = time.monotonic() + timeout
    while True:
        stats = _stats(stack)
        if stats["num_running"] >= 1:
            return stats
        assert time.monotonic() < deadline, stats
        time.sleep(0.05)


@pytest.mark.parametrize("stream", [True, False])
def test_disconnect_aborts_and_frees_blocks(stack, stream):
    before = _wait_idle(stack, 10)

    async def run() -> None:
        reader, writer, status = await open_stream(stack.base_url, "/v1/completions", dict(LONG, stream=stream),
                                                  read_head=stream)
        try:
            if stream:
                assert status == 200
                assert len(await read_events(reader, limit=5)) == 5
            stats = await asyncio.to_thread(_wait_running, stack, 20)
            assert stats["num_running"] == 1 and stats["num_free_blocks"] < stats["num_total_blocks"]
        finally:
            writer.transport.abort()  # drop the connection, as a client that goes away does

    asyncio.run(run())
    after = _wait_idle(stack, 3)  # heartbeats are 0.5 s apart; the abort itself takes one step
    generated = after["generation_tokens_total"] - before["generation_tokens_total"]
    assert generated < 300, generated  # far from the 1500 asked for: generation stopped at once
    time.sleep(1.0)
    assert _stats(stack)["generation_tokens_total"] == after["generation_tokens_total"]


def _new_claim(stack, known: set[bytes], timeout: float = 30) -> None:
    """Wait until a worker has claimed a request not in ``known``."""
    deadline = time.monotonic() + timeout
    while True:
        for key in set(stack.redis.keys("tessera:claim:*")) - known:
            if stack.redis.get(key) not in (None, b"aborted"):
                return
        assert time.monotonic() < deadline
        time.sleep(0.01)


def _served(stack) -> int:
    """Tokens served to the model's requests (every tenant's), as the share-aware dequeue counts them."""
    from webapp.serving.request_queue import served_tokens
    from webapp.transport.keys import fair_key

    return sum(served_tokens(stack.redis.hgetall(fair_key(MODEL))).values())


def test_a_prompt_prefilled_for_a_client_that_left_counts_in_its_tenants_share(stack):
    """The client leaves once its request runs, before any token came back: the prompt the engine computed
    still counts as served to its tenant (no free prefills in the shares)."""
    _wait_idle(stack, 10)
    served = _served(stack)
    rng = random.Random(2)
    prompt = [rng.randrange(1000, 30000) for _ in range(1900)]
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 50, "ignore_eos": True, "stream": True}

    async def run() -> None:
        reader, writer, _ = await open_stream(stack.base_url, "/v1/completions", body, read_head=False)
        try:
            await asyncio.to_thread(_wait_running, stack, 30)
        finally:
            writer.transport.abort()

    asyncio.run(run())
    _wait_idle(stack, 30)
    deadline = time.monotonic() + 30  # the abort lands after the step running when it came
    while _served(stack) - served < len(prompt):
        assert time.monotonic() < deadline, _served(stack) - served
        time.sleep(0.05)
    assert _served(stack) - served < 2 * len(prompt)  # once (with the few tokens made before the abort landed)


def test_disconnect_during_prefill_before_the_first_chunk(stack):
    before = _wait_idle(stack, 10)
    rng = random.Random(1)
    prompt = [rng.randrange(1000, 30000) for _ in range(1900)]  # one long prefill
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 100, "ignore_eos": True, "stream": True}

    async def run() -> None:
        known = set(stack.redis.keys("tessera:claim:*"))
        reader, writer, _ = await open_stream(stack.base_url, "/v1/completions", body, read_head=False)
        try:
            await asyncio.to_thread(_new_claim, stack, known)  # in the engine now, prefilling
            with pytest.raises(TimeoutError):  # nothing sent yet, not even the headers
                await asyncio.wait_for(reader.read(1), 0.01)
        finally:
            writer.transport.abort()

    asyncio.run(run())
    after = _wait_idle(stack, 10)  # the abort lands after the prefill step
    assert after["generation_tokens_total"] - before["generation_tokens_total"] <= 1


@pytest.mark.parametrize("stream", [True, False])
def test_disconnect_while_a_batch_is_enqueued(stack, stream):
    """A batch of prompts takes a while to enqueue; leaving at any moment of it, or just
    after, leaves no request running."""
    rng = random.Random(2)
    prompts = [[rng.randrange(1000, 30000) for _ in range(16)] for _ in range(128)]
    body = {"model": MODEL, "prompt": prompts, "max_tokens": 32, "ignore_eos": True, "stream": stream}
    for delay in (0.0, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32):
        before = _wait_idle(stack, 10)

        async def run() -> None:
            reader, writer, _ = await open_stream(stack.base_url, "/v1/completions", body, read_head=False)
            await asyncio.sleep(delay)
            writer.transport.abort()

        asyncio.run(run())
        time.sleep(1.0)  # aborts reach the worker
        after = _wait_idle(stack, 10)
        generated = after["generation_tokens_total"] - before["generation_tokens_total"]
        assert generated < 128 * 32 // 4, (delay, generated)


def test_drop_queued_takes_off_only_the_given_requests_and_keeps_the_others_in_order(stack):
    """What a client that leaves a large batch does to the queue (``request_queue.drop_queued``)."""
    import redis.asyncio as aioredis

    from inference.sampling_params import SamplingParams
    from webapp.serving.request_queue import QueuedRequest, drop_queued, enqueue
    from webapp.transport.keys import queue_key

    model = "drop-test"  # no worker serves it
    queue = queue_key(model, None)
    stack.redis.delete(queue)
    requests = [QueuedRequest(f"req-{i}", "reply", model, [1, 2], SamplingParams(max_tokens=4), 0.0) for i in range(30)]

    async def drop() -> int:
        client = aioredis.Redis.from_url(stack.redis_url)
        try:
            await enqueue(client, model, requests)
            return await drop_queued(client, queue, [f"req-{i}" for i in range(0, 30, 3)] + ["req-99"])
        finally:
            await client.aclose()

    assert asyncio.run(drop()) == 10
    consumed = [QueuedRequest.decode(stack.redis.rpop(queue)).rid for _ in range(20)]
    assert consumed == [f"req-{i}" for i in range(30) if i % 3]  # the order a worker takes them in
    assert stack.redis.llen(queue) == 0
