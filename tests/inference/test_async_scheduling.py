"""Async scheduling (step N+1 launched before step N's tokens are back) gives exactly the
outputs of the synchronous engine: greedy and seeded sampling, finishes by length, EOS, stop
token ids and stop strings in the middle of a batch, aborts; every KV block comes back."""
from __future__ import annotations

import pytest

from inference import LLM, SamplingParams


def _engine(async_scheduling: bool) -> LLM:
    return LLM(max_model_len=512, kv_cache_space=0.25, async_scheduling=async_scheduling)


def _run(llm: LLM, prompts, params, abort_after: dict[str, int] | None = None) -> dict[str, tuple]:
    """Drive the engine step by step; ``abort_after``: request id -> step at which to abort it."""
    engine = llm.llm_engine
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        engine.add_request(str(i), prompt, p)
    text, ids, done, step = {}, {}, {}, 0
    while engine.has_unfinished_requests():
        for rid, at in (abort_after or {}).items():
            if at == step:
                engine.abort_request(rid)
        for out in engine.step():  # deltas: the new text and tokens of each sample
            for o in out.outputs:
                key = (out.request_id, o.index)
                text[key] = text.get(key, "") + o.text
                ids[key] = ids.get(key, ()) + tuple(o.token_ids)
            if out.finished:
                done[out.request_id] = tuple((text[(out.request_id, o.index)], ids[(out.request_id, o.index)],
                                              o.finish_reason) for o in out.outputs)
        step += 1
    kv = engine.kv_cache_manager
    assert kv.num_free_blocks == kv.num_blocks, "KV blocks leaked"
    return done


@pytest.fixture(scope="module")
def engines():
    return _engine(False), _engine(True)


@pytest.fixture(scope="module")
def workload(test_prompts):
    prompts = test_prompts * 2
    base = [SamplingParams(temperature=0, max_tokens=6 + 5 * i, ignore_eos=i % 2 == 0) for i in range(8)]
    sampled = [SamplingParams(temperature=0.9, top_p=0.9, seed=100 + i, max_tokens=24) for i in range(8)]
    return prompts, base + sampled


@pytest.mark.timeout(900)
def test_same_outputs_as_synchronous_engine(engines, workload):
    sync, ahead = engines
    prompts, params = workload
    expected = _run(sync, prompts, params)
    # a stop token id and a stop string from the synchronous greedy outputs end requests mid-batch
    params = list(params)
    params[2] = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop_token_ids=[expected["2"][0][1][7]])
    params[4] = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=[expected["4"][0][0].split()[3]])
    expected = _run(sync, prompts, params)
    before = ahead.llm_engine.num_steps_ahead
    got = _run(ahead, prompts, params)
    assert ahead.llm_engine.num_steps_ahead > before + 10  # most decode steps were launched ahead
    assert got == expected
    assert expected["2"][0][2] == "stop" and expected["4"][0][2] == "stop"


@pytest.mark.timeout(900)
def test_abort_while_a_step_is_launched_ahead(engines, workload):
    sync, ahead = engines
    prompts, params = workload
    params = [SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)] * 6
    expected = _run(sync, prompts[:6], params, abort_after={"1": 8})
    got = _run(ahead, prompts[:6], params, abort_after={"1": 8})
    assert got["1"][0][2] == "abort"
    assert {k: v for k, v in got.items() if k != "1"} == {k: v for k, v in expected.items() if k != "1"}
    assert all(len(v[0][1]) == 30 for k, v in got.items() if k != "1")


def test_requests_without_max_tokens_run_to_the_end_of_the_context(engines, test_prompts):
    """``max_tokens=None`` fills the context (max_model_len 512): scheduling ahead compares with the
    request's effective limit (it compared with ``max_tokens`` itself, and None crashed the step)."""
    prompts = [(p * 100)[:490 + i] for i, p in enumerate(test_prompts[:2])]  # 22 and 21 tokens of room
    params = [SamplingParams(temperature=0, max_tokens=None, ignore_eos=True) for _ in prompts]
    expected, got = (_run(llm, prompts, params) for llm in engines)
    assert got == expected
    for i, prompt in enumerate(prompts):
        _, ids, reason = got[str(i)][0]
        assert len(ids) == 512 - len(prompt) and reason == "length"


@pytest.mark.timeout(900)
def test_min_tokens_ends_at_the_same_token_as_synchronous_steps(engines, workload):
    """A stop token allowed from ``min_tokens`` on ends the request there also when the steps around it
    are launched ahead (their ban must not count the tokens still in flight as missing)."""
    sync, ahead = engines
    prompts, _ = workload
    reference = _run(sync, prompts[:4], [SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)] * 4)
    params = []
    for i in range(4):
        ids = reference[str(i)][0][1]
        m = next(j for j in range(3, 16) if ids[j] not in ids[:j])  # its first time at position m
        params.append(SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, stop_token_ids=[ids[m]],
                                     min_tokens=m))
    expected = _run(sync, prompts[:4], params)
    assert all(len(v[0][1]) <= 16 and v[0][2] == "stop" for v in expected.values())
    assert _run(ahead, prompts[:4], params) == expected


@pytest.mark.timeout(900)
@pytest.mark.parametrize("num_scheduler_steps", [1, 4])
def test_prefix_caching_with_steps_launched_ahead(test_prompts, num_scheduler_steps):
    """Prefix caching on (the default) and steps launched ahead: the outputs of the synchronous engine,
    and the blocks completed by tokens that were still on the device when the next step was
    scheduled are cached with their true contents: the same prompts extended by their outputs hit
    the cache for every full block, and still give the synchronous engine's tokens."""
    kwargs = dict(max_model_len=512, kv_cache_space=0.25, num_scheduler_steps=num_scheduler_steps)
    sync, ahead = LLM(async_scheduling=False, **kwargs), LLM(async_scheduling=True, **kwargs)
    assert ahead.llm_engine.config.cache.enable_prefix_caching  # the default
    params = [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)] * 4
    expected = _run(sync, test_prompts[:4], params)
    before = ahead.llm_engine.num_steps_ahead
    assert _run(ahead, test_prompts[:4], params) == expected
    assert ahead.llm_engine.num_steps_ahead > before + 5
    # The prompts followed by their generated text hit the cache as they do in the synchronous engine
    # (every full block of prompt and output; with windows, a request's last window is freed uncached).
    followups = [list(p) + list(expected[str(i)][0][1]) for i, p in enumerate(test_prompts[:4])]
    again = [SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)] * 4
    hits = []
    for llm in (sync, ahead):
        kv, before = llm.llm_engine.kv_cache_manager, llm.llm_engine.kv_cache_manager.prefix_cache_hits
        hits.append((_run(llm, followups, again), kv.prefix_cache_hits - before))
    assert hits[1] == hits[0]
    block = ahead.llm_engine.kv_cache_manager.block_size
    assert hits[1][1] >= sum((len(f) - 1) // block * block - block for f in followups)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("num_scheduler_steps", [1, 4])
def test_constrained_requests_run_ahead_with_the_synchronous_outputs(engines, test_prompts, num_scheduler_steps):
    """Requests with a JSON schema or a regex beside unconstrained ones: their decode steps are launched
    ahead (the bitmask filled once the previous token is on the host), and every request gives the
    synchronous engine's tokens; the constrained outputs validate."""
    import json

    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10},
                                               "age": {"type": "integer", "minimum": 0, "maximum": 99}},
              "required": ["name", "age"], "additionalProperties": False}
    params = [SamplingParams(temperature=0, max_tokens=60, structured_outputs={"json": schema}),
              SamplingParams(temperature=0, max_tokens=30, structured_outputs={"regex": r"[a-z]+( [a-z]+){3,}\."}),
              SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),  # ends before the others
              SamplingParams(temperature=0.8, seed=3, max_tokens=40, structured_outputs={"json": schema})]
    kwargs = dict(max_model_len=512, kv_cache_space=0.25, num_scheduler_steps=num_scheduler_steps)
    sync = engines[0] if num_scheduler_steps == 1 else LLM(async_scheduling=False, **kwargs)
    ahead = engines[1] if num_scheduler_steps == 1 else LLM(async_scheduling=True, **kwargs)
    expected = _run(sync, test_prompts[:4], params)
    before = ahead.llm_engine.num_steps_ahead
    got = _run(ahead, test_prompts[:4], params)
    assert got == expected
    assert ahead.llm_engine.num_steps_ahead > before + 10  # steps with only constrained requests ran ahead
    for key in ("0", "3"):
        text, _, reason = got[key][0]
        assert reason == "stop", got[key]
        json.loads(text)


@pytest.mark.timeout(900)
def test_steps_run_ahead_while_requests_wait_for_a_seat(test_prompts):
    """Every ``max_num_seqs`` seat taken and more requests waiting, as under a tenant's flood: the decode
    steps are still launched ahead, the waiting requests are admitted as seats free (in the tenants'
    fair order), and every request gives the synchronous engine's tokens."""
    kwargs = dict(max_model_len=512, kv_cache_space=0.25, max_num_seqs=2)
    sync, ahead = LLM(async_scheduling=False, **kwargs), LLM(async_scheduling=True, **kwargs)
    for llm in (sync, ahead):
        llm.llm_engine.set_tenant_shares({"a": 30, "b": 70}, {})
    params = [SamplingParams(temperature=0, max_tokens=12 + 4 * i, ignore_eos=True) for i in range(6)]

    def run(llm):
        engine = llm.llm_engine
        for i, (prompt, p) in enumerate(zip(test_prompts * 2, params)):
            engine.add_request(str(i), prompt, p, tenant_id="ab"[i % 2])
        done, order, ahead_while_waiting = {}, [], 0
        while engine.has_unfinished_requests():
            waiting, launched = engine.scheduler.num_waiting, engine.num_steps_ahead
            outs = engine.step()
            ahead_while_waiting += bool(waiting) and engine.num_steps_ahead > launched
            for out in outs:
                if out.outputs[0].token_ids and out.request_id not in order:
                    order.append(out.request_id)
                done[out.request_id] = done.get(out.request_id, ()) + tuple(out.outputs[0].token_ids)
        return done, order, ahead_while_waiting

    expected, expected_order, _ = run(sync)
    got, order, ahead_while_waiting = run(ahead)
    assert got == expected and order == expected_order
    assert ahead_while_waiting > 20  # most decode steps while requests waited for a seat
