"""Bad input gets a typed error naming the parameter and limit; the engine goes on serving others."""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from inference import LLM, InvalidRequestError, ModelLoadError, SamplingParams, UnsupportedArchitectureError
from inference.engine import EngineArgs, LLMEngine


@pytest.fixture(scope="module")
def engine():
    return LLMEngine.from_engine_args(EngineArgs(max_model_len=128, kv_cache_space=0.2))


@pytest.mark.parametrize("make, param, limit", [
    (lambda: SamplingParams(max_tokens=0), "max_tokens", "at least 1"),
    (lambda: SamplingParams(temperature=-0.1), "temperature", "non-negative"),
    (lambda: SamplingParams(top_p=0.0), "top_p", "(0, 1]"),
    (lambda: SamplingParams(top_p=1.5), "top_p", "(0, 1]"),
    (lambda: SamplingParams(n=0), "n", "between 1 and 128"),
    (lambda: SamplingParams(n=129), "n", "between 1 and 128"),
    (lambda: SamplingParams(logprobs=21), "logprobs", "20"),
    (lambda: SamplingParams(prompt_logprobs=50), "prompt_logprobs", "20"),
    (lambda: SamplingParams(top_k=-2), "top_k", "-1 or 0 (keep all tokens), otherwise at least 1"),
    (lambda: SamplingParams(n=2, best_of=3), "best_of", "equal to n=2"),
    (lambda: SamplingParams(best_of=4), "best_of", "no more candidates than n"),
    (lambda: SamplingParams(best_of="2"), "best_of", "an integer"),
])
def test_bad_sampling_params(make, param, limit):
    with pytest.raises(InvalidRequestError) as info:
        make()
    assert info.value.param == param
    assert param in str(info.value) and limit in str(info.value)


def test_best_of_equal_to_n_and_top_k_zero_are_accepted():
    assert SamplingParams(n=3, best_of=3).best_of == 3 and SamplingParams().best_of is None
    assert SamplingParams(top_k=0).top_k == 0


def _finish_all(engine) -> dict[str, str]:
    texts: dict[str, str] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            texts[out.request_id] = texts.get(out.request_id, "") + "".join(o.text for o in out.outputs)
    return texts


@pytest.mark.timeout(120)
def test_bad_prompts_do_not_disturb_others(engine):
    good = SamplingParams(temperature=0, max_tokens=8)
    engine.add_request("good-1", "Hello, my name is", good)
    with pytest.raises(InvalidRequestError) as info:
        engine.add_request("empty", [], good)
    assert info.value.param == "prompt"
    with pytest.raises(InvalidRequestError) as info:
        engine.add_request("too-long", [1] * 100, SamplingParams(max_tokens=64))
    assert info.value.param == "max_tokens" and "128" in str(info.value) and "164" in str(info.value)
    with pytest.raises(InvalidRequestError) as info:
        engine.add_request("huge-prompt", [1] * 500, good)
    assert info.value.param == "prompt" and "500" in str(info.value)
    engine.step()
    engine.add_request("good-2", "The sky is", good)
    texts = _finish_all(engine)
    assert set(texts) == {"good-1", "good-2"} and all(texts.values())
    kv = engine.kv_cache_manager
    assert kv.num_free_blocks == kv.num_blocks


@pytest.mark.timeout(120)
def test_abort_returns_blocks(engine):
    engine.add_request("a", "Tell me a long story about dragons.", SamplingParams(max_tokens=100, ignore_eos=True))
    engine.add_request("b", "Count to ten:", SamplingParams(temperature=0, max_tokens=5))
    for _ in range(3):
        engine.step()
    assert engine.kv_cache_manager.num_free_blocks < engine.kv_cache_manager.num_blocks
    engine.add_request("c", "Not started yet.", SamplingParams(max_tokens=5))
    # what a server charges a request whose client left: the prompt tokens the engine had computed
    computed = engine.abort_request(["a", "c", "unknown"])
    outs = []
    while engine.has_unfinished_requests():
        outs.extend(engine.step())
    aborted = [o for o in outs if o.request_id == "a"]
    assert aborted and aborted[-1].finished and aborted[-1].outputs[0].finish_reason == "abort"
    assert computed == {"a": len(aborted[-1].prompt_token_ids), "c": 0}
    assert any(o.request_id == "b" and o.finished for o in outs)
    assert engine.kv_cache_manager.num_free_blocks == engine.kv_cache_manager.num_blocks


def test_unknown_model_name():
    with pytest.raises(ModelLoadError) as info:
        LLM(model="no-such-model-anywhere")
    assert info.value.param == "model" and "no-such-model-anywhere" in str(info.value)


def test_unsupported_architecture(tmp_path, smollm2_dir):
    folder = tmp_path / "gpt2ish"
    shutil.copytree(smollm2_dir, folder)
    config = json.loads((folder / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedArchitectureError) as info:
        LLM(model=str(folder))
    for name in ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "MistralForCausalLM"):
        assert name in str(info.value)


@pytest.mark.parametrize("damage", ["truncate", "garbage"])
def test_corrupt_weights(tmp_path, smollm2_dir, damage):
    folder = tmp_path / "broken"
    shutil.copytree(smollm2_dir, folder)
    weights = next(folder.glob("*.safetensors"))
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 3] if damage == "truncate" else b"\x00garbage" * 100)
    with pytest.raises(ModelLoadError) as info:
        LLM(model=str(folder))
    assert weights.name in str(info.value)


def test_bad_engine_arguments():
    with pytest.raises(InvalidRequestError) as info:
        LLM(max_model_len=100_000)
    assert info.value.param == "max_model_len" and "8192" in str(info.value)
    with pytest.raises(InvalidRequestError) as info:
        LLM(no_such_flag=1)
    assert info.value.param == "no_such_flag"
    for field, value in (("max_model_len", -5), ("max_model_len", 0), ("max_num_batched_tokens", 0),
                         ("kv_cache_space", -1.0), ("kv_cache_space", 1e9), ("max_model_len", "abc"),
                         ("tensor_parallel_size", "3"), ("enforce_eager", 1), ("gpu_memory_utilization", "0.5")):
        with pytest.raises(InvalidRequestError) as info:  # refused before the model loads
            LLM(**{field: value})
        assert info.value.param == field and str(value) in str(info.value)


@pytest.mark.parametrize("field, value", [
    ("temperature", float("nan")), ("temperature", float("inf")), ("top_p", float("nan")),
    ("repetition_penalty", float("nan")), ("frequency_penalty", float("inf")), ("seed", 2**64), ("seed", -(2**63) - 1),
    ("stop", 5), ("stop", ["ok", 3]), ("seed", "x"), ("temperature", "hot"), ("max_tokens", 2.5), ("n", True),
    ("logit_bias", {"a": 1}), ("top_k", None), ("min_tokens", None), ("stop_token_ids", 5), ("stop_token_ids", ["a"]),
    ("ignore_eos", "x"), ("include_stop_str_in_output", None), ("skip_special_tokens", 1), ("eos_token_ids", 5),
])
def test_wrong_types_non_finite_and_out_of_range_values(field, value):
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(**{field: value})
    assert info.value.param == field


def test_numpy_integers_count_as_integers_and_huge_values_are_quoted_briefly():
    params = SamplingParams(n=np.int64(2), max_tokens=np.int32(5), seed=np.uint64(2**64 - 1))
    assert (params.n, params.max_tokens, params.seed) == (2, 5, 2**64 - 1) and type(params.seed) is int
    for field, value in (("logit_bias", {5: 10**400}), ("seed", 10**400), ("max_tokens", -(10**400))):
        with pytest.raises(InvalidRequestError) as info:
            SamplingParams(**{field: value})
        assert info.value.param == field and len(str(info.value)) < 200, str(info.value)


@pytest.mark.timeout(120)
def test_huge_seed_in_range_works_and_bad_token_ids_are_refused(engine):
    engine.add_request("big-seed", "Hi", SamplingParams(seed=2**64 - 1, max_tokens=2))
    engine.add_request("numpy-seed", "Hi", SamplingParams(seed=np.uint64(2**64 - 1), max_tokens=2))
    with pytest.raises(InvalidRequestError) as info:  # max_tokens None: the context's room (128 - the prompt)
        engine.add_request("min-tokens", "Hi", SamplingParams(max_tokens=None, min_tokens=200))
    assert info.value.param == "min_tokens" and "at most max_tokens=" in str(info.value)
    for param, params in (("logit_bias", SamplingParams(logit_bias={10**7: 5})),
                          ("stop_token_ids", SamplingParams(stop_token_ids=[-5]))):
        with pytest.raises(InvalidRequestError) as info:
            engine.add_request(f"bad-{param}", "Hi", params)
        assert info.value.param == param
    assert set(_finish_all(engine)) == {"big-seed", "numpy-seed"}


@pytest.mark.timeout(180)
def test_bad_priority_or_params_queue_nothing_and_the_engine_goes_on():
    engine = LLMEngine.from_engine_args(EngineArgs(max_model_len=128, kv_cache_space=0.2, max_num_seqs=1,
                                                   scheduling_policy="priority"))
    engine.add_request("ok", "Hi", SamplingParams(max_tokens=2), priority=0)
    for request_id, priority in (("none", None), ("nan", float("nan")), ("text", "1"), ("bool", True)):
        with pytest.raises(InvalidRequestError) as info:
            engine.add_request(request_id, "Hi", SamplingParams(max_tokens=2), priority=priority)
        assert info.value.param == "priority"
    for params in (None, {"max_tokens": 2}):
        with pytest.raises(InvalidRequestError) as info:
            engine.add_request("bad-params", "Hi", params)
        assert info.value.param == "params"
    engine.add_request("numpy", "Hi", SamplingParams(max_tokens=2), priority=np.int64(-1))
    engine.abort_request(None)  # nothing to abort
    assert set(_finish_all(engine)) == {"ok", "numpy"}


@pytest.mark.timeout(120)
def test_llm_generate_with_one_bad_prompt_queues_nothing():
    llm = LLM(max_model_len=128, kv_cache_space=0.2)
    with pytest.raises(InvalidRequestError):
        llm.generate(["Hello", ""], SamplingParams(max_tokens=4))
    engine = llm.llm_engine
    assert not engine.has_unfinished_requests()
    assert engine.kv_cache_manager.num_free_blocks == engine.kv_cache_manager.num_blocks
    out = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    assert len(out) == 1 and len(out[0].outputs[0].token_ids) == 4


@pytest.mark.timeout(180)
def test_library_prompts_of_every_documented_form_and_wrong_ones():
    """vLLM's prompt dicts give the same tokens as the keyword forms; anything else is an error naming
    the argument (not a TypeError, nor a dict read as the text of its key)."""
    llm = LLM(max_model_len=128, kv_cache_space=0.2)
    greedy = SamplingParams(temperature=0, max_tokens=4)
    ids = llm.get_tokenizer().encode("The capital of France is")
    by_keyword = llm.generate(prompt_token_ids=[ids], sampling_params=greedy, use_tqdm=False)[0].outputs[0].token_ids
    assert llm.generate({"prompt_token_ids": ids}, greedy, use_tqdm=False)[0].outputs[0].token_ids == by_keyword
    assert llm.generate(prompt_token_ids=ids, sampling_params=greedy, use_tqdm=False)[0].outputs[0].token_ids \
        == by_keyword  # one flat list is one prompt
    text = llm.generate([{"prompt": "The capital of France is"}], greedy, use_tqdm=False)[0].outputs[0]
    assert text.token_ids == llm.generate("The capital of France is", greedy, use_tqdm=False)[0].outputs[0].token_ids
    for call, param in ((lambda: llm.generate(5), "prompts"), (lambda: llm.generate(None), "prompts"),
                        (lambda: llm.generate([3.5]), "prompts"), (lambda: llm.generate({"text": "x"}), "prompts"),
                        (lambda: llm.generate("a", {"max_tokens": 2}), "sampling_params"),
                        (lambda: llm.generate(prompt_token_ids=[["a"]]), "prompt_token_ids"),
                        (lambda: llm.generate({"prompt_token_ids": [10**6]}, greedy), "prompt"),
                        (lambda: llm.chat([{"role": "wizard", "content": "hi"}]), "messages"),
                        (lambda: llm.chat([{"role": "user"}]), "messages"),
                        (lambda: llm.chat("hi"), "messages"),
                        (lambda: llm.generate("a\ud800", greedy), "prompt"),  # a lone surrogate is not text
                        (lambda: llm.chat([{"role": "user", "content": "a\ud800"}], greedy), "messages")):
        with pytest.raises(InvalidRequestError) as info:
            call()
        assert info.value.param == param, info.value
    assert not llm.llm_engine.has_unfinished_requests()
