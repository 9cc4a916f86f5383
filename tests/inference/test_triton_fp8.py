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


# ------------------------------------------------------- quantization fused into the producing kernels
from inference.models import triton_layers  # noqa: E402
from inference.quantization.fp8 import Fp8Activation  # noqa: E402


def _assert_same_activation(got: Fp8Activation, x16: torch.Tensor) -> None:
    """``got`` holds exactly the codes and scales that quantizing the 16-bit result ``x16`` gives."""
    codes, scales = quantize_fp8_rowwise(x16.reshape(-1, x16.shape[-1]))
    assert isinstance(got, Fp8Activation) and got.dtype == x16.dtype
    torch.testing.assert_close(got.scales, scales, atol=0, rtol=0)
    assert torch.equal(got.codes.view(torch.uint8), codes.view(torch.uint8))


@pytest.mark.parametrize("residual", [False, True], ids=["norm", "add_norm"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_rms_norm_with_fp8_out_equals_quantizing_its_16_bit_output(residual, dtype):
    torch.manual_seed(1)
    x = (torch.randn(6, 200, device=DEVICE) * torch.logspace(-2, 2, 6, device=DEVICE)[:, None]).to(dtype)
    weight = (torch.rand(200, device=DEVICE) * 3).to(dtype)
    if residual:
        r = torch.randn(6, 200, device=DEVICE, dtype=dtype)
        expected, expected_residual = triton_layers.fused_add_rms_norm(x, r, weight, 1e-6)
        got, new_residual = triton_layers.fused_add_rms_norm(x, r, weight, 1e-6, fp8_out=True)
        assert torch.equal(new_residual, expected_residual)
    else:
        expected = triton_layers.rms_norm(x, weight, 1e-6)
        got = triton_layers.rms_norm(x, weight, 1e-6, fp8_out=True)
    _assert_same_activation(got, expected)


@pytest.mark.parametrize("row_in_registers", [True, False], ids=["one_read", "two_passes"])
@pytest.mark.parametrize("inter", [64, 100, 5000])  # 64: no tail; 5000: a 4096 head and a partial tail, or
def test_silu_and_mul_with_fp8_out_equals_quantizing_its_16_bit_output(inter, row_in_registers, monkeypatch):
    # ... three 2048-wide tiles per pass, the last one partial
    if not row_in_registers:
        monkeypatch.setattr(triton_layers, "_FP8_ROW_IN_REGISTERS_MAX", 32)
    torch.manual_seed(inter)
    x = (torch.randn(3, 2 * inter, device=DEVICE) * 3).to(torch.bfloat16)
    x[1] = 0.0  # a zero row: smallest scale, zero codes
    _assert_same_activation(triton_layers.silu_and_mul(x, fp8_out=True), triton_layers.silu_and_mul(x))


# ------------------------------------------------------- the FP8 linear on the GPU (torch._scaled_mm)
@pytest.mark.skipif(not HAS_CUDA, reason="torch._scaled_mm needs FP8 tensor cores")
@pytest.mark.parametrize("rows", [16, 48, 100, 256, 300])
@pytest.mark.parametrize("bias", [False, True], ids=["no_bias", "bias"])
@pytest.mark.parametrize("K, N", [(512, 768), (1024, 1024), (4096, 512)], ids=["n_over_k", "square", "k_heavy"])
def test_fp8_linear_equals_the_product_of_its_quantized_operands(rows, bias, K, N):
    """The GPU GEMM gives the float32 product of the quantized operands (bias included), row-major ``[T, N]``:
    cuBLASLt or the Triton kernel (``fp8_gemm_config``: each shape up to 64 or 128 rows; the square and
    K-heavy ones, the latter split, up to 256)."""
    from inference.quantization.fp8 import Fp8LinearMethod
    from inference.quantization.linear import QuantizedLinear

    g = torch.Generator(device=DEVICE).manual_seed(rows)
    with torch.device(DEVICE):
        layer = QuantizedLinear(K, N, bias, Fp8LinearMethod(), torch.bfloat16)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(N, K, generator=g, device=DEVICE) * 0.02)
        if bias:
            layer.bias.copy_(torch.randn(N, generator=g, device=DEVICE))
    layer.method.process_weights_after_loading(layer)
    x = torch.randn(rows, K, generator=g, device=DEVICE).to(torch.bfloat16)
    codes, scales = quantize_fp8_rowwise(x)
    ref = (codes.float() * scales) @ (layer.weight.float() * layer.weight_scale[:, None]).t()
    if bias:
        ref += layer.bias.float()
    out = layer(x)
    assert out.shape == (rows, N) and out.is_contiguous() and out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref, atol=2e-2 * ref.abs().max().item(), rtol=0)
