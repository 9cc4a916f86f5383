"""The fused per-token FP8 quantization kernel against ``quantize_fp8_rowwise`` (its reference and the
CPU path): the same codes bit for bit, and the same scales.

Without a CUDA device the kernel runs in Triton's interpreter on tiny shapes.
"""
from __future__ import annotations

import pytest
import torch

from .triton_interpreter import HAS_CUDA  # noqa: E402  (sets TRITON_INTERPRET=1 without a GPU)

triton = pytest.importorskip("triton")

from inference.quantization.fp8 import quantize_fp8_rowwise  # noqa: E402
from inference.quantization.triton_fp8 import per_token_fp8  # noqa: E402

DEVICE = "cuda" if HAS_CUDA else "cpu"


# K 4100 takes three 2048-wide blocks, the last one partial.
@pytest.mark.parametrize("M, K", [(1, 100), (5, 4100)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_per_token_fp8_equals_the_reference(M, K, dtype):
    torch.manual_seed(K)
    x = (torch.randn(M, K, device=DEVICE) * torch.logspace(-3, 2, M, device=DEVICE)[:, None]).to(dtype)
    x[0, :7] = torch.tensor([127.99, -84.0, 0.0, 1e-4, -300.0, 447.0, 3.0], dtype=dtype)
    codes, scales = per_token_fp8(x)
    expected_codes, expected_scales = quantize_fp8_rowwise(x)
    assert codes.dtype == torch.float8_e4m3fn and scales.shape == (M, 1) and scales.dtype == torch.float32
    torch.testing.assert_close(scales, expected_scales, atol=0, rtol=0)
    assert torch.equal(codes.view(torch.uint8), expected_codes.view(torch.uint8))


def test_per_token_fp8_of_a_zero_row_gives_the_smallest_scale_and_zero_codes():
    x = torch.zeros(2, 64, device=DEVICE, dtype=torch.bfloat16)
    x[1] = 1.0
    codes, scales = per_token_fp8(x)
    assert scales[0, 0].item() == pytest.approx(1e-12) and scales[1, 0].item() == pytest.approx(1 / 448)
    assert codes[0].float().abs().sum().item() == 0 and torch.all(codes[1].float() == 448)
