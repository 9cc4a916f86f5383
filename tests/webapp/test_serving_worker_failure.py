"""A worker killed mid-request: its clients get an error within 10 s, and the server answers
again once a worker is back."""
from __future__ import annotations

import asyncio
import json
import time

import pytest

from tests.webapp.raw_http import open_stream, read_events
from tests.webapp.serving_stack import MODEL, Stack, http, metric_value, metrics_text

LONG = {"model": MODEL, "prompt": "Tell me everything about the sea.", "max_tokens": 1500, "ignore_eos": True}


@pytest.fixture(scope="module")
def own_stack(tmp_path_factory):
    s = Stack(tmp_path_factory.mktemp("failure"))
    yield s
    s.stop()


def _wait_both_started(s, timeout: float = 60) -> None:
    """Until both requests run in the engine and have published output (a request the worker holds
    but has not answered yet is requeued when it dies, not failed: see ``webapp.serving.held``)."""
    deadline = time.monotonic() + timeout
    while True:
        (info,) = s.worker_infos()
        if info["stats"]["num_running"] == 2 and not s.redis.hlen(f"tessera:held:{MODEL}"):
            return
        assert time.monotonic() < deadline, info["stats"]
        time.sleep(0.05)


def test_killed_worker_gives_errors_not_hangs_then_recovers(own_stack):
    s = own_stack

    async def run() -> tuple[float, list[str], float, tuple]:
        reader, writer, status = await open_stream(s.base_url, "/v1/completions", dict(LONG, stream=True))
        assert status == 200 and len(await read_events(reader, limit=3)) == 3
        non_stream = asyncio.ensure_future(asyncio.to_thread(
            http, "POST", s.base_url + "/v1/completions", LONG, None, 60))
        await asyncio.to_thread(_wait_both_started, s)
        s.workers[0].kill()
        killed = time.monotonic()
        events = await asyncio.wait_for(read_events(reader), 15)
        stream_error_after = time.monotonic() - killed
        result = await asyncio.wait_for(non_stream, 15)
        return stream_error_after, events, time.monotonic() - killed, result

    stream_after, events, non_stream_after, (status, _, body) = asyncio.run(run())
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["code"] == "service_unavailable" and "retry" in error["message"]
    assert stream_after < 10, stream_after
    assert status == 503 and "error" in json.loads(body) and non_stream_after < 10

    # No worker at all: an immediate 503, and /health says so.
    assert http("GET", s.base_url + "/health")[0] == 503
    assert http("POST", s.base_url + "/v1/completions", dict(LONG, max_tokens=2))[0] == 503

    s.add_worker()
    s.wait_live()
    reply = s.openai().completions.create(model=MODEL, prompt="Hello", max_tokens=4, temperature=0)
    assert reply.usage.completion_tokens == 4


@pytest.fixture(scope="module")
def two_workers(tmp_path_factory):
    """Two workers that each run one request and keep one more waiting in their engine, so the
    rest wait in Redis."""
    s = Stack(tmp_path_factory.mktemp("two-workers"), num_workers=2,
              engine_argv=[MODEL, "--max-model-len", "2048", "--kv-cache-space", "0.25", "--max-num-seqs", "1",
                           "--max-waiting-requests", "1"],
              OMP_NUM_THREADS="1")  # two engines on a small CPU: OpenMP threads spinning against each other cost 10x
    deadline = time.monotonic() + 300
    while sum(bool(w.get("live")) for w in s.worker_infos()) < 2:  # both registered and serving
        assert time.monotonic() < deadline
        time.sleep(0.2)
    yield s
    s.stop()


def test_requests_not_started_go_to_the_surviving_worker(two_workers):
    s = two_workers
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 96, "ignore_eos": True, "temperature": 0}
    held_key = f"tessera:held:{MODEL}"

    async def run() -> tuple[list[tuple[int, bytes]], float]:
        requests = [asyncio.ensure_future(asyncio.to_thread(http, "POST", s.base_url + "/v1/completions", body,
                                                             None, 300)) for _ in range(6)]
        deadline = time.monotonic() + 60
        # Each worker takes two: one running and one waiting in its engine's backlog (a worker
        # takes a request only when its engine has a place, so the rest stay in Redis for either
        # worker). The one not started is recorded as held by the worker.
        while not ([(w["stats"]["num_running"], w["stats"]["num_waiting"]) for w in s.worker_infos()] == [(1, 1)] * 2
                   and s.redis.hlen(held_key) == 2 and s.queued() == 2):
            assert time.monotonic() < deadline, (s.worker_infos(), s.redis.hgetall(held_key))
            await asyncio.sleep(0.05)
        holders = sorted(json.loads(r)["worker"] for r in s.redis.hvals(held_key))
        assert holders == sorted(w["id"] for w in s.worker_infos())
        # /metrics counts the backlogs and the two requests still queued in Redis as waiting.
        assert metric_value(metrics_text(s.base_url), "vllm:num_requests_waiting{") == 4
        victim = next(w["id"] for w in s.worker_infos() if w["pid"] == s.workers[0].pid)
        s.workers[0].kill()
        killed = time.monotonic()
        # The survivor puts the dead worker's request not started back on the queue within
        # seconds, and its client keeps waiting for it instead of failing.
        while any(json.loads(r)["worker"] == victim for r in s.redis.hvals(held_key)):
            assert time.monotonic() < killed + 10, "the dead worker's held requests were not taken over"
            await asyncio.sleep(0.1)
        taken_over_after = time.monotonic() - killed
        return [(status, raw) for status, _, raw in await asyncio.gather(*requests)], taken_over_after

    results, taken_over_after = asyncio.run(run())
    assert taken_over_after < 10
    statuses = sorted(status for status, _ in results)
    # The killed worker's running request fails; the other five (the survivor's two, the dead
    # worker's backlogged one and the two still queued) complete on the survivor.
    assert statuses == [200] * 5 + [503], results
    for status, raw in results:
        if status == 200:
            assert json.loads(raw)["usage"]["completion_tokens"] == 96
    assert s.redis.hlen(held_key) == 0


def test_requests_not_started_wait_for_a_restarted_worker(tmp_path_factory):
    """The only worker dies: its running request fails at once, the ones it had not started are
    served by the worker that replaces it (as ``serve`` restarts it), not answered 503."""
    s = Stack(tmp_path_factory.mktemp("restart"),
              engine_argv=[MODEL, "--max-model-len", "2048", "--kv-cache-space", "0.25", "--max-num-seqs", "1",
                           "--max-waiting-requests", "2"])
    try:
        body = dict(LONG, max_tokens=400)
        calls = [asyncio.to_thread(http, "POST", s.base_url + "/v1/completions", body, None, 600) for _ in range(3)]

        async def run():
            tasks = [asyncio.ensure_future(c) for c in calls]
            deadline = time.monotonic() + 120
            while not (s.worker_infos() and s.worker_infos()[0].get("stats", {}).get("num_waiting", 0) >= 2):
                assert time.monotonic() < deadline, s.worker_infos()
                await asyncio.sleep(0.2)
            s.workers[0].kill()
            await asyncio.sleep(6)  # past the heartbeat: the web sees no worker of the model for a while
            s.add_worker()
            return await asyncio.gather(*tasks)

        statuses = sorted(status for status, _, _ in asyncio.run(run()))
        assert statuses == [200, 200, 503], statuses
    finally:
        s.stop()


def test_requests_whose_clients_left_are_not_rerun_after_their_worker_died(tmp_path_factory):
    """The only worker dies holding requests it had not started, and their clients leave: the worker
    that replaces it does not run them (nobody would read the answers)."""
    s = Stack(tmp_path_factory.mktemp("left"),
              engine_argv=[MODEL, "--max-model-len", "2048", "--kv-cache-space", "0.25", "--max-num-seqs", "1",
                           "--max-waiting-requests", "2"])
    held_key = f"tessera:held:{MODEL}"
    try:
        async def run() -> None:
            streams = [await open_stream(s.base_url, "/v1/completions", dict(LONG, max_tokens=400, stream=True),
                                         read_head=False) for _ in range(3)]
            deadline = time.monotonic() + 120
            while not (s.worker_infos() and s.worker_infos()[0]["stats"].get("num_waiting", 0) >= 2):
                assert time.monotonic() < deadline, s.worker_infos()
                await asyncio.sleep(0.2)
            assert s.redis.hlen(held_key) == 2  # the two waiting in its engine are held, unstarted
            s.workers[0].kill()
            for _, writer, _ in streams:
                writer.transport.abort()

        asyncio.run(run())
        time.sleep(6)  # past the heartbeat: the dead worker's records are now orphans
        s.add_worker()
        s.wait_live()
        time.sleep(4)  # several reclaim rounds of the new worker
        (info,) = s.worker_infos()
        stats = info["stats"]
        assert stats["num_running"] == 0 and stats["num_waiting"] == 0 and stats["generation_tokens_total"] == 0, stats
        assert s.redis.hlen(held_key) == 0
        reply = s.openai().completions.create(model=MODEL, prompt="Hello", max_tokens=4, temperature=0)
        assert reply.usage.completion_tokens == 4  # and it serves new requests
    finally:
        s.stop()


def test_requests_sent_as_the_only_worker_dies_are_answered_not_dropped(tmp_path_factory):
    """Streamed requests sent right as the only worker is SIGKILLed (``serve`` restarts it): each one
    ends, with its answer from the new worker or with an error event; none waits for ever. (A
    worker used to take a request off the queue before recording it anywhere, so a kill at that
    moment lost it: its client got its first chunk and then nothing.)"""
    s = Stack(tmp_path_factory.mktemp("kill-race"))
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 8, "ignore_eos": True, "stream": True}
    try:
        for delay in (0.0, 0.03, 0.1):
            async def run() -> list[list[str]]:
                streams = [asyncio.ensure_future(open_stream(s.base_url, "/v1/completions", body)) for _ in range(3)]
                await asyncio.sleep(delay)
                s.workers[-1].kill()
                s.add_worker()  # as serve restarts it
                ends = []
                for opened in streams:
                    reader, writer, status = await opened
                    assert status == 200
                    ends.append(await asyncio.wait_for(read_events(reader), 180))
                    writer.close()
                return ends

            for events in asyncio.run(run()):
                assert events and events[-1] == "[DONE]", (delay, events)
                last = json.loads(events[-2])
                assert "error" in last or last["choices"][0]["finish_reason"] == "length", (delay, last)
            s.wait_live()
    finally:
        s.stop()
