"""Scheduling policies: admission order and preemption victims (scheduler and KV manager on CPU,
no model), and priorities through the engine on SmolLM2."""
from __future__ import annotations

import pytest

from inference import LLM, InvalidRequestError, SamplingParams
from inference.config import SchedulerConfig
from inference.kv_cache import KVCacheManager
from inference.request import Request, RequestStatus
from inference.sched.scheduler import Scheduler

from .model_free import update


def make_scheduler(policy: str, num_blocks: int, block_size: int = 4, max_num_seqs: int = 8) -> Scheduler:
    config = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=64, max_model_len=64,
                             scheduling_policy=policy)
    return Scheduler(config, KVCacheManager(num_blocks, block_size))


def add(scheduler: Scheduler, rid: str, priority: int, arrival: float, num_prompt: int = 4,
        max_tokens: int = 2) -> Request:
    request = Request(rid, rid, 0, list(range(10, 10 + num_prompt)), SamplingParams(max_tokens=max_tokens),
                      max_tokens, arrival_time=arrival, priority=priority)
    scheduler.add_request(request)
    return request


def step(scheduler: Scheduler):
    """One engine step without a model: every sampling request gets token 1."""
    out = scheduler.schedule()
    update(scheduler, out, token_id=1)  # appends, and finishes the requests at max_tokens
    return out


def admission_order(policy: str) -> list[str]:
    scheduler = make_scheduler(policy, num_blocks=16, max_num_seqs=1)
    for rid, priority, arrival in (("a", 5, 0.0), ("b", 1, 1.0), ("c", 1, 2.0), ("d", 0, 3.0)):
        add(scheduler, rid, priority, arrival)
    order = []
    while scheduler.num_unfinished:
        for item in step(scheduler).scheduled:
            if item.request.request_id not in order:
                order.append(item.request.request_id)
    return order


def test_waiting_queue_order_follows_the_policy():
    assert admission_order("fcfs") == ["a", "b", "c", "d"]
    assert admission_order("priority") == ["d", "b", "c", "a"]  # lower first, ties by arrival


@pytest.mark.parametrize("policy, victim", [("fcfs", "c"), ("priority", "b")])
def test_preemption_takes_the_newest_or_the_lowest_priority(policy, victim):
    scheduler = make_scheduler(policy, num_blocks=4)  # three 1-block prompts, then one block to spare
    for rid, priority, arrival in (("a", 0, 0.0), ("b", 2, 1.0), ("c", 1, 2.0)):
        add(scheduler, rid, priority, arrival, max_tokens=4)
    first = step(scheduler)
    assert sorted(i.request.request_id for i in first.scheduled) == ["a", "b", "c"]
    second = step(scheduler)  # each decode needs a second block: one is free
    assert second.preempted_ids == [victim]
    preempted = scheduler.requests[victim]
    assert preempted.status == RequestStatus.PREEMPTED and preempted.block_ids == []
    assert preempted.num_computed_tokens == 0 and scheduler.kv.num_free_blocks == 0
    while scheduler.num_unfinished:
        step(scheduler)
    assert scheduler.kv.num_free_blocks == 4


def test_preempted_request_keeps_its_place_by_priority():
    scheduler = make_scheduler("priority", num_blocks=4)
    for rid, priority, arrival in (("a", 0, 0.0), ("b", 2, 1.0), ("c", 1, 2.0)):
        add(scheduler, rid, priority, arrival, max_tokens=4)
    step(scheduler)
    step(scheduler)  # b preempted
    late = add(scheduler, "late", 3, 10.0)
    assert scheduler.waiting.peek().request_id == "b"  # b (priority 2) before late (priority 3)
    assert late in scheduler.waiting


def test_unknown_policy_is_refused():
    with pytest.raises(InvalidRequestError) as info:
        make_scheduler("lottery", num_blocks=4)
    assert info.value.param == "scheduling_policy"


@pytest.fixture(scope="module")
def priority_llm():
    return LLM(max_model_len=256, kv_cache_space=0.1, max_num_seqs=1, scheduling_policy="priority")


@pytest.mark.timeout(600)
def test_engine_serves_lower_priority_values_first(priority_llm, test_prompts):
    engine = priority_llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    prompts = {"low": test_prompts[0], "mid": test_prompts[1], "high": test_prompts[2], "mid2": test_prompts[3]}
    for rid, priority in (("low", 9), ("mid", 5), ("high", -3), ("mid2", 5)):
        engine.add_request(rid, prompts[rid], params, arrival_time=0.0, priority=priority)
    finished, tokens = [], {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.outputs[0].token_ids)
            if out.finished:
                finished.append(out.request_id)
    assert finished == ["high", "mid", "mid2", "low"]
    fcfs = LLM(max_model_len=256, kv_cache_space=0.1)
    expected = fcfs.generate(prompt_token_ids=list(prompts.values()), sampling_params=params, use_tqdm=False)
    assert [tokens[r] for r in prompts] == [o.outputs[0].token_ids for o in expected]
    with pytest.raises(InvalidRequestError) as info:
        fcfs.generate(prompt_token_ids=[test_prompts[0]], sampling_params=params, priority=[1], use_tqdm=False)
    assert info.value.param == "priority" and "priority scheduling is not enabled" in str(info.value)
    assert not fcfs.llm_engine.has_unfinished_requests()
