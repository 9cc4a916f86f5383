"""``Scheduler.update_from_output`` alone updates the requests after a step (scheduler and KV manager
on CPU, no model): it advances them, appends the sampled tokens as typed records and finishes the
requests their ids end."""
from __future__ import annotations

from inference.config import SchedulerConfig
from inference.kv_cache import KVCacheManager
from inference.request import Request, RequestStatus
from inference.sampling_params import SamplingParams
from inference.sched.scheduler import Scheduler
from inference.sched.scheduler_output import SampledTokens

from .model_free import same_token_output, update


def make_scheduler(num_blocks: int = 16) -> Scheduler:
    config = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64)
    return Scheduler(config, KVCacheManager(num_blocks, 4))


def with_requests(*rids: str) -> tuple[Scheduler, list[Request]]:
    """A scheduler (16 blocks of 4 tokens) holding requests of 5 prompt tokens, stop token id 2."""
    scheduler = make_scheduler()
    requests = [Request(rid, rid, 0, [5, 6, 7, 8, 9], SamplingParams(max_tokens=8, stop_token_ids=[2]), 8)
                for rid in rids]
    for request in requests:
        scheduler.add_request(request)
    return scheduler, requests


def test_a_step_appends_one_token_per_request_as_records():
    scheduler, (a, b) = with_requests("a", "b")
    out = scheduler.schedule()
    result = update(scheduler, out, token_id=3)
    assert [type(r) for r in result.sampled] == [SampledTokens, SampledTokens]
    assert [(r.request, r.token_ids, r.status) for r in result.sampled] == [(a, [3], None), (b, [3], None)]
    assert a.num_computed_tokens == b.num_computed_tokens == 5 and a.output_token_ids == [3]
    assert result.num_prompt_tokens == result.num_prompt_tokens_computed == 10


def test_a_stop_token_finishes_the_request_and_frees_its_blocks():
    scheduler, [request] = with_requests("a")
    update(scheduler, scheduler.schedule(), token_id=3)
    [record] = update(scheduler, scheduler.schedule(), token_id=2).sampled
    assert record.status is RequestStatus.FINISHED_STOPPED and request.stop_reason == 2
    assert request.is_finished and not scheduler.running and scheduler.kv.num_free_blocks == 16


def test_a_request_finished_while_its_step_ran_appends_nothing():
    scheduler, (a, b) = with_requests("a", "b")
    out = scheduler.schedule()
    scheduler.finish_requests(["a"], RequestStatus.FINISHED_STOPPED)  # a stop string, while the step runs
    result = update(scheduler, out, token_id=3)
    assert [r.request for r in result.sampled] == [b] and a.output_token_ids == []
    assert result.num_prompt_tokens == 5


def test_a_step_scheduled_ahead_is_advanced_once():
    scheduler, [request] = with_requests("a")
    update(scheduler, scheduler.schedule(), token_id=3)
    decode = scheduler.schedule()
    assert scheduler.can_schedule_ahead(decode, max_model_len=64)
    ahead = scheduler.schedule_ahead(decode)  # advances decode's request before its token is known
    assert request.num_computed_tokens == 6 and request.output_token_ids == [3]
    scheduler.update_from_output(decode, same_token_output(decode, 4))
    assert request.num_computed_tokens == 6 and request.output_token_ids == [3, 4]
    update(scheduler, ahead, token_id=4)
    assert request.num_computed_tokens == 7 and request.output_token_ids == [3, 4, 4]


def test_prefix_cache_work_overlaps_the_step_without_changing_hits():
    """``while_step_runs`` (called while the device runs a step) registers the full prompt blocks the step
    computes and hashes the next waiting prompt; the update after the step changes nothing more, and a
    later request with the same prompt hits those blocks."""
    config = SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=64, max_model_len=64)
    scheduler = Scheduler(config, KVCacheManager(16, 4, enable_prefix_caching=True))
    prompt = list(range(10, 19))  # 9 tokens: two full blocks of 4
    first, second = (Request(rid, rid, 0, prompt, SamplingParams(max_tokens=1), 1) for rid in ("a", "b"))
    scheduler.add_request(first)
    scheduler.add_request(second)  # waits: one sequence at a time
    out = scheduler.schedule()
    assert [item.request for item in out.scheduled] == [first]
    scheduler.while_step_runs(out)
    assert scheduler.kv.pool.num_cached_blocks == 2
    assert len(second.block_hashes) == 2 and second.block_hashes == first.block_hashes[:2]
    update(scheduler, out)
    assert scheduler.kv.pool.num_cached_blocks == 2 and first.is_finished
    out = scheduler.schedule()
    assert [(item.request, item.num_scheduled_tokens) for item in out.scheduled] == [(second, 1)]
    assert second.num_cached_tokens == 8
