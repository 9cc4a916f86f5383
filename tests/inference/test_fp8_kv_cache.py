"""FP8 KV cache (``kv_cache_dtype="fp8"``) on the CPU path, on the packaged SmolLM2 (float32 compute):
the same memory holds four times the tokens of a float32 cache; the per-layer scales come from the
checkpoint, a calibration prefill at start-up, or 1.0; greedy outputs against a float cache and
perplexity with the context read back from the FP8 cache; prefix caching, swapping and tensor-parallel
ranks give the FP8 engine's own tokens; an unknown value names the parameter."""
from __future__ import annotations

import math

import pytest
import torch

from safetensors.torch import load_file, save_file

from inference import LLM, InvalidRequestError, ModelLoadError, SamplingParams
from inference.attention.kv_quant import FP8_MAX, dequantize, quantize
from inference.quantization.perplexity import perplexity_tokens

NUM_TOKENS = 32
ARGS = dict(max_model_len=512, kv_cache_space=0.05)


@pytest.fixture(scope="module")
def engines():
    return LLM(**ARGS), LLM(kv_cache_dtype="fp8", **ARGS)


def _greedy(llm: LLM, prompts, max_tokens: int = NUM_TOKENS, n: int = 1) -> list[list[list[int]]]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, n=n)
    return [[list(o.token_ids) for o in r.outputs]
            for r in llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)]


def test_the_same_memory_holds_four_times_the_tokens(engines):
    full, fp8 = engines
    assert full.llm_engine.runner.kv_caches[0].dtype == torch.float32
    assert fp8.llm_engine.runner.kv_caches[0].dtype == torch.float8_e4m3fn
    assert fp8.llm_engine.runner.bytes_per_block * 4 == full.llm_engine.runner.bytes_per_block
    assert fp8.llm_engine.runner.num_blocks >= 4 * full.llm_engine.runner.num_blocks - 1


def _scales(llm: LLM) -> list[tuple[float, float]]:
    model = llm.llm_engine.runner.model
    return [(m.k_scale, m.v_scale) for m in model.modules() if hasattr(m, "kv_amax")]


def test_scales_are_calibrated_at_start_up_unless_turned_off(engines):
    """Without scales in the checkpoint, each layer's come from a calibration prefill: the largest key and
    value magnitudes map to e4m3's 448 (SmolLM2's are far below 448, so the scales are below 1); with
    ``calculate_kv_scales=False`` they are vLLM's 1.0."""
    scales = _scales(engines[1])
    assert len(scales) == 30 and all(0 < k < 1 and 0 < v < 1 for k, v in scales), scales
    assert len({k for k, _ in scales}) > 1  # per layer
    plain = LLM(kv_cache_dtype="fp8", calculate_kv_scales=False, **ARGS)
    assert all(s == (1.0, 1.0) for s in _scales(plain))


def test_checkpoint_scales_are_used_and_a_malformed_one_is_refused(tmp_path, smollm2_tokenizer):
    """llm-compressor's ``self_attn.k_scale`` / ``v_scale`` tensors set the layers' scales (no calibration);
    a scale that is not one positive number is an error naming the tensor."""
    from .conftest import make_tiny_model
    folder = make_tiny_model("llama", tmp_path / "m", smollm2_tokenizer)
    weights = load_file(folder / "model.safetensors")
    for layer in range(2):
        weights[f"model.layers.{layer}.self_attn.k_scale"] = torch.tensor(0.5 + layer)
        weights[f"model.layers.{layer}.self_attn.v_scale"] = torch.tensor([0.25])
    save_file(weights, folder / "model.safetensors")
    llm = LLM(model=str(folder), kv_cache_dtype="fp8", max_model_len=128, kv_cache_space=0.01)
    assert _scales(llm) == [(0.5, 0.25), (1.5, 0.25)]
    weights["model.layers.1.self_attn.v_scale"] = torch.tensor([0.25, 0.5])
    save_file(weights, folder / "model.safetensors")
    with pytest.raises(ModelLoadError, match=r"model\.layers\.1\.self_attn\.v_scale"):
        LLM(model=str(folder), kv_cache_dtype="fp8", max_model_len=128, kv_cache_space=0.01)


def test_conversion_saturates_and_round_trips_within_e4m3_precision():
    x = torch.tensor([0.3, -2.5, 100.0, 1000.0, -1000.0])
    stored = quantize(x, 2.0)
    assert stored.dtype == torch.float8_e4m3fn
    back = dequantize(stored, 2.0, torch.float32)
    assert torch.equal(back[3:], torch.tensor([FP8_MAX * 2, -FP8_MAX * 2]))  # clamped, not inf or nan
    assert torch.allclose(back[:3], x[:3], rtol=2 ** -4)  # 3 mantissa bits


def _prompt_logprobs(llm: LLM, tokens: list[int], chunk_len: int = 512) -> list[dict]:
    """Each scored position's logprobs of the true next token and the top one (prompt_logprobs=1)."""
    chunks = [tokens[i:i + chunk_len] for i in range(0, len(tokens), chunk_len)]
    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1)
    outputs = llm.generate(prompt_token_ids=chunks, sampling_params=params, use_tqdm=False)
    return [{t: lp.logprob for t, lp in entry.items()} for o in outputs for entry in o.prompt_logprobs[1:]]


@pytest.mark.timeout(900)
def test_perplexity_and_next_tokens_with_the_context_read_from_the_fp8_cache(smollm2_tokenizer):
    """2,048 tokens of the shipped perplexity text (not the calibration text), prefilled in 64-token chunks
    so that every token attends to keys and values as stored: the perplexity within 3% of the float cache's
    and the most likely next token the float cache's at 90% of positions or more. Measured with the
    calibrated scales: 20.60 against 20.15 (+2.2%) and 92.9%; the perplexity moved between -0.4% and +2.2%
    with small changes to the calibration prompts, and is +2.3% with 1.0 scales (docs/quantization.md):
    e4m3's 3 mantissa bits, not the scales, set most of the loss on this 135M model."""
    tokens = perplexity_tokens(smollm2_tokenizer)[:2048]
    kwargs = dict(max_model_len=1024, kv_cache_space=0.1, max_num_batched_tokens=64, enable_prefix_caching=False)
    full = _prompt_logprobs(LLM(**kwargs), tokens)
    fp8 = _prompt_logprobs(LLM(kv_cache_dtype="fp8", **kwargs), tokens)
    targets = [t for chunk in (tokens[i:i + 512] for i in range(0, len(tokens), 512)) for t in chunk[1:]]
    ppl = [math.exp(-sum(e[t] for e, t in zip(run, targets)) / len(targets)) for run in (full, fp8)]
    assert abs(ppl[1] / ppl[0] - 1) <= 0.03, ppl
    top = [[max(e, key=e.get) for e in run] for run in (full, fp8)]
    agreement = sum(a == b for a, b in zip(*top)) / len(targets)
    print(f"perplexity {ppl}, next-token agreement {agreement:.4f}")
    assert agreement >= 0.9, agreement


NEAR_TIE = 0.5  # nats: a token this close to the reference's best is a near-tie, not a wrong read


def _greedy_under(reference: LLM, prompts, outputs) -> float:
    """How far ``outputs`` (one list of tokens per prompt) are from greedy under ``reference``, teacher-forced
    on themselves: the largest gap, in nats, between the reference's best next token and the token chosen.

    Exact token equality across two ways of running an FP8 cache is not a property of the CPU path: a
    batch of another shape takes another GEMM kernel, whose last-bit differences e4m3 rounding can turn
    into a step of 6% in a key, and a near-tie then flips. A cache read wrongly (a block's bytes lost,
    a wrong scale) gives gaps of several nats."""
    sequences = [list(p) + list(o) for p, o in zip(prompts, outputs)]
    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1)
    scored = reference.generate(prompt_token_ids=sequences, sampling_params=params, use_tqdm=False)
    worst = 0.0
    for prompt, sequence, result in zip(prompts, sequences, scored):
        for position in range(len(prompt), len(sequence)):
            entry = result.prompt_logprobs[position]
            worst = max(worst, max(lp.logprob for lp in entry.values()) - entry[sequence[position]].logprob)
    return worst


def test_prefix_hits_and_swaps_read_the_fp8_cache(engines, test_prompts):
    """The same prompts again (their full blocks from the prefix cache), and in an engine that swaps blocks
    out and back in: the tokens are greedy under the FP8 engine, up to near-ties (``_greedy_under``)."""
    _, fp8 = engines
    prompts = test_prompts[:5]
    first = [o[0] for o in _greedy(fp8, prompts)]
    kv = fp8.llm_engine.kv_cache_manager
    hits = kv.prefix_cache_hits
    again = [o[0] for o in _greedy(fp8, prompts)]
    assert kv.prefix_cache_hits > hits
    small = LLM(kv_cache_dtype="fp8", max_model_len=128, num_kv_blocks=10, preemption_mode="swap", swap_space=0.01)
    swapped = [o[0] for o in _greedy(small, prompts)]
    assert small.llm_engine.kv_cache_manager.num_swapped_out_total > 0
    for outputs in (first, again, swapped):
        assert _greedy_under(fp8, prompts, outputs) < NEAR_TIE


@pytest.mark.timeout(600)
def test_tensor_parallel_ranks_store_and_read_fp8(engines, test_prompts):
    """Three CPU ranks, each storing its KV heads with the layer's scales measured over all ranks (the
    one-rank engine's scales): greedy under the one-rank FP8 engine, up to near-ties."""
    _, fp8 = engines
    prompts = test_prompts[:3]
    with LLM(kv_cache_dtype="fp8", tensor_parallel_size=3, **ARGS) as three:
        outputs = [o[0] for o in _greedy(three, prompts)]
        ranks_scales = _scales(three)
    flat = [x for pair in _scales(fp8) for x in pair]
    assert [x for pair in ranks_scales for x in pair] == pytest.approx(flat, rel=1e-3)  # sums in another order
    assert _greedy_under(fp8, prompts, outputs) < NEAR_TIE


def test_an_unknown_cache_dtype_names_the_parameter():
    with pytest.raises(InvalidRequestError, match="kv_cache_dtype must be one of auto, fp8, fp8_e4m3") as info:
        LLM(kv_cache_dtype="int8", **ARGS)
    assert info.value.param == "kv_cache_dtype"


def test_the_workers_cache_config_names_the_fp8_dtype(engines):
    """What a worker's heartbeat reports for ``/metrics``' ``vllm:cache_config_info``."""
    from webapp.serving.heartbeat_info import _cache_config

    full, fp8 = engines
    assert _cache_config(fp8.llm_engine)["cache_dtype"] == "fp8"
    assert _cache_config(full.llm_engine)["cache_dtype"] == "auto"
