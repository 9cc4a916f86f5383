"""``SamplingParams.output_kind``: ``FINAL_ONLY`` gives one output per request, when it finishes, equal
to the joined deltas of ``DELTA`` (text, token ids, finish and stop reasons, logprobs), with single and
multi-step scheduling; a bad value is an error naming ``output_kind``."""
from __future__ import annotations

import pytest

from inference import LLM, InvalidRequestError, SamplingParams
from inference.sampling_params import RequestOutputKind


def _run(llm: LLM, prompts, params) -> tuple[dict, dict]:
    """Drive the engine step by step: ``({request: joined outputs}, {request: number of outputs})``."""
    engine = llm.llm_engine
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        engine.add_request(str(i), prompt, p)
    joined: dict = {}
    count: dict = {}
    finished: dict = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            count[out.request_id] = count.get(out.request_id, 0) + 1
            for o in out.outputs:
                text, ids, logprobs, _, _ = joined.get((out.request_id, o.index), ("", (), (), None, None))
                joined[(out.request_id, o.index)] = (
                    text + o.text, ids + tuple(o.token_ids),
                    logprobs + tuple((lp_id, round(lp.logprob, 4), lp.decoded_token)
                                     for entry in o.logprobs or [] for lp_id, lp in entry.items()),
                    o.finish_reason, o.stop_reason)
            if out.finished:
                finished[out.request_id] = sorted(v for k, v in joined.items() if k[0] == out.request_id)
    kv = engine.kv_cache_manager
    assert kv.num_free_blocks == kv.num_blocks, "KV blocks leaked"
    return finished, count


def _workload(test_prompts, tokenizer) -> tuple[list, list[SamplingParams]]:
    prompts = list(test_prompts) + ["Écris un poème sur la mer, avec des émojis 🌊🐚 et des accents.",
                                    "用中文写一句关于猫的话。"]
    eos = tokenizer.eos_token_id
    params = [SamplingParams(temperature=0, max_tokens=5 + 9 * i, ignore_eos=i % 2 == 0) for i in range(len(prompts))]
    params += [
        SamplingParams(temperature=0.9, top_p=0.9, seed=11, max_tokens=40),
        SamplingParams(n=3, temperature=0.8, seed=5, max_tokens=30),                    # parallel samples
        SamplingParams(temperature=0, max_tokens=40, stop=[" the", "."]),               # stop strings: text matched
        SamplingParams(temperature=0, max_tokens=40, stop=["."], include_stop_str_in_output=True),
        SamplingParams(temperature=0, max_tokens=60, include_stop_str_in_output=True),  # EOS text kept
        SamplingParams(temperature=0, max_tokens=60, skip_special_tokens=False),
        SamplingParams(temperature=0, max_tokens=12, logprobs=2),
        SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[eos] if eos is not None else None, min_tokens=3),
    ]
    prompts += [prompts[i % len(prompts)] for i in range(len(params) - len(prompts))]
    return prompts, params


@pytest.mark.parametrize("num_scheduler_steps", [1, 8])
def test_final_only_equals_the_joined_deltas(test_prompts, smollm2_tokenizer, num_scheduler_steps):
    llm = LLM(max_model_len=512, kv_cache_space=0.25, num_scheduler_steps=num_scheduler_steps)
    prompts, params = _workload(test_prompts, smollm2_tokenizer)
    deltas, delta_counts = _run(llm, prompts, params)
    finals, final_counts = _run(llm, prompts, [p.clone(output_kind=RequestOutputKind.FINAL_ONLY) for p in params])
    assert finals == deltas
    assert set(final_counts.values()) == {1}  # one output per request, the finished one
    assert max(delta_counts.values()) > 1
    assert any(reason == "stop" for outs in finals.values() for *_, reason, _ in outs)


def test_generate_asks_for_final_outputs_and_leaves_the_callers_params_alone(test_prompts):
    llm = LLM(max_model_len=512, kv_cache_space=0.25)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    outputs = llm.generate(prompt_token_ids=test_prompts[:3], sampling_params=params, use_tqdm=False)
    assert params.output_kind is RequestOutputKind.DELTA
    deltas, _ = _run(llm, test_prompts[:3], [params] * 3)
    for i, out in enumerate(outputs):
        (text, ids, *_), = deltas[str(i)]
        assert out.finished and out.outputs[0].text == text and tuple(out.outputs[0].token_ids) == ids
        assert len(ids) == 24


@pytest.mark.parametrize("value", [0, 3, "final", True, None])
def test_a_bad_output_kind_names_the_parameter(value):
    with pytest.raises(InvalidRequestError) as err:
        SamplingParams(output_kind=value)
    assert err.value.param == "output_kind" and "FINAL_ONLY" in str(err.value)


def test_output_kind_takes_vllms_values():
    assert SamplingParams(output_kind=2).output_kind is RequestOutputKind.FINAL_ONLY
    assert SamplingParams(output_kind=1).output_kind is RequestOutputKind.DELTA


def test_an_aborted_final_only_request_gets_the_text_a_delta_request_streamed(test_prompts):
    llm = LLM(max_model_len=512, kv_cache_space=0.25)
    engine = llm.llm_engine
    results = {}
    for kind in RequestOutputKind:
        params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True, n=2, seed=3, output_kind=kind)
        engine.add_request("r", test_prompts[0], params)
        text, ids, outputs = {}, {}, []
        for _ in range(12):
            outputs += engine.step()
        engine.abort_request("r")
        while engine.has_unfinished_requests():
            outputs += engine.step()
        for out in outputs:
            for o in out.outputs:
                text[o.index] = text.get(o.index, "") + o.text
                ids[o.index] = ids.get(o.index, ()) + tuple(o.token_ids)
        assert outputs[-1].finished and {o.finish_reason for o in outputs[-1].outputs} == {"abort"}
        results[kind] = (text, ids)
        kv = engine.kv_cache_manager
        assert kv.num_free_blocks == kv.num_blocks
    (final_text, final_ids), (delta_text, delta_ids) = results[RequestOutputKind.FINAL_ONLY], results[RequestOutputKind.DELTA]
    assert final_ids == delta_ids and len(final_ids[0]) >= 5
    assert final_text == delta_text and final_text[0]
