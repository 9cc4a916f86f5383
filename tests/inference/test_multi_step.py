"""Multi-step scheduling (``num_scheduler_steps=8``: up to 8 decode steps per host iteration)
gives exactly the outputs of single steps: greedy and seeded sampling, finishes by length in the
middle of a window, EOS, stop token ids and stop strings, parallel samples, requests that fall
back to single steps (logprobs, penalties, min_tokens), the end of ``max_model_len``; streamed
deltas carry every token; every KV block comes back, also under preemption."""
from __future__ import annotations

import bisect

import pytest

from inference import LLM, InvalidRequestError, SamplingParams
from inference.engine import EngineArgs
from inference.engine.iteration_stats import ITERATION_TOKEN_BUCKETS


def _run(llm: LLM, prompts, params) -> tuple[dict[str, tuple], int]:
    """Drive the engine step by step, joining the streamed deltas; returns the finished outputs
    (text, token ids, finish reason, stop reason per sample) and the most tokens one delta carried."""
    engine = llm.llm_engine
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        engine.add_request(str(i), prompt, p)
    text, ids, done, most = {}, {}, {}, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            for o in out.outputs:
                key = (out.request_id, o.index)
                text[key] = text.get(key, "") + o.text
                ids[key] = ids.get(key, ()) + tuple(o.token_ids)
                most = max(most, len(o.token_ids))
            if out.finished:
                done[out.request_id] = tuple((text[(out.request_id, o.index)], ids[(out.request_id, o.index)],
                                              o.finish_reason, o.stop_reason) for o in out.outputs)
    kv = engine.kv_cache_manager
    assert kv.num_free_blocks == kv.num_blocks, "KV blocks leaked"
    return done, most


@pytest.fixture(scope="module")
def engines():
    return (LLM(max_model_len=512, kv_cache_space=0.25),
            LLM(max_model_len=512, kv_cache_space=0.25, num_scheduler_steps=8, async_scheduling=False))


@pytest.fixture(scope="module")
def workload(test_prompts):
    prompts = test_prompts * 2
    # max_tokens 6, 13, 20, ...: most end in the middle of a window; odd ones may stop at EOS
    greedy = [SamplingParams(temperature=0, max_tokens=6 + 7 * i, ignore_eos=i % 2 == 0) for i in range(8)]
    sampled = [SamplingParams(temperature=0.9, top_p=0.9, seed=100 + i, max_tokens=21 + 3 * i) for i in range(6)]
    sampled.append(SamplingParams(n=2, temperature=0.8, seed=7, max_tokens=35))   # parallel samples
    # a batch with it runs single steps
    sampled.append(SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=2))
    return prompts, greedy + sampled


def _stopping_workload(single: LLM, workload) -> tuple[list, list]:
    """The workload with a stop token id, stop strings (taken from the single-step greedy outputs,
    so that they end requests mid-window) and a request that keeps its batch to single steps."""
    prompts, params = workload
    expected, _ = _run(single, prompts, params)
    # a stop token id and stop strings taken from the single-step greedy outputs end requests mid-window
    params = list(params)
    params[2] = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True, stop_token_ids=[expected["2"][0][1][17]])
    params[4] = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True, stop=[expected["4"][0][0].split()[5]])
    params[6] = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True, stop=[expected["6"][0][0].split()[7]],
                               include_stop_str_in_output=True)
    params[3] = SamplingParams(temperature=0, max_tokens=6, min_tokens=3, presence_penalty=0.5)  # single steps
    return prompts, params


@pytest.mark.timeout(900)
def test_same_outputs_as_single_steps(engines, workload):
    single, multi = engines
    prompts, params = _stopping_workload(single, workload)
    expected, _ = _run(single, prompts, params)
    before = multi.llm_engine.num_multi_step_windows
    got, most = _run(multi, prompts, params)
    assert got == expected
    assert multi.llm_engine.num_multi_step_windows > before + 3
    assert most == 8  # a streamed delta carries a whole window
    assert [expected[k][0][2] for k in "246"] == ["stop"] * 3
    assert len(expected["14"]) == 2 and expected["14"][0][1] != expected["14"][1][1]


@pytest.mark.timeout(900)
def test_windows_scheduled_ahead(engines, workload):
    """With async scheduling the next window is launched before the tokens of the one in flight
    are back (its first input is the last token that window samples, on the device)."""
    single, _ = engines
    ahead = LLM(max_model_len=512, kv_cache_space=0.25, num_scheduler_steps=8, async_scheduling=True)
    scheduler, windows_ahead = ahead.llm_engine.scheduler, []
    schedule_ahead = scheduler.schedule_ahead

    def recording(prev):
        out = schedule_ahead(prev)
        windows_ahead.append(out is not None and out.num_steps > 1)
        return out
    scheduler.schedule_ahead = recording
    prompts, params = _stopping_workload(single, workload)
    expected, _ = _run(single, prompts, params)
    got, most = _run(ahead, prompts, params)
    assert got == expected
    assert sum(windows_ahead) > 3 and most == 8


@pytest.mark.timeout(900)
def test_generation_reaches_max_model_len(engines, smollm2_tokenizer):
    """A request 12 tokens short of max_model_len: the windows are cut so no position passes it."""
    single, multi = engines
    prompt = smollm2_tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 60)[:500]
    params = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), SamplingParams(temperature=0, max_tokens=30)]
    prompts = [prompt, prompt[:40]]
    expected, _ = _run(single, prompts, params)
    got, _ = _run(multi, prompts, params)
    assert got == expected
    assert len(got["0"][0][1]) == 12 and got["0"][0][2] == "length"


@pytest.mark.timeout(900)
def test_preemption_and_prefix_caching_with_a_small_kv_cache(engines, test_prompts):
    single, _ = engines
    small = LLM(max_model_len=256, num_kv_blocks=20, enable_prefix_caching=True, num_scheduler_steps=8)
    prompts = test_prompts + test_prompts[:4]  # the repeated prompts hit the prefix cache
    params = [SamplingParams(temperature=0, max_tokens=40 + 3 * i, ignore_eos=True) for i in range(len(prompts))]
    expected, _ = _run(single, prompts, params)
    got, _ = _run(small, prompts, params)
    engine = small.llm_engine
    assert engine.scheduler.num_preemptions_total > 0
    assert engine.num_multi_step_windows > 0
    assert got == expected


def test_num_scheduler_steps_is_checked():
    for bad in (0, 65):
        with pytest.raises(InvalidRequestError) as error:
            EngineArgs(num_scheduler_steps=bad).create_engine_config()
        assert error.value.param == "num_scheduler_steps"
    with pytest.raises(InvalidRequestError) as error:
        EngineArgs(num_scheduler_steps=4, tensor_parallel_size=2).create_engine_config()
    assert error.value.param == "num_scheduler_steps"


def test_iteration_tokens_count_prompts_and_generated_tokens(engines, test_prompts):
    """``vllm:iteration_tokens_total``'s source, counted as vLLM v1 does: per step, the tokens generated plus
    the prompts whose prefill finished; a multi-step window counts as its steps, each with the requests
    that kept a token in it. Its sum tracks prompt_tokens_total + generation_tokens_total."""
    params = [SamplingParams(temperature=0, max_tokens=5 + i, ignore_eos=True) for i in range(len(test_prompts))]
    expected = sum(map(len, test_prompts)) + sum(p.max_tokens for p in params)
    for llm in engines:
        before = llm.llm_engine.get_stats()
        _run(llm, test_prompts, params)
        after = llm.llm_engine.get_stats()
        steps = sum(after.iteration_tokens_counts) - sum(before.iteration_tokens_counts)
        tokens = after.iteration_tokens_sum - before.iteration_tokens_sum
        totals = (after.prompt_tokens_total + after.generation_tokens_total
                  - before.prompt_tokens_total - before.generation_tokens_total)
        assert tokens == totals == expected
        assert steps == max(p.max_tokens for p in params)  # one prefill step, then decodes
        prefill_step = sum(map(len, test_prompts)) + len(test_prompts)  # every prompt and its first token
        bucket = bisect.bisect_left(ITERATION_TOKEN_BUCKETS, prefill_step)  # above the decode steps' (1, 8]
        assert bucket > 1 and after.iteration_tokens_counts[bucket] - before.iteration_tokens_counts[bucket] == 1
