"""Parallel sampling (n > 1): one prefill, prompt blocks held once, copy on write of the shared
last block; seeded samples equal the same generator streams run as separate requests."""
from __future__ import annotations

import pytest

from inference import LLM, SamplingParams
from inference.config import SchedulerConfig
from inference.kv_cache import KVCacheManager
from inference.request import Request, RequestStatus
from inference.sched.scheduler import Scheduler
from inference.sched.scheduler_output import ModelRunnerOutput

from .model_free import update

SEED_MULTIPLIER = 1000003  # Request seeds sample i's generator with seed * SEED_MULTIPLIER + i (mod 2**64)


def make_request(rid: str, index: int, tokens: list[int]) -> Request:
    return Request(rid, "p", index, list(tokens), SamplingParams(max_tokens=8), 8)


def test_fork_shares_blocks_and_copies_the_partial_block_on_write():
    kv = KVCacheManager(num_blocks=10, block_size=4)
    leader = make_request("p#0", 0, list(range(6)))  # blocks [0 1 2 3] [4 5 . .]
    assert kv.allocate_slots(leader, 6)
    leader.num_computed_tokens = 6
    followers = [make_request(f"p#{i}", i, list(range(6))) for i in (1, 2)]
    for f in followers:
        kv.fork(leader, f)
        f.num_computed_tokens = 6
    assert [f.block_ids for f in followers] == [[0, 1], [0, 1]]
    assert kv.pool.ref_cnt[:2] == [3, 3] and kv.num_free_blocks == 8  # the prompt is held once
    for f in followers:  # each appends its own token at position 6: the shared block 1 is copied first
        assert kv.allocate_slots(f, 1)
    assert [f.block_ids for f in followers] == [[0, 2], [0, 3]]
    assert kv.take_block_ops().copy == [(1, 2), (1, 3)] and kv.take_block_ops().copy == []
    assert kv.allocate_slots(leader, 1)  # the last holder writes in place
    assert leader.block_ids == [0, 1] and kv.take_block_ops().copy == []
    assert kv.pool.ref_cnt[:4] == [3, 1, 1, 1] and kv.num_free_blocks == 6
    for r in [leader, *followers]:
        kv.free(r)
    assert kv.num_free_blocks == 10


def test_copy_on_write_counts_the_copy_against_free_blocks():
    kv = KVCacheManager(num_blocks=2, block_size=4)
    leader = make_request("p#0", 0, list(range(6)))
    assert kv.allocate_slots(leader, 6)
    leader.num_computed_tokens = 6
    follower = make_request("p#1", 1, list(range(6)))
    kv.fork(leader, follower)
    follower.num_computed_tokens = 6
    assert not kv.allocate_slots(follower, 1)  # no block for the copy: nothing changes
    assert follower.block_ids == [0, 1] and kv.take_block_ops().copy == []


def test_scheduler_prefills_once_then_forks():
    config = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64)
    scheduler = Scheduler(config, KVCacheManager(10, 4))
    children = [make_request(f"p#{i}", i, list(range(6))) for i in range(3)]
    scheduler.add_request(children[0], followers=children[1:])
    assert scheduler.num_waiting == 3
    first = scheduler.schedule()
    [item] = first.scheduled
    assert item.request is children[0] and item.num_scheduled_tokens == 6
    assert item.sampling_requests == children
    result = scheduler.update_from_output(first, ModelRunnerOutput([100, 101, 102], [None] * 3))
    assert scheduler.running == children and scheduler.num_waiting == 0
    assert all(c.block_ids == [0, 1] and c.num_computed_tokens == 6 for c in children)
    assert [(r.request, r.token_ids) for r in result.sampled] == [(c, [100 + i]) for i, c in enumerate(children)]
    assert all(c.output_token_ids == [100 + i] for i, c in enumerate(children))
    second = scheduler.schedule()
    assert [s.num_scheduled_tokens for s in second.scheduled] == [1, 1, 1]
    # children[0] writes first, while the others still hold block 1: it copies; so does
    # children[1]; children[2] is then the last holder.
    assert second.blocks_to_copy == [(1, 2), (1, 3)]
    assert [c.block_ids for c in children] == [[0, 2], [0, 3], [0, 1]]


@pytest.fixture(scope="module")
def llm():
    return LLM(max_model_len=256, kv_cache_space=0.1)


def _equivalent_seed(seed: int, index: int) -> int:
    """The seed whose single-sample generator stream is sample ``index``'s of a request seeded ``seed``."""
    inverse = pow(SEED_MULTIPLIER, -1, 1 << 64)
    return ((seed * SEED_MULTIPLIER + index) * inverse) % (1 << 64)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("n", [2, 4])
def test_prompt_blocks_are_held_once_whatever_n(llm, test_prompts, n):
    engine = llm.llm_engine
    kv = engine.kv_cache_manager
    prompt = (test_prompts[1] * 20)[:100]  # 6 full blocks and 4 tokens in a 7th
    engine.add_request("par", prompt, SamplingParams(n=n, temperature=1.0, seed=3, max_tokens=8, ignore_eos=True))
    engine.step()  # the prefill, once, and n first tokens
    assert kv.num_blocks - kv.num_free_blocks == 7
    engine.step()  # every sample appends to the shared 7th block: n - 1 copies
    assert kv.num_blocks - kv.num_free_blocks == 6 + n
    while engine.has_unfinished_requests():
        engine.step()
    assert kv.num_free_blocks == kv.num_blocks


@pytest.mark.timeout(900)
@pytest.mark.parametrize("engine_kwargs", [dict(), dict(num_kv_blocks=12, max_model_len=128), dict(max_num_seqs=2)],
                         ids=["roomy", "preempting", "two-seats"])
def test_seeded_samples_equal_separate_requests(test_prompts, engine_kwargs):
    kwargs = dict(max_model_len=256, kv_cache_space=0.1)
    kwargs.update(engine_kwargs)
    llm = LLM(**kwargs)
    prompts = [test_prompts[0], test_prompts[4]]
    params = SamplingParams(n=3, temperature=1.0, top_p=0.95, seed=11, max_tokens=24, ignore_eos=True)
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    separate = [SamplingParams(temperature=1.0, top_p=0.95, seed=_equivalent_seed(11, i), max_tokens=24,
                               ignore_eos=True) for _ in prompts for i in range(3)]
    alone = llm.generate(prompt_token_ids=[p for p in prompts for _ in range(3)], sampling_params=separate,
                         use_tqdm=False)
    got = [c.token_ids for o in outs for c in o.outputs]
    assert got == [o.outputs[0].token_ids for o in alone]
    assert len({tuple(t) for t in got}) > 2  # the samples did diverge
    if "num_kv_blocks" in engine_kwargs:
        assert llm.llm_engine.scheduler.num_preemptions_total > 0
    assert llm.llm_engine.kv_cache_manager.num_free_blocks == llm.llm_engine.kv_cache_manager.num_blocks


def test_samples_beyond_max_num_seqs_wait_without_blocks():
    config = SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=64, max_model_len=64)
    scheduler = Scheduler(config, KVCacheManager(10, 4))
    children = [make_request(f"p#{i}", i, list(range(6))) for i in range(4)]
    scheduler.add_request(children[0], followers=children[1:])
    steps = 0
    while scheduler.num_unfinished:
        out = scheduler.schedule()
        update(scheduler, out, token_id=1)
        if steps == 0:  # a step samples no more rows than there are seats
            assert [len(item.sampling_requests) for item in out.scheduled] == [2]
            assert [c.num_output_tokens for c in children] == [1, 1, 0, 0]
            assert scheduler.running == children[:2] and children[1].block_ids == children[0].block_ids
            assert [r.request_id for r in scheduler.waiting] == ["p#2", "p#3"]
            assert children[2].block_ids == [] and children[2].num_computed_tokens == 0
            assert scheduler.kv.num_free_blocks == 8
        for item in out.scheduled:
            for r in item.sampling_requests:
                if r.num_output_tokens == 3:
                    scheduler.finish_request(r, RequestStatus.FINISHED_LENGTH)
        steps += 1
    assert all(c.num_output_tokens == 3 for c in children)
    assert scheduler.kv.num_free_blocks == 10


def test_a_step_samples_at_most_max_num_seqs_rows():
    """Forks take seats before new prompts: with 4 seats, the first prompt's 3 followers sample beside it and
    the second prompt waits for a seat, so no step samples more than 4 rows."""
    config = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64)
    scheduler = Scheduler(config, KVCacheManager(20, 4))
    for p in range(2):
        children = [make_request(f"p{p}#{i}", 4 * p + i, list(range(6))) for i in range(4)]
        scheduler.add_request(children[0], followers=children[1:])
    rows, outputs = [], {}
    while scheduler.num_unfinished:
        out = scheduler.schedule()
        rows.append(sum(len(item.sampling_requests) for item in out.scheduled))
        update(scheduler, out, token_id=1)
        for item in out.scheduled:
            for r in item.sampling_requests:
                outputs[r.request_id] = r.num_output_tokens
                if r.num_output_tokens == 2:
                    scheduler.finish_request(r, RequestStatus.FINISHED_LENGTH)
    assert rows[0] == 4 and max(rows) <= 4
    assert sorted(outputs) == sorted(f"p{p}#{i}" for p in range(2) for i in range(4))
    assert set(outputs.values()) == {2}
    assert scheduler.kv.num_free_blocks == 20
