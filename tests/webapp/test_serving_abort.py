"""A client that disconnects has its engine request aborted and its KV blocks returned."""
from __future__ import annotations

import asyncio
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


@pytest.mark.parametrize("stream", [True, False])
def test_disconnect_aborts_and_frees_blocks(stack, stream):
    before = _wait_idle(stack, 10)

    async def run() -> None:
        reader, writer, status = await open_stream(stack.base_url, "/v1/completions", dict(LONG, stream=stream),
                                                  read_head=stream)
        if stream:
            assert status == 200
            assert len(await read_events(reader, limit=5)) == 5
        else:  # the answer is still being generated: leave in the middle
            deadline = time.monotonic() + 20
            while _stats(stack)["num_running"] == 0:
                assert time.monotonic() < deadline
                await asyncio.sleep(0.05)
            await asyncio.sleep(0.5)
        stats = _stats(stack)
        assert stats["num_running"] == 1 and stats["num_free_blocks"] < stats["num_total_blocks"]
        writer.transport.abort()  # drop the connection, as a client that goes away does

    asyncio.run(run())
    after = _wait_idle(stack, 3)  # heartbeats are 0.5 s apart; the abort itself takes one step
    generated = after["generation_tokens_total"] - before["generation_tokens_total"]
    assert generated < 300, generated  # far from the 1500 asked for: generation stopped at once
    time.sleep(1.0)
    assert _stats(stack)["generation_tokens_total"] == after["generation_tokens_total"]
