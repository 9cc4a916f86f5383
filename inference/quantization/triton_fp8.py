"""Triton per-token FP8 quantization of activations, fused into one kernel: per-row absolute maximum,
scale ``amax / 448``, divide, clamp and cast to float8_e4m3fn (PyTorch needs about seven kernels for it).

Reference, CPU path and test oracle: ``fp8.quantize_fp8_rowwise``, which this kernel reproduces bit for
bit (same float32 operations, division rounded to nearest, casts rounded to nearest even). Dynamic
per-token scaling as in vLLM's ``fp8`` method (``scaled_fp8_quant`` with ``use_per_token_if_dynamic``).
Importing this module imports Triton.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .fp8 import _MIN_SCALE, FP8_DTYPE, FP8_MAX


@triton.jit
def fp8_row_scale(amax, FP8_MAX: tl.constexpr, MIN_SCALE: tl.constexpr):
    """The scale of a row whose largest magnitude is ``amax`` (float32): ``max(amax / 448, 1e-12)``."""
    return tl.maximum(amax / FP8_MAX, MIN_SCALE)


@triton.jit
def fp8_codes(x, scale, FP8_MAX: tl.constexpr):
    """``x / scale`` (float32, division rounded to nearest) clamped to +-448 and cast to e4m3."""
    return tl.minimum(tl.maximum(tl.math.div_rn(x, scale), -FP8_MAX), FP8_MAX).to(tl.float8e4nv)


@triton.jit
def _per_token_fp8_kernel(
    x_ptr,       # [M, K] float16/bfloat16/float32, row stride stride_xm, unit column stride
    codes_ptr,   # [M, K] float8_e4m3fn, contiguous
    scales_ptr,  # [M] float32 (the [M, 1] scale column)
    K, stride_xm,
    BLOCK: tl.constexpr, FP8_MAX: tl.constexpr, MIN_SCALE: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_xm
    amax = tl.zeros((BLOCK,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK):
        offs = k0 + tl.arange(0, BLOCK)
        x = tl.load(x_row + offs, mask=offs < K, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    scale = fp8_row_scale(tl.max(amax, axis=0), FP8_MAX, MIN_SCALE)
    tl.store(scales_ptr + row, scale)
    for k0 in range(0, K, BLOCK):
        offs = k0 + tl.arange(0, BLOCK)
        x = tl.load(x_row + offs, mask=offs < K, other=0.0).to(tl.float32)
        tl.store(codes_ptr + row * K + offs, fp8_codes(x, scale, FP8_MAX), mask=offs < K)


def per_token_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row FP8 quantization in one kernel: ``x [M, K]`` (float16/bfloat16/float32) ->
    ``(codes [M, K] float8_e4m3fn, scales [M, 1] float32)`` with ``x ~= codes * scales`` and each row's
    largest magnitude mapped to 448; the scales are ``torch._scaled_mm``'s ``scale_a``.
    Equal to ``fp8.quantize_fp8_rowwise(x)``.
    """
    M, K = x.shape
    if x.stride(1) != 1:
        x = x.contiguous()
    codes = torch.empty((M, K), dtype=FP8_DTYPE, device=x.device)
    scales = torch.empty((M, 1), dtype=torch.float32, device=x.device)
    block = min(triton.next_power_of_2(K), 2048)
    _per_token_fp8_kernel[(M,)](x, codes, scales, K, x.stride(0), BLOCK=block, FP8_MAX=FP8_MAX,
                                MIN_SCALE=_MIN_SCALE, num_warps=4 if block <= 1024 else 8)
    return codes, scales
