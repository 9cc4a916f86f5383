"""Start-up refuses models and caches that cannot fit, with the numbers and the remedies."""
from __future__ import annotations

import pytest

from inference.errors import InvalidRequestError
from inference.runner.kv_sizing import GiB, check_weights_fit


def test_weights_larger_than_the_usable_memory_are_refused_with_numbers_and_remedies():
    # 15.2 GiB of bf16 weights, a 16 GiB card with 2 GiB used elsewhere, utilization 0.9
    with pytest.raises(InvalidRequestError) as info:
        check_weights_fit(int(15.2 * GiB), free_bytes=14 * GiB, total_bytes=16 * GiB, gpu_memory_utilization=0.9)
    message = str(info.value)
    assert info.value.param == "gpu_memory_utilization"
    assert "15.20 GiB" in message and "12.40 GiB" in message and "2.00 GiB already in use" in message
    for remedy in ("--quantization", "--tensor-parallel-size", "gpu_memory_utilization"):
        assert remedy in message


def test_weights_that_fit_pass():
    check_weights_fit(int(7.6 * GiB), free_bytes=140 * GiB, total_bytes=141 * GiB, gpu_memory_utilization=0.9)


def test_kv_cache_too_small_for_one_sequence_names_max_model_len(smollm2_dir):
    from inference import LLM
    with pytest.raises(InvalidRequestError) as info:
        LLM(str(smollm2_dir), max_model_len=8192, kv_cache_space=0.01)
    assert info.value.param == "max_model_len"
    assert "8192" in str(info.value) and "lower max_model_len" in str(info.value)
