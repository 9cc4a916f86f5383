"""SmolLM2 quantized by ``inference.quantization.quantize`` (what ``manage.py quantize`` runs), loaded by
the engine: perplexity on the shipped sample, and greedy tokens against transformers.

transformers loads AWQ/GPTQ checkpoints only through GPTQModel, which cannot be installed next to this
project's CPU torch pin; the transformers side therefore runs the SAME checkpoint's weights dequantized
by the reference (``dequantize_checkpoint``), which checks the engine's reading of the format and its
quantized forward pass, not GPTQModel's kernels.
"""
from __future__ import annotations

import contextlib

import pytest
import torch

from inference import LLM, SamplingParams
from inference.quantization.perplexity import perplexity, perplexity_tokens
from inference.quantization.quantize import CalibrationConfig, dequantize_checkpoint, quantize_model

from .conftest import hf_greedy

# Small calibration sets and a coarser AWQ grid keep CI quick (about 4 s per layer on a busy 2-core machine).
KINDS = {"awq": dict(method="awq", calibration=CalibrationConfig(num_samples=4, seq_len=128, awq_grid=10)),
         "gptq_act_order": dict(method="gptq", desc_act=True, calibration=CalibrationConfig(num_samples=8, seq_len=128)),
         # manage.py quantize's GPTQ default
         "gptq_static_groups": dict(method="gptq", desc_act=True, static_groups=True,
                                    calibration=CalibrationConfig(num_samples=8, seq_len=128))}
ENGINE = dict(max_model_len=1024, kv_cache_space=0.25, max_num_seqs=8)


@contextlib.contextmanager
def _one_thread():
    """GPTQ's column loop is thousands of small ops, far faster on one thread of a shared CPU."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def quantized(tmp_path_factory):
    """kind -> (quantized checkpoint dir, engine on it)."""
    result = {}
    for kind, kwargs in KINDS.items():
        folder = tmp_path_factory.mktemp(kind)
        with _one_thread():
            quantize_model("smollm2-135m-instruct", folder, **kwargs)
        result[kind] = (folder, LLM(model=str(folder), **ENGINE))
    return result


@pytest.fixture(scope="module")
def baseline_perplexity():
    llm = LLM(model="smollm2-135m-instruct", **ENGINE)
    return perplexity(llm, perplexity_tokens(llm.get_tokenizer()))


def test_quantized_checkpoint_has_the_published_format(quantized):
    import json
    from safetensors import safe_open
    folder, llm = quantized["gptq_act_order"]
    config = json.loads((folder / "config.json").read_text())["quantization_config"]
    assert config | {"group_size": 64, "desc_act": True} == config and config["quant_method"] == "gptq"
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        qweight = f.get_tensor("model.layers.0.mlp.down_proj.qweight")
        assert qweight.dtype == torch.int32 and tuple(qweight.shape) == (1536 // 8, 576)
        assert tuple(f.get_tensor("model.layers.0.mlp.down_proj.qzeros").shape) == (1536 // 64, 576 // 8)
        assert f.get_tensor("model.layers.0.mlp.down_proj.scales").dtype == torch.float16
    folder, llm = quantized["gptq_static_groups"]  # act-order, but groups of consecutive rows: no permutation
    config = json.loads((folder / "config.json").read_text())["quantization_config"]
    assert config["desc_act"] and config["static_groups"]
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        g_idx = f.get_tensor("model.layers.0.mlp.down_proj.g_idx")
        assert torch.equal(g_idx, torch.arange(1536, dtype=torch.int32) // 64)
    model = llm.llm_engine.runner.model
    assert all(getattr(m, "perm", None) is None for m in model.modules())
    folder, llm = quantized["awq"]
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        assert tuple(f.get_tensor("model.layers.0.mlp.down_proj.qweight").shape) == (1536, 576 // 8)
    assert llm.llm_engine.config.quantization == "awq"  # detected from config.json


# The issue asks for 5%; the packaged SmolLM2 cannot get there at 4 bits: it is itself a Q4_1 GGUF whose
# fractional zero points AWQ/GPTQ cannot store (test_quantization_quality.py, docs/quantization.md).
# Measured on the shipped sample (unquantized 20.15): plain round-to-nearest g64 32.68 (1.62x), g32 30.76
# (1.53x); AWQ g64 with this test's calibration 29.36 (1.46x); GPTQ g64 act-order 26.22 (1.30x). On another
# machine (2026-12-01), the same code, also the commit that landed on 2026-11-30, gave AWQ 28.99 (1.44x) and
# GPTQ act-order 28.47 (1.41x): the Q4_1 source puts many weights on rounding midpoints of the new grid, so
# (likely) the floating-point order of one CPU or another flips whole groups of roundings. These bounds guard against
# regressions only, below plain round-to-nearest (1.53x-1.62x); see docs/quantization.md for the figures.
# GPTQ with static groups: 32.08 (1.59x) at quantize's defaults, against 34.21 (1.70x) for round-to-nearest in
# the same symmetric format (quantization-quality_cpu_2026-12-05.json).
MAX_PERPLEXITY_RATIO = {"awq": 1.50, "gptq_act_order": 1.50, "gptq_static_groups": 1.68}


@pytest.mark.parametrize("kind", list(KINDS))
def test_perplexity_stays_near_the_unquantized_model(quantized, baseline_perplexity, kind):
    folder, llm = quantized[kind]
    tokens = perplexity_tokens(llm.get_tokenizer())
    assert len(tokens) >= 2000
    value = perplexity(llm, tokens)
    print(f"{kind}: perplexity {value:.3f} vs {baseline_perplexity:.3f} unquantized ({value / baseline_perplexity:.4f}x)")
    assert value <= baseline_perplexity * MAX_PERPLEXITY_RATIO[kind]


@pytest.mark.parametrize("kind", list(KINDS))
def test_greedy_tokens_match_transformers_on_the_same_weights(quantized, test_prompts, tmp_path, kind):
    from transformers import AutoModelForCausalLM
    folder, llm = quantized[kind]
    hf = AutoModelForCausalLM.from_pretrained(str(dequantize_checkpoint(folder, tmp_path / "dequantized")),
                                              dtype=torch.float32).eval()
    prompts = test_prompts[:4]
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    outputs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    for prompt, output in zip(prompts, outputs):
        assert output.outputs[0].token_ids == hf_greedy(hf, prompt, 32)
