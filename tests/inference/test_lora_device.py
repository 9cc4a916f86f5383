"""LoRA on a GPU: the Triton shrink/expand kernels inside the whole engine, with CUDA graphs, give transformers +
peft's greedy tokens for requests of two adapters and of the base model in one batch; and the graphs give the
eager engine's tokens when the adapters of the batch change between steps (their indices are graph inputs).

On the CPU the LoRA layers run the PyTorch reference, which ``test_lora.py`` checks on the packaged model;
these tests need a CUDA device (the packaged GGUF is too large to carry to the GPU host: a tiny random model)."""
from __future__ import annotations

import random

import pytest
import torch

from .triton_interpreter import HAS_CUDA

pytestmark = pytest.mark.skipif(not HAS_CUDA, reason="the LoRA kernels inside the engine on a CUDA device")

from inference import LLM, SamplingParams  # noqa: E402

from .conftest import free_device_memory, make_tiny_model  # noqa: E402
from .lora_adapters import two_adapters_with_reference  # noqa: E402

NUM_TOKENS = 12


@pytest.fixture(scope="module")
def tiny_with_adapters(tmp_path_factory, smollm2_tokenizer):
    """A tiny Llama, adapters ``a`` (rank 8, all projections) and ``b`` (rank 16, rsLoRA, five projections),
    four prompts and transformers + peft's greedy tokens for each prompt under the base model, ``a`` and ``b``."""
    from transformers import AutoModelForCausalLM
    folder = tmp_path_factory.mktemp("lora-device")
    model_dir = make_tiny_model("llama", folder / "model", smollm2_tokenizer, hidden_size=128, intermediate_size=256)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    rng = random.Random(5)
    prompts = [[rng.randrange(100, 40000) for _ in range(rng.randint(5, 60))] for _ in range(4)]
    reference, requests = two_adapters_with_reference(model, folder, prompts, NUM_TOKENS, b_std=0.2)
    return dict(model=str(model_dir), prompts=prompts, reference=reference, requests=requests)


def _engine(model: str, dtype: str, **kwargs) -> LLM:
    return LLM(model=model, device="cuda", dtype=dtype, max_model_len=128, block_size=16, enable_lora=True,
               max_lora_rank=16, gpu_memory_utilization=0.3, **kwargs)


def _generate(llm: LLM, prompts, loras) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True)
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False, lora_request=loras)
    return [o.outputs[0].token_ids for o in outs]


def _check_and_close(llm: LLM) -> None:
    """No KV block left allocated; the engine shut down (the caller drops its reference, then frees memory)."""
    kv = llm.llm_engine.kv_cache_manager
    assert kv.num_free_blocks == kv.num_blocks
    llm.close()


@pytest.mark.timeout(600)
@pytest.mark.parametrize("engine_kwargs", [dict(), dict(max_num_batched_tokens=32), dict(max_loras=1)],
                         ids=["graphs", "chunked-prefill", "one-slot"])
def test_mixed_adapters_on_device_match_transformers_peft(tiny_with_adapters, engine_kwargs):
    data = tiny_with_adapters
    prompts, loras, expected = [], [], []
    for i, prompt in enumerate(data["prompts"]):
        for name in (None, "a", "b"):
            prompts.append(prompt)
            loras.append(data["requests"][name])
            expected.append(data["reference"][name][i])
    llm = _engine(data["model"], "float32", **engine_kwargs)
    tokens = _generate(llm, prompts, loras)
    _check_and_close(llm)
    del llm
    free_device_memory()
    assert tokens == expected


@pytest.mark.timeout(600)
def test_cuda_graphs_give_eager_tokens_as_the_batch_s_adapters_change(tiny_with_adapters):
    """bf16, decode batches whose rows change adapter as requests finish at different lengths."""
    data = tiny_with_adapters
    names = [None, "a", "b", "a", "b", None, "b", "a"]
    prompts = [data["prompts"][i % 4] for i in range(len(names))]
    loras = [data["requests"][n] for n in names]
    lengths = [4 + 3 * i for i in range(len(names))]
    tokens = {}
    for eager in (True, False):
        llm = _engine(data["model"], "bfloat16", enforce_eager=eager)
        params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lengths]
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False, lora_request=loras)
        tokens[eager] = [o.outputs[0].token_ids for o in outs]
        _check_and_close(llm)
        del llm, outs
        free_device_memory()
    assert tokens[False] == tokens[True]
