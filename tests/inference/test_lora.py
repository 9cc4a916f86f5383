"""LoRA adapters on the packaged SmolLM2 (CPU, float32): greedy tokens equal transformers + peft's for
requests of two adapters and of the base model mixed in one batch; one slot shared by two adapters
(LRU eviction); prefix-cache blocks never shared between adapters; bad adapters refused cleanly."""
from __future__ import annotations

import json
import re
import shutil

import pytest
import torch

from inference import LLM, EngineArgs, InvalidRequestError, LoRARequest, SamplingParams
from inference.kv_cache.block_hash import hash_block_tokens

from .conftest import _packaged_gguf
from .lora_adapters import two_adapters_with_reference

NUM_TOKENS = 16
ENGINE = dict(enable_lora=True, max_lora_rank=16, max_model_len=256, kv_cache_space=0.25)


@pytest.fixture(scope="module")
def adapters(tmp_path_factory, test_prompts):
    """Two adapters, ``a`` (rank 8, every projection) and ``b`` (rank 16, rsLoRA, five projections), their
    folders, and the reference greedy tokens of the first three test prompts: base, ``a`` and ``b``."""
    from transformers import AutoModelForCausalLM
    folder = tmp_path_factory.mktemp("lora")
    gguf = _packaged_gguf()
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()
    prompts = test_prompts[:3]
    reference, requests = two_adapters_with_reference(model, folder, prompts, NUM_TOKENS)
    return dict(folder=folder, prompts=prompts, reference=reference, requests=requests)


def _greedy(llm: LLM, prompts, lora_requests):
    params = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True)
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False, lora_request=lora_requests)
    return [o.outputs[0].token_ids for o in outs]


def _mixed(adapters, names):
    """Every prompt under every adapter name of ``names``, interleaved, with the expected tokens."""
    prompts, loras, expected = [], [], []
    for i, prompt in enumerate(adapters["prompts"]):
        for name in names:
            prompts.append(prompt)
            loras.append(adapters["requests"][name])
            expected.append(adapters["reference"][name][i])
    return prompts, loras, expected


def _assert_no_leak(llm: LLM) -> None:
    kv = llm.llm_engine.kv_cache_manager
    assert kv.num_free_blocks == kv.num_blocks and not llm.llm_engine.has_unfinished_requests()


@pytest.mark.timeout(900)
@pytest.mark.parametrize("engine_kwargs", [
    dict(),                                    # all in one batch
    dict(max_num_batched_tokens=16),           # chunked prefill, chunks of 16 over the adapters' rows
    dict(num_scheduler_steps=4),               # multi-step decode windows
], ids=["batched", "chunk16", "multi-step"])
def test_mixed_adapters_and_base_match_transformers_peft(adapters, engine_kwargs):
    llm = LLM(max_loras=2, **ENGINE, **engine_kwargs)
    prompts, loras, expected = _mixed(adapters, [None, "a", "b"])
    assert _greedy(llm, prompts, loras) == expected
    assert llm.llm_engine.list_loras() == {1, 2}
    _assert_no_leak(llm)


@pytest.mark.timeout(900)
def test_one_slot_two_adapters_lru_eviction(adapters):
    """max_loras=1: the two adapters never run in one step, both complete with the right tokens; with
    max_cpu_loras=1 each load evicts the other from host memory."""
    llm = LLM(max_loras=1, max_cpu_loras=1, **ENGINE)
    engine = llm.llm_engine
    prompts, loras, expected = _mixed(adapters, ["a", "b", None])
    params = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True)
    for i, (prompt, lora) in enumerate(zip(prompts, loras)):
        engine.add_request(str(i), prompt, params, lora_request=lora)
    assert engine.list_loras() == {2}  # b's load evicted a
    tokens: dict[str, list[int]] = {}
    seen_running, seen_waiting = set(), set()
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.outputs[0].token_ids)
        stats = engine.get_stats()
        assert len(stats.lora_running_adapters) <= 1 and stats.max_lora == 1
        seen_running.update(stats.lora_running_adapters)
        seen_waiting.update(stats.lora_waiting_adapters)
    assert [tokens[str(i)] for i in range(len(prompts))] == expected
    assert seen_running == {"a", "b"} and seen_waiting  # one adapter waited while the other ran
    assert list(engine.scheduler.lora_slots.resident().values()) == [0]  # the one slot, holding the last adapter
    _assert_no_leak(llm)


@pytest.mark.timeout(900)
def test_prefix_cache_blocks_are_never_shared_between_adapters(adapters):
    llm = LLM(max_loras=2, **ENGINE)
    kv = llm.llm_engine.kv_cache_manager
    prompt = adapters["prompts"][1] * 3  # several full blocks
    a, b = adapters["requests"]["a"], adapters["requests"]["b"]
    first = _greedy(llm, [prompt], [a])
    hits = kv.prefix_cache_hits
    assert _greedy(llm, [prompt], [b]) != first and kv.prefix_cache_hits == hits  # b found none of a's blocks
    assert _greedy(llm, [prompt], None) not in (first,) and kv.prefix_cache_hits == hits  # nor did the base model
    assert _greedy(llm, [prompt], [a]) == first and kv.prefix_cache_hits > hits  # a found its own
    assert hash_block_tokens(None, [1, 2], lora_key="x") != hash_block_tokens(None, [1, 2])


@pytest.mark.timeout(900)
def test_bad_adapters_are_refused_and_change_nothing(adapters, tmp_path):
    llm = LLM(max_loras=1, max_cpu_loras=2, **{**ENGINE, "max_lora_rank": 8})
    engine = llm.llm_engine
    good = adapters["requests"]["a"]
    params = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True)
    engine.add_request("good", adapters["prompts"][0], params, lora_request=good)

    def bad(path, name="bad", lora_id=9):
        return LoRARequest(name, lora_id, str(path))

    malformed = tmp_path / "malformed"
    shutil.copytree(adapters["folder"] / "a", malformed)
    (malformed / "adapter_config.json").write_text("{not json")
    other_targets = tmp_path / "embed"
    shutil.copytree(adapters["folder"] / "a", other_targets)
    config = json.loads((other_targets / "adapter_config.json").read_text())
    (other_targets / "adapter_config.json").write_text(json.dumps({**config, "target_modules": ["embed_tokens"]}))
    wrong_shape = tmp_path / "wide"
    shutil.copytree(adapters["folder"] / "a", wrong_shape)
    from safetensors.torch import load_file, save_file
    weights = load_file(wrong_shape / "adapter_model.safetensors")
    key = next(k for k in weights if "q_proj.lora_A" in k)
    weights[key] = torch.zeros(8, 1024)
    save_file(weights, wrong_shape / "adapter_model.safetensors")
    not_finite = tmp_path / "nan"
    shutil.copytree(adapters["folder"] / "a", not_finite)
    weights = load_file(not_finite / "adapter_model.safetensors")
    key_b = next(k for k in sorted(weights) if "lora_B" in k)
    weights[key_b] = torch.full_like(weights[key_b], float("nan"))
    save_file(weights, not_finite / "adapter_model.safetensors")
    (tmp_path / "a-file").write_text("{}")
    nan_alpha = tmp_path / "nan-alpha"
    shutil.copytree(adapters["folder"] / "a", nan_alpha)
    (nan_alpha / "adapter_config.json").write_text(json.dumps({**config, "lora_alpha": float("nan")}))
    some_layers = tmp_path / "some-layers"  # PEFT would apply it to layer 0 only
    shutil.copytree(adapters["folder"] / "a", some_layers)
    (some_layers / "adapter_config.json").write_text(json.dumps({**config, "layers_to_transform": [0]}))
    rank_says_4 = tmp_path / "rank-says-4"
    shutil.copytree(adapters["folder"] / "a", rank_says_4)
    (rank_says_4 / "adapter_config.json").write_text(json.dumps({**config, "r": 4}))
    cases = [(bad(tmp_path / "missing"), "lora_path", "no such folder"),
             (bad(tmp_path / "a-file"), "lora_path", "a file, not a folder"),
             (bad(malformed), "lora_path", "not valid JSON"),
             (adapters["requests"]["b"], "max_lora_rank", "r=16 is above max_lora_rank=8"),
             (bad(other_targets), "target_modules", "embed_tokens"),
             (bad(wrong_shape), "lora_path", "the base model needs (8, 576)"),
             (bad(rank_says_4), "lora_path", "has rank 8; adapter_config.json says r=4"),
             (bad(not_finite), "lora_path", f"tensor {key_b!r} holds NaN or infinite values"),
             (bad(nan_alpha), "lora_path", "a finite number 'lora_alpha'; got r=8, lora_alpha=nan"),
             (bad(some_layers), "lora_path", "layers_to_transform is not supported"),
             (LoRARequest("a-elsewhere", 1, str(malformed)), "lora_int_id", "remove it first")]
    for request, param, message in cases:
        for call in (lambda: engine.add_lora(request),
                     lambda: engine.add_request("x", adapters["prompts"][0], params, lora_request=request)):
            with pytest.raises(InvalidRequestError, match=re.escape(message)) as info:
                call()
            assert info.value.param == param
    with pytest.raises(InvalidRequestError) as info:
        LoRARequest("zero", 0, str(malformed))
    assert info.value.param == "lora_int_id"
    assert engine.list_loras() == {1} and engine.get_num_unfinished_requests() == 1
    assert engine.scheduler.lora_slots.resident() == {}
    tokens = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens.extend(out.outputs[0].token_ids)
    assert tokens == adapters["reference"]["a"][0]  # the good request went on


def test_an_adapter_beyond_the_model_dtypes_range_is_refused(adapters, tmp_path, smollm2_dir):
    """A lora_B whose scaled values overflow float16 would turn into inf in a float16 model's slots, and every
    row of a decode batch meets every slot's B: refused for float16, loaded for float32."""
    from safetensors.torch import load_file, save_file

    from inference.lora.checkpoint import load_adapter
    from inference.model_loader import load_hf_config

    big = tmp_path / "big"
    shutil.copytree(adapters["folder"] / "a", big)
    weights = load_file(big / "adapter_model.safetensors")
    key = next(k for k in sorted(weights) if "lora_B" in k)
    weights[key][0, 0] = 70000.0 / json.loads((big / "adapter_config.json").read_text())["lora_alpha"] * 8
    save_file(weights, big / "adapter_model.safetensors")
    hf_config = load_hf_config(smollm2_dir)
    request = LoRARequest("big", 3, str(big))
    with pytest.raises(InvalidRequestError, match=re.escape(f"tensor {key!r} holds values beyond float16's range")):
        load_adapter(request, hf_config, 16, torch.float16)
    assert load_adapter(request, hf_config, 16, torch.float32).rank == 8


def test_tensors_of_modules_the_config_does_not_target_are_not_applied(adapters, tmp_path):
    """As PEFT: an adapter file holding every projection's tensors, whose config targets only q_proj and v_proj,
    changes only those two (PEFT makes LoRA layers for the targets alone and ignores the other tensors)."""
    from inference.lora.checkpoint import load_adapter
    from inference.model_loader.hf_config import load_hf_config
    from inference.model_loader.sources import resolve_model

    folder = tmp_path / "q-v-only"
    shutil.copytree(adapters["folder"] / "a", folder)
    config = json.loads((folder / "adapter_config.json").read_text())
    (folder / "adapter_config.json").write_text(json.dumps({**config, "target_modules": ["q_proj", "v_proj"]}))
    hf_config = load_hf_config(resolve_model("smollm2-135m-instruct").model_dir)
    every = load_adapter(adapters["requests"]["a"], hf_config, 16)
    q_v = load_adapter(LoRARequest("q-v", 5, str(folder)), hf_config, 16)
    assert {module for _, module in every.weights} > {"q_proj", "v_proj"}
    assert {module for _, module in q_v.weights} == {"q_proj", "v_proj"}
    assert all(torch.equal(q_v.weights[k][0], every.weights[k][0]) for k in q_v.weights)


@pytest.mark.timeout(900)
def test_add_remove_list_loras_and_start_up_modules(adapters):
    folder = adapters["folder"]
    llm = LLM(max_loras=1, max_cpu_loras=2, lora_modules=[f"a={folder / 'a'}", json.dumps(
        {"name": "b", "path": str(folder / "b"), "base_model_name": "smollm2-135m-instruct"})], **ENGINE)
    engine = llm.llm_engine
    assert engine.list_loras() == {1, 2}
    assert [r.lora_name for r in engine.lora_registry.requests()] == ["a", "b"]
    assert engine.remove_lora(1) and not engine.remove_lora(1) and engine.list_loras() == {2}
    assert engine.add_lora(adapters["requests"]["a"]) and not engine.add_lora(adapters["requests"]["a"])
    prompts, loras, expected = _mixed(adapters, ["b"])
    assert _greedy(llm, prompts[:1], loras[:1]) == expected[:1]
    with pytest.raises(InvalidRequestError) as info:
        LLM(**ENGINE, lora_modules=[f"a={folder / 'missing'}"])
    assert info.value.param == "lora_path"


def test_lora_flags_are_checked():
    with pytest.raises(InvalidRequestError) as info:
        EngineArgs(lora_modules=["a=/x"]).create_engine_config()
    assert info.value.param == "enable_lora"
    for kwargs, param in [(dict(max_loras=0), "max_loras"), (dict(max_lora_rank=1024), "max_lora_rank"),
                          (dict(max_loras=2, max_cpu_loras=1), "max_cpu_loras"),
                          (dict(lora_modules=["no-equals-sign"]), "lora_modules"),
                          (dict(lora_modules=['{"name": "a"}']), "lora_modules"),
                          (dict(lora_modules=["a=/x", "a=/y"]), "lora_modules"),
                          (dict(lora_modules=["smollm2-135m-instruct=/x"]), "lora_modules"),  # the model's name
                          (dict(lora_modules=['{"name": "b", "path": "/y", "base_model_name": "other"}']),
                           "lora_modules")]:
        with pytest.raises(InvalidRequestError) as info:
            EngineArgs(enable_lora=True, **kwargs).create_engine_config()
        assert info.value.param == param, kwargs
    config = EngineArgs(enable_lora=True, max_loras=2, lora_modules=[
                            "a=/x", '{"name": "b", "path": "/y", "base_model_name": "smollm2-135m-instruct"}'],
                        max_model_len=256).create_engine_config()
    assert config.lora.max_cpu_loras == 2
    assert [(m.lora_name, m.lora_int_id, m.lora_path) for m in config.lora.modules] == [("a", 1, "/x"), ("b", 2, "/y")]
    with pytest.raises(InvalidRequestError) as info:
        LLM(max_model_len=256, kv_cache_space=0.1).generate("Hi", lora_request=LoRARequest("a", 1, "/x"))
    assert info.value.param == "lora_request"
