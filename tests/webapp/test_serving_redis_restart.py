"""Redis restarts under a running stack (its data lost, as a private redis-server without
persistence): aborts work again at once, an abort issued while Redis was down takes effect once
it is back, requests queued when it went are enqueued again and answered, and no error shows
Redis's address. Real processes (Redis, a Celery worker with the packaged SmolLM2, Daphne)."""
from __future__ import annotations

import asyncio
import json
import time

import pytest

from tests.webapp.raw_http import open_stream, read_events
from tests.webapp.serving_stack import ENGINE_ARGV, MODEL, Stack, http
from webapp import launcher

LONG = {"model": MODEL, "prompt": "Tell me everything about the sea.", "max_tokens": 1900, "ignore_eos": True}


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    s = Stack(tmp_path_factory.mktemp("redis-restart"),
              engine_argv=ENGINE_ARGV + ["--max-num-seqs", "1", "--max-waiting-requests", "1"])
    yield s
    s.stop()


def _port(s: Stack) -> int:
    return int(s.redis_url.rsplit(":", 1)[1].split("/", 1)[0])


def _redis_down(s: Stack) -> None:
    s.redis_child.kill()


def _redis_up(s: Stack) -> None:
    s.redis_child, _ = launcher.start_redis(port=_port(s), log_path=str(s.logs_dir / "redis.log"))


def _wait(condition, timeout: float, what: str) -> float:
    """Seconds until ``condition()`` held (AssertionError after ``timeout``)."""
    start = time.monotonic()
    while not condition():
        assert time.monotonic() - start < timeout, what
        time.sleep(0.1)
    return time.monotonic() - start


def _running(s: Stack) -> int:
    try:
        infos = s.worker_infos()
    except Exception:  # noqa: BLE001 (Redis down)
        return -1
    return infos[0]["stats"]["num_running"] if infos else -1


async def _seconds_to_abort(s: Stack, outage: float) -> float:
    """A long streamed request runs; its client leaves (during a Redis outage of ``outage`` seconds,
    if not 0); seconds from when the client left (or Redis was back) until the worker runs nothing."""
    reader, writer, status = await open_stream(s.base_url, "/v1/completions", dict(LONG, stream=True))
    assert status == 200 and len(await read_events(reader, limit=3)) == 3
    if outage:
        _redis_down(s)
    writer.transport.abort()  # the client leaves
    if outage:
        await asyncio.sleep(outage)
        _redis_up(s)
    since = time.monotonic()
    await asyncio.to_thread(_wait, lambda: _running(s) == 0, 60, "the request was not aborted")
    return time.monotonic() - since


def test_a_client_that_leaves_after_a_restart_aborts_its_request(stack):
    s = stack
    _redis_down(s)
    time.sleep(1.0)
    _redis_up(s)
    _wait(lambda: _running(s) == 0, 30, "the worker did not register again")

    assert asyncio.run(_seconds_to_abort(s, outage=0.0)) < 5


def test_an_abort_issued_while_redis_is_down_takes_effect_when_it_is_back(stack):
    assert asyncio.run(_seconds_to_abort(stack, outage=2.0)) < 10


def test_requests_queued_when_redis_lost_its_data_are_answered(stack):
    """One request runs (``--max-num-seqs 1``), one waits in the engine's backlog, two wait in Redis;
    Redis restarts empty. The running one goes on or ends with an error event, never hangs; the
    others are enqueued again by their web process and answered in full."""
    s = stack
    body = dict(LONG, max_tokens=64)

    async def run() -> list[tuple[int, dict]]:
        calls = [asyncio.ensure_future(asyncio.to_thread(http, "POST", s.base_url + "/v1/completions", body, None,
                                                         300)) for _ in range(4)]
        await asyncio.to_thread(_wait, lambda: s.queued() == 2, 60,
                                "two requests did not wait in Redis")
        _redis_down(s)
        await asyncio.sleep(1.0)
        _redis_up(s)
        return [(status, json.loads(raw)) for status, _, raw in await asyncio.gather(*calls)]

    results = asyncio.run(run())
    done = [body for status, body in results if status == 200]
    assert len(done) >= 3, results
    for reply in done:
        assert reply["usage"]["completion_tokens"] == 64
    for status, reply in results:
        if status != 200:
            assert status == 503 and "127.0.0.1" not in reply["error"]["message"], reply


def test_errors_while_redis_is_down_do_not_show_its_address(stack):
    s = stack
    _redis_down(s)
    try:
        status, _, raw = http("POST", s.base_url + "/v1/completions", dict(LONG, max_tokens=2), None, 60)
        assert status == 503, raw
        message = json.loads(raw)["error"]["message"]
        assert "unreachable" in message and "127.0.0.1" not in message and str(_port(s)) not in message, message
    finally:
        _redis_up(s)


def test_streams_through_a_short_outage_end_complete_or_with_an_error_never_short(stack):
    """Streams run while Redis dies and comes back empty a second later. Each ends either complete
    (all its tokens, the same text as without the outage) or with an error event, never as a
    success with tokens missing (the worker used to drop the outputs it could not publish)."""
    s = stack
    prompts = ["The capital of France is", "Water boils at"]
    body = {"model": MODEL, "max_tokens": 16, "ignore_eos": True, "temperature": 0}
    _wait(lambda: _running(s) == 0, 60, "the worker is not back after the previous test")
    reference = {}
    for prompt in prompts:
        status, _, raw = http("POST", s.base_url + "/v1/completions", dict(body, prompt=prompt), None, 120)
        assert status == 200, raw
        reference[prompt] = json.loads(raw)["choices"][0]["text"]

    async def one(prompt: str) -> tuple[str, str, dict | None, dict | None]:
        streamed = dict(body, prompt=prompt, stream=True, stream_options={"include_usage": True})
        reader, writer, status = await open_stream(s.base_url, "/v1/completions", streamed)
        assert status == 200
        events = await asyncio.wait_for(read_events(reader), 180)
        writer.close()
        assert events[-1] == "[DONE]", events[-3:]
        chunks = [json.loads(e) for e in events[:-1]]
        error = next((c["error"] for c in chunks if "error" in c), None)
        usage = next((c["usage"] for c in chunks if c.get("usage")), None)
        return prompt, "".join(c["choices"][0]["text"] for c in chunks if c.get("choices")), usage, error

    async def run() -> list:
        streams = [asyncio.ensure_future(one(prompts[i % 2])) for i in range(6)]
        await asyncio.sleep(0.5)
        _redis_down(s)
        await asyncio.sleep(1.0)
        _redis_up(s)
        return await asyncio.gather(*streams)

    results = asyncio.run(run())
    for prompt, text, usage, error in results:
        if error is None:
            assert usage["completion_tokens"] == 16 and text == reference[prompt], (prompt, text, usage)
        else:
            assert error["code"] == "service_unavailable" and "127.0.0.1" not in error["message"], error
    assert sum(error is None for _, _, _, error in results) >= 3, results  # most go on unharmed
