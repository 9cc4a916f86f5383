"""Greedy decoding must be token-for-token identical to Hugging Face transformers (float32, CPU)."""
from __future__ import annotations

import random

import pytest
import torch

from inference import LLM, SamplingParams

from .conftest import hf_greedy, make_tiny_model

NUM_TOKENS = 64


@pytest.fixture(scope="module")
def reference(hf_smollm2, test_prompts):
    return [hf_greedy(hf_smollm2, p, NUM_TOKENS) for p in test_prompts]


@pytest.fixture(scope="module")
def filler_prompts():
    rng = random.Random(0)
    return [[rng.randrange(100, 40000) for _ in range(rng.randint(3, 90))] for _ in range(15)]


def _engine_greedy(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True)
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def _assert_no_leak(llm: LLM) -> None:
    kv = llm.llm_engine.kv_cache_manager
    assert kv.num_free_blocks == kv.num_blocks
    assert not llm.llm_engine.has_unfinished_requests()


@pytest.mark.timeout(600)
def test_smollm2_each_prompt_alone(reference, test_prompts):
    llm = LLM(max_model_len=512, kv_cache_space=0.5)
    for prompt, expected in zip(test_prompts, reference):
        assert _engine_greedy(llm, [prompt]) == [expected]
    _assert_no_leak(llm)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("engine_kwargs", [
    dict(),                                                  # batched with 15 others of different lengths
    dict(max_num_batched_tokens=16),                         # chunked prefill, chunk 16
    dict(max_num_batched_tokens=64),                         # chunked prefill, chunk 64
    dict(num_kv_blocks=24, max_model_len=256),               # forced preemption: room for ~3 sequences
    dict(enable_chunked_prefill=False, max_model_len=512),   # whole prompts only
    dict(num_scheduler_steps=8),                             # multi-step: 8 decode steps per host iteration
    dict(num_scheduler_steps=8, num_kv_blocks=24, max_model_len=256),  # multi-step windows and preemption
], ids=["batched", "chunk16", "chunk64", "preemption", "no-chunking", "multi-step", "multi-step-preemption"])
def test_smollm2_batched(reference, test_prompts, filler_prompts, engine_kwargs):
    kwargs = dict(max_model_len=512, kv_cache_space=0.5)
    kwargs.update(engine_kwargs)
    llm = LLM(**kwargs)
    prompts = test_prompts + filler_prompts[:8]  # 16 requests of different lengths
    got = _engine_greedy(llm, prompts)
    assert got[:len(reference)] == reference
    if "num_kv_blocks" in engine_kwargs:
        assert llm.llm_engine.scheduler.num_preemptions_total > 0
    if "num_scheduler_steps" in engine_kwargs:
        assert llm.llm_engine.num_multi_step_windows > 0
    _assert_no_leak(llm)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen2_tied", "qwen3", "mistral"])
def test_tiny_random_models(kind, tmp_path, smollm2_tokenizer, filler_prompts):
    from transformers import AutoModelForCausalLM
    folder = make_tiny_model(kind, tmp_path / kind, smollm2_tokenizer)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    prompts = filler_prompts[:6]
    expected = [hf_greedy(hf, p, 32) for p in prompts]
    llm = LLM(model=str(folder), max_model_len=256, max_num_batched_tokens=32, kv_cache_space=0.1)
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected
    _assert_no_leak(llm)
