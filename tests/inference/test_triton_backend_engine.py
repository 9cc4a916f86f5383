"""The whole engine on the Triton attention backend gives transformers' greedy tokens.

On the CPU the kernels run in Triton's interpreter, on a tiny model; on a GPU the same test
runs compiled."""
from __future__ import annotations

import random

import pytest
import torch

from .triton_interpreter import HAS_CUDA  # noqa: F401  (sets TRITON_INTERPRET=1 without a GPU)

pytest.importorskip("triton")

from inference import LLM, SamplingParams  # noqa: E402

from .conftest import free_device_memory, hf_greedy, make_tiny_model  # noqa: E402


@pytest.mark.timeout(600)
@pytest.mark.parametrize("kind,num_scheduler_steps", [("llama", 1), ("qwen3", 1), ("llama", 4)],
                         ids=["llama", "qwen3", "llama-multi-step"])
def test_triton_backend_matches_transformers(kind, num_scheduler_steps, tmp_path, smollm2_tokenizer):
    from transformers import AutoModelForCausalLM
    folder = make_tiny_model(kind, tmp_path / kind, smollm2_tokenizer)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    rng = random.Random(3)
    prompts = [[rng.randrange(100, 40000) for _ in range(rng.randint(5, 40))] for _ in range(4)]
    expected = [hf_greedy(hf, p, 12) for p in prompts]
    device = "cuda" if HAS_CUDA else "cpu"
    memory = dict(gpu_memory_utilization=0.3) if HAS_CUDA else dict(kv_cache_space=0.05)
    llm = LLM(model=str(folder), max_model_len=128, max_num_batched_tokens=32, attention_backend="triton",
              device=device, dtype="float32", block_size=16, num_scheduler_steps=num_scheduler_steps, **memory)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected
    if num_scheduler_steps > 1:  # decode windows: slots and lengths advanced on the device
        assert llm.llm_engine.num_multi_step_windows > 0
    kv = llm.llm_engine.kv_cache_manager
    assert kv.num_free_blocks == kv.num_blocks
    llm.close()
    del llm, kv
    free_device_memory()
