"""Swap preemption: a preempted request's blocks go to the CPU swap space and come back; the KV
manager's bookkeeping with exact block ids on CPU, and the same tokens as recompute on SmolLM2."""
from __future__ import annotations

import pytest

from inference import LLM, InvalidRequestError, SamplingParams
from inference.config import SchedulerConfig
from inference.kv_cache import KVCacheManager
from inference.request import Request, RequestStatus
from inference.sched.scheduler import Scheduler

from .model_free import update


def make_request(rid: str, num_tokens: int, max_tokens: int = 8) -> Request:
    return Request(rid, rid, 0, list(range(10, 10 + num_tokens)), SamplingParams(max_tokens=max_tokens), max_tokens)


def computed(kv: KVCacheManager, rid: str, num_tokens: int) -> Request:
    request = make_request(rid, num_tokens)
    assert kv.allocate_slots(request, num_tokens)
    request.num_computed_tokens = num_tokens
    return request


def test_swap_out_and_in_move_blocks_between_pools():
    kv = KVCacheManager(num_blocks=6, block_size=4, num_cpu_blocks=3)
    a = computed(kv, "a", 6)
    assert a.block_ids == [0, 1]
    assert kv.swap_out(a)
    assert a.block_ids == [] and a.cpu_block_ids == [0, 1] and a.num_computed_tokens == 6 and a.is_swapped
    assert kv.take_block_ops().swap_out == [(0, 0), (1, 1)]
    assert (kv.num_free_blocks, kv.num_free_cpu_blocks, kv.num_swapped) == (6, 1, 1)
    assert kv.cpu_usage == pytest.approx(2 / 3)
    b = computed(kv, "b", 6)
    assert b.block_ids == [2, 3]
    assert not kv.swap_out(b)  # two blocks, one free in the swap space: b stays as it is
    assert b.block_ids == [2, 3] and b.cpu_block_ids == [] and kv.take_block_ops().swap_out == []
    assert kv.swap_in(a, 1)  # its 2 blocks back, and room for token 7 (still in block 2)
    assert a.block_ids == [4, 5] and a.cpu_block_ids == []
    assert kv.take_block_ops().swap_in == [(0, 4), (1, 5)]
    assert (kv.num_free_blocks, kv.num_free_cpu_blocks, kv.num_swapped, kv.num_swapped_out_total) == (2, 3, 0, 1)


def test_swap_out_keeps_only_computed_blocks():
    kv = KVCacheManager(num_blocks=6, block_size=4, num_cpu_blocks=4)
    r = make_request("r", 12)
    assert kv.allocate_slots(r, 12)  # a 12-token chunk scheduled, 5 tokens computed so far
    r.num_computed_tokens = 5
    assert kv.swap_out(r)
    assert r.cpu_block_ids == [0, 1] and kv.take_block_ops().swap_out == [(0, 0), (1, 1)]
    assert kv.num_free_blocks == 6
    assert kv.swap_in(r, 7)
    assert len(r.block_ids) == 3 and kv.take_block_ops().swap_in == list(zip([0, 1], r.block_ids[:2]))


def test_swapped_request_freed_returns_its_cpu_blocks_and_no_swap_in_after_swap_out():
    kv = KVCacheManager(num_blocks=6, block_size=4, num_cpu_blocks=4)
    a, b = computed(kv, "a", 4), computed(kv, "b", 4)
    assert kv.swap_out(a)
    kv.take_block_ops()
    assert kv.swap_out(b)
    with pytest.raises(RuntimeError, match="one step"):
        kv.swap_in(a, 1)
    kv.free(a)  # aborted while swapped out
    kv.free(b)
    assert (kv.num_free_blocks, kv.num_free_cpu_blocks, kv.num_swapped) == (6, 4, 0)


def test_without_swap_space_nothing_swaps():
    kv = KVCacheManager(num_blocks=4, block_size=4)
    a = computed(kv, "a", 4)
    assert not kv.swap_out(a) and a.block_ids == [0]
    assert (kv.num_cpu_blocks, kv.cpu_usage) == (0, 0.0)


def test_scheduler_swaps_the_victim_out_and_back_in():
    config = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64, preemption_mode="swap")
    scheduler = Scheduler(config, KVCacheManager(4, 4, num_cpu_blocks=4))
    requests = [make_request(rid, 4, max_tokens=3) for rid in "abc"]
    for r in requests:
        scheduler.add_request(r)
    finished = []
    swap_outs, swap_ins = [], []
    while scheduler.num_unfinished:
        out = scheduler.schedule()
        swap_outs += out.blocks_to_swap_out
        swap_ins += out.blocks_to_swap_in
        if out.preempted_ids:
            assert out.preempted_ids == ["c"] and requests[2].is_swapped
            assert requests[2].num_computed_tokens == 4 and requests[2].status == RequestStatus.PREEMPTED
        for record in update(scheduler, out, token_id=1).sampled:  # finishes the requests at max_tokens
            if record.status is RequestStatus.FINISHED_LENGTH:
                finished.append(record.request.request_id)
    assert swap_outs == [(2, 0)] and len(swap_ins) == 1 and swap_ins[0][0] == 0
    assert sorted(finished) == ["a", "b", "c"] and scheduler.num_preemptions_total == 1
    assert scheduler.kv.num_free_blocks == 4 and scheduler.kv.num_free_cpu_blocks == 4


def test_swap_mode_needs_swap_space():
    with pytest.raises(InvalidRequestError) as info:
        LLM(max_model_len=128, kv_cache_space=0.05, preemption_mode="swap")
    assert info.value.param == "swap_space"
    with pytest.raises(InvalidRequestError) as info:
        LLM(max_model_len=128, kv_cache_space=0.05, preemption_mode="page-out")
    assert info.value.param == "preemption_mode"


@pytest.mark.timeout(900)
def test_swap_and_recompute_give_the_same_tokens(test_prompts):
    prompts = test_prompts[:6]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    seeded = SamplingParams(temperature=1.0, seed=5, max_tokens=24, ignore_eos=True)
    tiny = dict(max_model_len=128, num_kv_blocks=12)
    results, engines = {}, {}
    for name, kwargs in (("roomy", dict(max_model_len=128, kv_cache_space=0.1)),
                         ("recompute", tiny),
                         ("swap", dict(tiny, preemption_mode="swap", swap_space=0.05)),
                         ("small-swap", dict(tiny, preemption_mode="swap", swap_space=0.0015))):  # 2 blocks
        llm = LLM(**kwargs)
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=[params] * 3 + [seeded] * 3, use_tqdm=False)
        results[name] = [o.outputs[0].token_ids for o in outs]
        engines[name] = llm.llm_engine
    assert results["recompute"] == results["roomy"]
    assert results["swap"] == results["roomy"]
    assert results["small-swap"] == results["roomy"]
    swap = engines["swap"].get_stats()
    assert swap.num_preemptions_total > 0 and swap.num_swapped_out_total == swap.num_preemptions_total
    small = engines["small-swap"].get_stats()  # the swap space fills up: some preemptions recompute
    assert 0 < small.num_swapped_out_total < small.num_preemptions_total
    for engine in engines.values():
        stats = engine.get_stats()
        assert stats.num_free_blocks == stats.num_total_blocks and stats.num_swapped == 0
        assert stats.num_free_cpu_blocks == stats.num_cpu_blocks
