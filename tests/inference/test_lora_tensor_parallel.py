"""LoRA under tensor parallelism on CPU ranks (gloo): a tiny random Qwen2 split over two ranks (column-
parallel layers keep their rows of B, row-parallel ones their columns of A) gives the greedy tokens of
transformers + peft, for adapter and base requests mixed in one batch, with steps scheduled ahead."""
from __future__ import annotations

import random

import pytest
import torch

from inference import LLM, LoRARequest, SamplingParams

from .conftest import hf_greedy, make_tiny_model
from .lora_adapters import ALL_TARGETS, make_peft_adapter

NUM_TOKENS = 16


@pytest.mark.timeout(600)
def test_tiny_qwen2_tp2_lora_matches_transformers_peft(tmp_path, smollm2_tokenizer):
    from transformers import AutoModelForCausalLM
    folder = make_tiny_model("qwen2", tmp_path / "qwen2", smollm2_tokenizer)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 40000) for _ in range(rng.randint(3, 40))] for _ in range(3)]
    base = [hf_greedy(model, p, NUM_TOKENS) for p in prompts]
    peft_model = make_peft_adapter(model, tmp_path / "adapter", r=8, alpha=16, targets=ALL_TARGETS, seed=3,
                                   b_std=0.3)
    tuned = [hf_greedy(peft_model, p, NUM_TOKENS) for p in prompts]
    assert tuned != base
    lora = LoRARequest("tuned", 1, str(tmp_path / "adapter"))
    params = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True)
    with LLM(model=str(folder), tensor_parallel_size=2, enable_lora=True, max_lora_rank=8, async_scheduling=True,
             max_model_len=256, max_num_batched_tokens=32, kv_cache_space=0.05) as two:
        outs = two.generate(prompt_token_ids=prompts * 2, sampling_params=params, use_tqdm=False,
                            lora_request=[lora] * len(prompts) + [None] * len(prompts))
        assert two.llm_engine.num_steps_ahead > 0
    assert [o.outputs[0].token_ids for o in outs] == tuned + base
