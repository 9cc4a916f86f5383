"""The share-aware dequeue on a real redis-server (``webapp.serving.request_queue``), and a worker's
request ledger (``webapp.serving.ledger``): which tenant's request a worker takes next, what that
charges, what a give-back refunds, and what a request's end corrects."""
from __future__ import annotations

import asyncio

import pytest
import redis
import redis.asyncio as aioredis

from inference.sampling_params import RequestOutputKind, SamplingParams
from webapp import launcher
from webapp.serving import held, request_queue
from webapp.serving.ledger import RequestLedger
from webapp.serving.request_queue import ABORTED_BEFORE, CLAIMED, TAKEN, QueuedRequest
from webapp.serving.tenant_shares import encode_share
from webapp.transport import keys
from webapp.transport.keys import SHARES_KEY
from webapp.transport.wire import InvalidParams

MODEL = "m"


@pytest.fixture()
def server(tmp_path):
    child, url = launcher.start_redis(log_path=str(tmp_path / "redis.log"))
    client = redis.Redis.from_url(url)
    client.hset(SHARES_KEY, mapping={"low": encode_share(30, 0), "high": encode_share(70, 0)})
    yield client, url
    child.stop()


def request(rid: str, tenant: str | None, prompt: int = 10, max_tokens: int = 90, n: int = 1) -> QueuedRequest:
    return QueuedRequest(rid, "reply", MODEL, [1] * prompt, SamplingParams(max_tokens=max_tokens, n=n), 0.0, tenant)


def enqueue(url: str, requests: list[QueuedRequest]) -> None:
    async def run() -> None:
        client = aioredis.Redis.from_url(url)
        try:
            await request_queue.enqueue(client, MODEL, requests)
        finally:
            await client.aclose()

    asyncio.run(run())


def take_all(client, count: int, worker: str = "w1") -> list[str]:
    return [request_queue.take(client, MODEL, worker).request.tenant for _ in range(count)]


def test_two_flooding_tenants_are_taken_in_their_shares(server):
    client, url = server
    enqueue(url, [request(f"{t}{i}", t) for i in range(50) for t in ("low", "high")])
    taken = take_all(client, 50)
    assert taken.count("low") == 15  # 30% of the takes, evenly spread
    assert taken[:10].count("low") == 3
    # Each take was claimed for the worker and recorded as held by it, in the same step.
    assert client.hlen(keys.held_key(MODEL)) == 50
    assert client.get("tessera:claim:low0") == b"w1"


def test_a_tenant_alone_takes_everything_and_earns_no_credit_for_it(server):
    client, url = server
    enqueue(url, [request(f"high{i}", "high") for i in range(40)])
    assert take_all(client, 40) == ["high"] * 40  # work-conserving
    # low was idle all along: when both flood now, low gets its 30% from the start, not a burst.
    enqueue(url, [request(f"{t}x{i}", t) for i in range(20) for t in ("low", "high")])
    assert take_all(client, 20).count("low") == 6


def test_the_charge_is_the_prompt_plus_n_times_max_tokens_over_the_share(server):
    client, url = server
    enqueue(url, [request("a", "low", prompt=10, max_tokens=20, n=3)])
    taken = request_queue.take(client, MODEL, "w1")
    assert taken.status == CLAIMED and taken.request.cost == 70
    assert taken.charge == pytest.approx(70 / 30)


def test_a_request_given_back_goes_first_and_is_refunded(server):
    client, url = server
    enqueue(url, [request(f"low{i}", "low") for i in range(3)])
    first = request_queue.take(client, MODEL, "w1")
    before = float(client.hget(keys.fair_key(MODEL), "c:low"))
    record = held.take(client, MODEL, "w1", first.request.rid)
    request_queue.requeue(client, MODEL, record["payload"], "low", record["charge"])
    after = float(client.hget(keys.fair_key(MODEL), "c:low"))
    assert after == pytest.approx(before - first.charge)
    assert request_queue.take(client, MODEL, "w2").request.rid == first.request.rid  # next in line, not last


def test_a_refund_while_both_flood_is_credit_the_tenant_keeps(server):
    """A worker full of one tenant's requests gives one back to take the other's: the refund must
    count. (When the dequeue lifted every counter below the virtual time, such refunds were lost,
    and the 30% tenant got 35-42% on two loaded workers.)"""
    client, url = server
    enqueue(url, [request(f"{t}{i}", t) for i in range(100) for t in ("low", "high")])
    taken = take_all(client, 10)
    for _ in range(30):  # a high request taken earlier is given back, refunded, after later takes
        rid = next(rid for rid in client.hkeys(keys.held_key(MODEL)) if rid.startswith(b"high"))
        taken += take_all(client, 3)
        record = held.take(client, MODEL, "w1", rid.decode())
        request_queue.requeue(client, MODEL, record["payload"], "high", record["charge"])
    taken += take_all(client, 30)
    # The give-backs cost high nothing: of what was taken to run (130 takes, 30 given back), 30% low.
    assert taken.count("low") == 30


def test_aborted_and_already_claimed_requests_are_not_taken_to_run(server):
    client, url = server
    enqueue(url, [request("gone", "low"), request("other", "low")])
    client.set("tessera:claim:gone", "aborted")
    client.set("tessera:claim:other", "w9")
    assert request_queue.take(client, MODEL, "w1").status == ABORTED_BEFORE
    assert request_queue.take(client, MODEL, "w1").status == TAKEN
    assert client.hlen(keys.held_key(MODEL)) == 0 and request_queue.take(client, MODEL, "w1") is None


def test_next_tenant_and_taking_from_one_tenant_only(server):
    client, url = server
    enqueue(url, [request("l", "low"), request("h", "high"), request("none", None)])
    found, tenant = request_queue.next_tenant(client, MODEL)
    assert found and tenant in ("low", "high", None)
    assert request_queue.take(client, MODEL, "w1", "high", only_tenant=True).request.rid == "h"
    assert request_queue.take(client, MODEL, "w1", "high", only_tenant=True) is None


def test_the_ledger_corrects_a_charge_to_what_the_request_used():
    ledger = RequestLedger()
    ledger.open(request("r", "low", prompt=10, max_tokens=90), charge=100 / 30)  # cost 100 tokens
    assert ledger.held(["r", "x"]) == {"r": MODEL}
    ledger.settled("r")
    ledger.on_output("r", num_prompt_tokens=10, num_new_tokens=1)
    assert ledger.next_message("r") == ("reply", 0)
    ledger.on_output("r", num_prompt_tokens=10, num_new_tokens=9)  # stops after 10 of its 90 tokens
    assert ledger.next_message("r") == ("reply", 1)
    ledger.end("r")
    assert ledger.next_message("r") is None  # nothing more goes out
    commands = dict(((m, a[1]), a[2]) for m, a, _ in ledger.counter_commands())
    assert commands[("hincrbyfloat", "c:low")] == pytest.approx((20 - 100) / 30)  # 80 unused tokens back
    assert commands[("hincrby", "served:low")] == 20
    assert ledger.counter_commands() == []


def test_a_held_request_aborted_is_refunded_whole_and_forgotten_once_settled():
    ledger = RequestLedger()
    ledger.open(request("r", "high", prompt=10, max_tokens=60), charge=70 / 70)
    ledger.client_left("r")  # its client left before it started
    assert ledger.next_message("r") is None  # nothing of it goes out
    assert "r" in ledger and ledger.held(["r"])  # its held record still has to go
    ledger.settled("r")
    assert "r" in ledger and ledger.counter_commands() == []  # the engine's count is awaited
    ledger.aborted("r", 0)  # its prefill had not begun
    assert "r" not in ledger
    (command,) = ledger.counter_commands()
    assert command[0] == "hincrbyfloat" and command[1][2] == pytest.approx(-1.0)


def test_a_request_aborted_during_its_prefill_is_charged_its_prompt():
    """A client that leaves before the first token still used the GPU for the prompt the engine computed: its
    tenant's counter keeps those tokens (a flood of abandoned long prompts is not free in the shares)."""
    ledger = RequestLedger()
    ledger.open(request("r", "low", prompt=6000, max_tokens=100), charge=6100 / 30)
    assert ledger.aborted("r", 6000) is None  # not this worker's abort to count: ignored
    assert ledger.client_left("r") and not ledger.client_left("unknown")
    # the engine had computed two chunks of its prompt: the count goes to the request's web process too
    assert ledger.aborted("r", 4096) == "reply"
    ledger.settled("r")
    assert "r" not in ledger
    commands = dict(((m, a[1]), a[2]) for m, a, _ in ledger.counter_commands())
    assert commands[("hincrbyfloat", "c:low")] == pytest.approx((4096 - 6100) / 30)
    assert commands[("hincrby", "served:low")] == 4096


def test_a_request_crosses_the_queue_with_its_sampling_params_intact(server):
    client, url = server
    params = SamplingParams(n=2, max_tokens=7, stop="x", logit_bias={5: 1.5}, seed=2**64 - 1, output_kind=2,
                            stop_token_ids=[3], eos_token_ids=(1, 2), temperature=0.5)
    sent = QueuedRequest("r", "reply", MODEL, [1] * 10, params, 0.0, "low", priority=1, cache_salt="salt")
    enqueue(url, [sent])
    taken = request_queue.take(client, MODEL, "w1")
    assert taken.request == sent and taken.invalid is None
    assert taken.request.params.output_kind is RequestOutputKind.FINAL_ONLY
    assert taken.request.params.eos_token_ids == (1, 2) and taken.request.params.logit_bias == {5: 1.5}
    assert taken.request.cost == 10 + 2 * 7


def test_a_request_whose_params_do_not_decode_is_still_claimed_for_its_400(server):
    """A web process of another version sent sampling parameters this worker cannot build: the
    request is taken and claimed as any other, and carries why, for the dispatcher's 400."""
    client, url = server
    enqueue(url, [request("r", "low", max_tokens=5)])
    message = client.rpop(keys.queue_key(MODEL, "low")).decode()
    client.rpush(keys.queue_key(MODEL, "low"), message.replace('"n":1', '"n":0'))
    taken = request_queue.take(client, MODEL, "w1")
    assert taken.status == CLAIMED and taken.request.rid == "r" and taken.request.reply == "reply"
    assert taken.invalid.param == "n" and "n must be between 1 and 128" in str(taken.invalid.error)
    assert taken.message.startswith("r 15\n")
    with pytest.raises(InvalidParams):
        QueuedRequest.decode(taken.message)
    with pytest.raises(ValueError, match="not a queued request"):
        QueuedRequest.decode("r 1\n[1]")


def test_queued_requests_count_as_waiting_in_metrics(server):
    """Requests no worker has taken yet are waiting too: ``vllm:num_requests_waiting`` adds them to the workers'
    own backlogs, per model and over every tenant's queue."""
    from prometheus_client.parser import text_string_to_metric_families

    from webapp import metrics

    client, url = server
    enqueue(url, [request(f"{t}{i}", t) for i in range(5) for t in ("low", "high", None)])
    take_all(client, 4)

    async def counts() -> dict[str, int]:
        aio = aioredis.Redis.from_url(url)
        try:
            return await request_queue.queued_counts(aio, [MODEL, "other"])
        finally:
            await aio.aclose()

    queued = asyncio.run(counts())
    assert queued == {MODEL: 11, "other": 0}
    worker = {"id": "w1", "model": MODEL, "stats": {"num_running": 2, "num_waiting": 2}}
    text = metrics.render([worker], {MODEL: {}}, (), queued).decode()
    waiting = {s.labels["model_name"]: s.value for family in text_string_to_metric_families(text)
               for s in family.samples if s.name == "vllm:num_requests_waiting"}
    assert waiting == {MODEL: 13}
