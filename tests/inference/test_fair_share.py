"""Tenant GPU shares: the virtual token counters (exact orders and victims), and the real
scheduler and KV cache manager driven step by step with tenants flooding it.

The scheduler tests drive ``Scheduler`` exactly as ``LLMEngine.step`` does (schedule,
update, then one sampled token per sampling request); token values do not matter to
scheduling, so no model runs here (``test_fair_share_engine.py`` runs the real SmolLM2).
"""
from __future__ import annotations

import itertools
from collections import Counter

import pytest

from inference.config import SchedulerConfig
from inference.kv_cache import KVCacheManager
from inference.request import Request
from inference.sampling_params import SamplingParams
from inference.sched.fair_share import MIN_SHARE, FairShare
from inference.sched.scheduler import Scheduler

from .model_free import update

_ids = itertools.count()


def make_request(tenant: str | None, prompt_len: int = 10, max_tokens: int = 8, arrival: float | None = None,
                 priority: int = 0) -> Request:
    rid = f"{tenant}-{next(_ids)}"
    arrival = float(next(_ids)) if arrival is None else arrival
    return Request(rid, rid, 0, [1] * prompt_len, SamplingParams(max_tokens=max_tokens), max_tokens,
                   arrival_time=arrival, priority=priority, tenant_id=tenant)


# ---- FairShare alone ---------------------------------------------------------------------
def test_order_interleaves_by_share_on_tentative_counters():
    fair = FairShare({"a": 30, "b": 70})
    a = [make_request("a") for _ in range(3)]
    b = [make_request("b") for _ in range(3)]
    order = fair.order_waiting(a + b)
    # Each may compute 18 tokens (10 prompt + 8 max_tokens). Tentative counters: a1 (a: 18/30 = 0.6),
    # b1 (b: 18/70 = 0.26), b2 (0.51), b3 (0.77; 0.51 was still below a's 0.6), then a2, a3.
    assert order == [a[0], b[0], b[1], b[2], a[1], a[2]]


def test_order_puts_the_tenant_furthest_below_its_share_first():
    fair = FairShare({"a": 50, "b": 50})
    a, b = make_request("a"), make_request("b")
    fair.observe([a, b], [])
    fair.charge("a", 100)  # a: 2.0, b: 0.0
    assert fair.order_waiting([a, b]) == [b, a]
    fair.charge("b", 150)  # b: 3.0
    assert fair.order_waiting([a, b]) == [a, b]


def test_priority_orders_within_a_tenant_not_between_tenants():
    fair = FairShare({"a": 50, "b": 50})
    a_low, a_high = make_request("a", priority=5), make_request("a", priority=-1)
    b_any = make_request("b", priority=9)
    fair.observe([a_low, a_high, b_any], [])
    fair.charge("a", 500)  # a is far above b: b first whatever the priorities
    assert fair.order_waiting([a_low, a_high, b_any]) == [b_any, a_high, a_low]


def test_single_tenant_order_is_left_alone():
    fair = FairShare({"a": 30})
    requests = [make_request("a", priority=p) for p in (3, 1, 2)]
    assert fair.order_waiting(requests) == requests


def test_limit_orders_only_the_first_places():
    fair = FairShare({"a": 50, "b": 50})
    a = [make_request("a") for _ in range(3)]
    b = [make_request("b") for _ in range(3)]
    assert fair.order_waiting(a + b, limit=2) == [a[0], b[0], a[1], a[2], b[1], b[2]]


def test_newcomer_is_lifted_to_the_lowest_active_counter():
    fair = FairShare({"a": 50, "b": 50, "c": 50})
    a, b = make_request("a"), make_request("b")
    fair.observe([a, b], [])
    fair.charge("a", 1000)  # 20.0
    fair.charge("b", 500)  # 10.0
    c = make_request("c")
    fair.observe([a, b, c], [])
    assert fair.counters["c"] == 10.0  # no credit for the time it was not there
    assert fair.virtual_time == 10.0


def test_tenant_returning_from_idle_gets_no_credit():
    fair = FairShare({"a": 50, "b": 50})
    a, b = make_request("a"), make_request("b")
    fair.observe([a, b], [])
    fair.charge("b", 100)  # b: 2.0 while a waits
    fair.observe([], [b])  # a left (its request finished)
    fair.charge("b", 400)  # b: 10.0
    fair.observe([], [b])
    a2 = make_request("a")
    fair.observe([a2], [b])
    assert fair.counters["a"] == 10.0


def test_weights_floor_and_validation():
    fair = FairShare({"a": 0, "b": 30})
    assert fair.weight("a") == MIN_SHARE == fair.weight("unknown")
    assert fair.weight("b") == 30
    with pytest.raises(ValueError, match="share of tenant 'x'"):
        fair.set_shares({"x": -1})
    with pytest.raises(ValueError):
        fair.set_shares({"x": float("nan")})


def test_victim_comes_from_the_tenant_most_above_its_share():
    fair = FairShare({"a": 30, "b": 70})
    running = [make_request("a"), make_request("b"), make_request("a"), make_request("b")]
    for r in running:
        r.num_computed_tokens = 99  # a holds 200 tokens on a share of 30, b 200 on 70
    assert fair.pick_victim(running) is running[2]  # a's most recently admitted
    assert fair.pick_victim(running, start=3) is running[3]  # only b's last one may go
    fair.set_shares({"a": 70, "b": 30})
    assert fair.pick_victim(running) is running[3]


def test_victim_within_a_tenant_by_priority_then_recency():
    fair = FairShare()
    running = [make_request("a", priority=0), make_request("a", priority=2), make_request("a", priority=0)]
    assert fair.pick_victim(running) is running[1]
    running[1].priority = 0
    assert fair.pick_victim(running) is running[2]  # the plain policy: the newest


# ---- the real scheduler, driven as the engine drives it --------------------------------------
def make_scheduler(num_blocks: int = 512, max_num_seqs: int = 8, max_num_batched_tokens: int = 64) -> Scheduler:
    config = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                             max_model_len=512, enable_chunked_prefill=True)
    return Scheduler(config, KVCacheManager(num_blocks, 16))


def step(scheduler: Scheduler) -> Counter:
    """One engine step without the model: tokens computed per tenant in it.

    Asserts that the step was work-conserving: its token budget is used up, or it runs
    ``max_num_seqs`` requests, or nothing is left waiting.
    """
    out = scheduler.schedule()
    config = scheduler.config
    assert (out.total_num_scheduled_tokens == config.max_num_batched_tokens or out.preempted_ids
            or len(out.scheduled) == config.max_num_seqs or not scheduler.waiting)
    update(scheduler, out, token_id=7)  # appends, and finishes the requests at max_tokens
    served: Counter = Counter()
    for item in out.scheduled:
        served[item.request.tenant_id] += item.num_scheduled_tokens
    return served


def flood(scheduler: Scheduler, tenants: list[str], backlog: int = 12, **shape) -> None:
    """Keep ``backlog`` requests of each tenant waiting (identical workloads)."""
    waiting = Counter(r.tenant_id for r in scheduler.waiting)
    for tenant in tenants:
        for _ in range(backlog - waiting[tenant]):
            scheduler.add_request(make_request(tenant, **shape))


def served_split(scheduler: Scheduler, tenants: list[str], steps: int, warmup: int = 0, **shape) -> Counter:
    total: Counter = Counter()
    for i in range(warmup + steps):
        flood(scheduler, tenants, **shape)
        served = step(scheduler)
        if i >= warmup:
            total.update(served)
    return total


@pytest.mark.parametrize("shape", [
    dict(prompt_len=24, max_tokens=16),  # mixed prefill and decode
    dict(prompt_len=100, max_tokens=40),  # prefills chunked over steps
    dict(prompt_len=8, max_tokens=200),  # long decodes: slots free up all at once
    dict(prompt_len=300, max_tokens=5),  # prefill-bound
])
def test_two_backlogged_tenants_split_tokens_30_70(shape):
    scheduler = make_scheduler()
    scheduler.fair_share = FairShare({"team1": 30, "team2": 70})
    served = served_split(scheduler, ["team1", "team2"], steps=1500, warmup=50, **shape)
    share = served["team1"] / (served["team1"] + served["team2"])
    assert abs(share - 0.30) <= 0.03, served


def test_without_shares_the_same_flood_splits_evenly():
    """The 30/70 split above comes from the shares: without them, arrival order alternates."""
    scheduler = make_scheduler()
    served = served_split(scheduler, ["team1", "team2"], steps=600, warmup=50, prompt_len=24, max_tokens=16)
    assert abs(served["team1"] / sum(served.values()) - 0.5) <= 0.05, served


def test_a_tenant_alone_gets_the_whole_budget_step_for_step():
    def run(shares) -> list[Counter]:
        global _ids
        _ids = itertools.count()  # same request ids and arrival times in both runs
        scheduler = make_scheduler()
        if shares is not None:
            scheduler.fair_share = FairShare(shares)
        steps = []
        for _ in range(300):
            flood(scheduler, ["team1"], prompt_len=40, max_tokens=20)
            steps.append(step(scheduler))
        return steps

    with_shares, without = run({"team1": 30, "team2": 70}), run(None)
    assert with_shares == without  # its 30% share does not hold it back (every step is work-conserving)


def test_late_tenant_is_served_at_once_but_gets_no_burst():
    scheduler = make_scheduler()
    scheduler.fair_share = FairShare({"a": 33, "b": 33, "c": 33})
    served_split(scheduler, ["a", "b"], steps=300, prompt_len=24, max_tokens=16)
    admission_rounds = 0
    first_token_round = None
    window: Counter = Counter()
    for _ in range(150):
        flood(scheduler, ["a", "b", "c"], prompt_len=24, max_tokens=16)
        before = {r.request_id for r in scheduler.running}
        served = step(scheduler)
        admitted = [r for r in scheduler.running if r.request_id not in before]
        if admitted and first_token_round is None:
            admission_rounds += 1
            if any(r.tenant_id == "c" for r in admitted):
                first_token_round = admission_rounds
        window.update(served)
    assert first_token_round is not None and first_token_round <= 2
    # Lifted to the others' counters, c gets its third, not the whole engine while it "catches up".
    assert window["c"] / sum(window.values()) <= 1 / 3 + 0.05, window


def test_a_tenant_served_alone_owes_nothing_when_the_others_return():
    """Both tenants run requests, nothing waits; team2's end soon, team1's run on alone for long
    (the work conserved for it, team2 wanting none); then both flood again. The split is 30/70
    from the start, not team2 "catching up" on the tokens team1 got while team2 was idle (through
    the serving stack, a flood with random lengths measured 6/94 after such a tail)."""
    scheduler = make_scheduler(max_num_batched_tokens=512)
    scheduler.fair_share = FairShare({"team1": 30, "team2": 70})
    served_split(scheduler, ["team1", "team2"], steps=100, prompt_len=24, max_tokens=16)
    while scheduler.waiting or scheduler.running:  # both stop sending; what runs finishes
        step(scheduler)
    for _ in range(4):
        scheduler.add_request(make_request("team1", prompt_len=8, max_tokens=300))
        scheduler.add_request(make_request("team2", prompt_len=8, max_tokens=4))
    while scheduler.running or scheduler.waiting:  # all eight start; team1's go on alone
        step(scheduler)
    served = served_split(scheduler, ["team1", "team2"], steps=150, prompt_len=24, max_tokens=16)
    assert abs(served["team1"] / sum(served.values()) - 0.30) <= 0.05, served


@pytest.mark.parametrize("with_shares", [True, False])
def test_preemption_takes_from_the_tenant_above_its_share(with_shares):
    # "small" (20%) fills the engine before "big" (80%) arrives; then the pool runs out as
    # they decode. With shares the victims are small's; the plain policy takes the newest (big's).
    scheduler = make_scheduler(num_blocks=16, max_num_seqs=8, max_num_batched_tokens=256)
    if with_shares:
        scheduler.fair_share = FairShare({"small": 20, "big": 80})
    for _ in range(6):
        scheduler.add_request(make_request("small", prompt_len=30, max_tokens=60))
    step(scheduler)
    for _ in range(2):
        scheduler.add_request(make_request("big", prompt_len=30, max_tokens=60))
    victims: Counter = Counter()
    for _ in range(10):
        out = scheduler.schedule()
        victims.update(rid.split("-")[0] for rid in out.preempted_ids)
        update(scheduler, out, token_id=7)
    if with_shares:
        assert victims["small"] > 0 and victims["big"] == 0, victims
    else:
        assert victims["big"] > 0, victims


def test_running_order_puts_tenants_above_their_share_last():
    fair = FairShare({"a": 30, "b": 70})
    a1, b1, a2, b2 = make_request("a"), make_request("b"), make_request("a"), make_request("b")
    for r in (a1, b1, a2, b2):
        r.num_computed_tokens = 49  # each tenant holds 100 tokens: a 3.3 per share point, b 1.4
    assert fair.order_running([a1, b1, a2, b2]) == [b1, b2, a1, a2]
    single = [make_request("a"), make_request("a")]
    assert fair.order_running(single) == single
