"""Daphne stopping with requests in flight: a stream ends with an error event and [DONE], a
non-streamed request gets a 503, and their engine requests are aborted."""
from __future__ import annotations

import asyncio
import json
import time

import pytest

from tests.webapp.raw_http import open_stream, read_events
from tests.webapp.serving_stack import MODEL, Stack, http

LONG = {"model": MODEL, "prompt": "Tell me everything about the sea.", "max_tokens": 1500, "ignore_eos": True}


@pytest.fixture(scope="module")
def own_stack(tmp_path_factory):
    s = Stack(tmp_path_factory.mktemp("shutdown"))
    yield s
    s.stop()


def test_server_shutdown_ends_streams_with_an_error_event_and_aborts(own_stack):
    s = own_stack

    async def run() -> tuple[list[str], tuple]:
        reader, writer, status = await open_stream(s.base_url, "/v1/completions", dict(LONG, stream=True))
        assert status == 200 and len(await read_events(reader, limit=3)) == 3
        non_stream = asyncio.ensure_future(asyncio.to_thread(
            http, "POST", s.base_url + "/v1/completions", LONG, None, 60))
        deadline = time.monotonic() + 20
        while sum(w["stats"]["num_running"] for w in s.worker_infos()) < 2:  # both in the engine
            assert time.monotonic() < deadline
            await asyncio.sleep(0.05)
        stopping = asyncio.ensure_future(asyncio.to_thread(s.daphne.stop))  # SIGTERM
        events = await asyncio.wait_for(read_events(reader), 15)
        writer.close()
        result = await asyncio.wait_for(non_stream, 15)
        assert await stopping == 0  # Daphne exits cleanly, within its grace
        return events, result

    events, (status, headers, body) = asyncio.run(run())
    assert events[-1] == "[DONE]", events[-3:]
    error = json.loads(events[-2])["error"]
    assert error["code"] == "service_unavailable" and "shutting down" in error["message"], error
    assert status == 503 and "shutting down" in json.loads(body)["error"]["message"], body

    deadline = time.monotonic() + 5  # the worker goes idle: both engine requests were aborted
    while (stats := s.worker_infos()[0]["stats"])["num_running"] or stats["num_free_blocks"] != stats["num_total_blocks"]:
        assert time.monotonic() < deadline, stats
        time.sleep(0.1)
