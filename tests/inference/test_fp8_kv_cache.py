"""FP8 KV cache (``kv_cache_dtype="fp8"``) on the CPU path, on the packaged SmolLM2 (float32 compute):
the same memory holds four times the tokens of a float32 cache; greedy outputs against a float cache and
perplexity with the context read back from the FP8 cache; prefix caching, swapping and tensor-parallel
ranks give the FP8 engine's own tokens; an unknown value names the parameter."""
from __future__ import annotations

import pytest
import torch

from inference import LLM, InvalidRequestError, SamplingParams
from inference.attention.kv_quant import FP8_MAX, dequantize, quantize
from inference.quantization.perplexity import perplexity, perplexity_tokens

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


def test_conversion_saturates_and_round_trips_within_e4m3_precision():
    x = torch.tensor([0.3, -2.5, 100.0, 1000.0, -1000.0])
    stored = quantize(x, 2.0)
    assert stored.dtype == torch.float8_e4m3fn
    back = dequantize(stored, 2.0, torch.float32)
    assert torch.equal(back[3:], torch.tensor([FP8_MAX * 2, -FP8_MAX * 2]))  # clamped, not inf or nan
    assert torch.allclose(back[:3], x[:3], rtol=2 ** -4)  # 3 mantissa bits


@pytest.mark.timeout(900)
def test_greedy_outputs_against_a_float_cache(engines, test_prompts):
    """The 8 held prompts, 32 greedy tokens with ``ignore_eos``: the outputs agree with the float cache's
    for 5 to 32 tokens, 22 on average, and 3 are equal throughout (e4m3 keeps 3 mantissa bits of each key
    and value; measured: first differences at 32, 23, 7, 32, 5, 32, 18, 26)."""
    full, fp8 = engines
    expected, got = _greedy(full, test_prompts), _greedy(fp8, test_prompts)
    agree = [next((i for i, (a, b) in enumerate(zip(e[0], g[0])) if a != b), NUM_TOKENS)
             for e, g in zip(expected, got)]
    assert sum(a == NUM_TOKENS for a in agree) >= 2, agree
    assert min(agree) >= 4 and sum(agree) / len(agree) >= 16, agree


@pytest.mark.timeout(900)
def test_perplexity_with_the_context_read_from_the_fp8_cache(smollm2_tokenizer):
    """Prompts prefilled in 64-token chunks (every token attends to keys and values as stored): with the
    default scales (1.0) FP8 perplexity is within 3% of the float cache's (measured: 20.62 against 20.15,
    +2.3%; docs/quantization.md)."""
    tokens = perplexity_tokens(smollm2_tokenizer)[:2048]
    kwargs = dict(max_model_len=1024, kv_cache_space=0.1, max_num_batched_tokens=64, enable_prefix_caching=False)
    full = perplexity(LLM(**kwargs), tokens)
    fp8 = perplexity(LLM(kv_cache_dtype="fp8", **kwargs), tokens)
    assert abs(fp8 / full - 1) <= 0.03, (full, fp8)


@pytest.mark.timeout(900)
def test_prefix_hits_and_swaps_give_the_fp8_engines_tokens(engines, test_prompts):
    _, fp8 = engines
    prompts = test_prompts[:5]
    expected = _greedy(fp8, prompts)
    kv = fp8.llm_engine.kv_cache_manager
    hits = kv.prefix_cache_hits
    assert _greedy(fp8, prompts) == expected  # the prompts' full blocks now come from the prefix cache
    assert kv.prefix_cache_hits > hits
    small = LLM(kv_cache_dtype="fp8", max_model_len=128, num_kv_blocks=10, preemption_mode="swap", swap_space=0.01)
    assert _greedy(small, prompts) == expected
    assert small.llm_engine.kv_cache_manager.num_swapped_out_total > 0


@pytest.mark.timeout(600)
def test_tensor_parallel_ranks_store_and_read_fp8(engines, test_prompts):
    _, fp8 = engines
    prompts = test_prompts[:3]
    with LLM(kv_cache_dtype="fp8", tensor_parallel_size=3, **ARGS) as three:
        assert _greedy(three, prompts) == _greedy(fp8, prompts)


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
