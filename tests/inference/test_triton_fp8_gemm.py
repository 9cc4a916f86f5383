"""The Triton FP8 GEMM (row-wise scales, split-K) against the float32 product of its quantized operands.

Without a CUDA device the kernel runs in Triton's interpreter on small shapes; on the H200 the same tests
run on CUDA tensors.
"""
from __future__ import annotations

import pytest
import torch

from .triton_interpreter import HAS_CUDA  # noqa: E402  (sets TRITON_INTERPRET=1 without a GPU)

triton = pytest.importorskip("triton")

from inference.quantization.fp8 import quantize_fp8_rowwise  # noqa: E402
from inference.quantization.triton_fp8_gemm import Fp8GemmConfig, counters_size, fp8_gemm, splitk_gemm  # noqa: E402

DEVICE = "cuda" if HAS_CUDA else "cpu"


def _operands(M: int, K: int, N: int, seed: int):
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    x = torch.randn(M, K, generator=g, device=DEVICE) * torch.logspace(-2, 1, M, device=DEVICE)[:, None]
    w = torch.randn(N, K, generator=g, device=DEVICE) * 0.05
    a, a_scale = quantize_fp8_rowwise(x.to(torch.bfloat16))
    b, b_scale = quantize_fp8_rowwise(w.to(torch.bfloat16))
    return a, a_scale, b, b_scale.view(-1)


def _reference(a, a_scale, b, b_scale, bias=None):
    out = (a.float() * a_scale.view(-1, 1)) @ (b.float() * b_scale.view(-1, 1)).t()
    return out if bias is None else out + bias.float()


# K 200 leaves the last 64-wide K tile partial; split 3 of 4 K tiles gives splits of 2 + 2 (two programs).
@pytest.mark.parametrize("M, K, N", [(1, 256, 96), (19, 200, 130), (40, 512, 64)])
@pytest.mark.parametrize("split_k", [1, 3])
@pytest.mark.parametrize("bias", [False, True], ids=["no_bias", "bias"])
def test_fp8_gemm_equals_the_product_of_its_quantized_operands(M, K, N, split_k, bias):
    a, a_scale, b, b_scale = _operands(M, K, N, M * K + N)
    bias_t = torch.randn(N, device=DEVICE).to(torch.bfloat16) if bias else None
    config = Fp8GemmConfig(block_m=16, block_n=32, split_k=split_k, block_k=64, num_warps=4, num_stages=2)
    counters = torch.zeros(counters_size(M, N, config), dtype=torch.int32, device=DEVICE)
    for _ in range(2):  # the second call reuses the counters the first one left at zero
        out = fp8_gemm(a, a_scale, b, b_scale, config, bias=bias_t, counters=counters)
        assert out.shape == (M, N) and out.dtype == torch.bfloat16
        torch.testing.assert_close(out.float(), _reference(a, a_scale, b, b_scale, bias_t), atol=2e-2, rtol=1e-2)
    assert int(counters.abs().sum()) == 0


def test_fp8_gemm_refuses_bad_operands():
    a, a_scale, b, b_scale = _operands(4, 64, 32, 0)
    config = Fp8GemmConfig(block_m=16, block_n=32, split_k=2, block_k=32)
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        fp8_gemm(a.float(), a_scale, b, b_scale, config)
    with pytest.raises(ValueError, match="row scales"):
        fp8_gemm(a, a_scale[:3], b, b_scale, config)
    with pytest.raises(ValueError, match="counters"):
        fp8_gemm(a, a_scale, b, b_scale, config, counters=torch.zeros(0, dtype=torch.int32, device=DEVICE))


@pytest.mark.parametrize("M, K, N", [(1, 256, 96), (19, 200, 130)])
@pytest.mark.parametrize("split_k", [1, 3])
def test_16_bit_split_k_gemm_equals_the_float32_product(M, K, N, split_k):
    g = torch.Generator(device=DEVICE).manual_seed(M + K + N)
    a = torch.randn(M, K, generator=g, device=DEVICE).to(torch.bfloat16)
    b = (torch.randn(N, K, generator=g, device=DEVICE) * 0.05).to(torch.bfloat16)
    bias = torch.randn(N, generator=g, device=DEVICE).to(torch.bfloat16)
    config = Fp8GemmConfig(block_m=16, block_n=32, split_k=split_k, block_k=64, num_warps=4, num_stages=2)
    out = splitk_gemm(a, b, config, bias=bias)
    assert out.shape == (M, N) and out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), a.float() @ b.float().t() + bias.float(), atol=2e-2, rtol=1e-2)
    with pytest.raises(ValueError, match="16-bit"):
        splitk_gemm(a.float(), b, config)
