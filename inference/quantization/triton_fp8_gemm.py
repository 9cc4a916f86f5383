"""Triton FP8 GEMM with row-wise scales and split-K, for the few-row products of decode steps.

``out [M, N] = (a [M, K] @ b [N, K]^T) * a_scale[:, None] * b_scale[None, :] + bias``: ``a`` the per-token
e4m3 codes of the activations, ``b`` the e4m3 codes of the weight (row-major ``[N, K]``, as the layer keeps
them), both K-contiguous, multiplied on FP8 tensor cores (wgmma on Hopper) into float32. It computes what
``torch._scaled_mm`` computes for the FP8 linear layer (``fp8.Fp8LinearMethod``), with the bias added in
float32 rather than in the output dtype.

Why: at 256 rows cuBLASLt's FP8 kernels for the layers whose output is the hidden size (Qwen2.5-7B's o and
down projections) tile the output with 128 x 128 blocks, 56 of them on 132 SMs, and run at about a third of
the FP8 rate (``fp8-gemm-layouts_h200_2026-12-01.json``). Splitting K gives every SM work: the float32 partial
sums go to a workspace, and the last split of each output tile to arrive adds them in split order (the
W4A16 decode kernel's epilogue, ``triton_w4a16_decode._finish``). Which layers and row counts take this
kernel is decided by ``fp8_gemm_config`` from the H200 sweep in ``benchmarks/fp8_gemm_layouts.py``.

Importing this module imports Triton.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .triton_splitk import _finish
from .triton_w4a16_launch import plan_split_k


@triton.jit
def _fp8_gemm_kernel(
    a_ptr,         # [M, K] float8_e4m3fn, row stride stride_am, unit column stride
    a_scale_ptr,   # [M] float32 (the [M, 1] per-token scales)
    b_ptr,         # [N, K] float8_e4m3fn, row stride stride_bn, unit column stride
    b_scale_ptr,   # [N] float32 per-output-channel scales
    bias_ptr,      # [N] any float dtype (HAS_BIAS)
    partial_ptr,   # [SPLIT_K, M, N] float32 workspace (SPLIT_K > 1)
    counter_ptr,   # [>= cdiv(M, BLOCK_M) * cdiv(N, BLOCK_N)] int32, zero on entry, left zero (SPLIT_K > 1)
    out_ptr,       # [M, N] output dtype, contiguous
    M, N, K, stride_am, stride_bn, tiles_per_split,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
    HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr, HAS_SCALES: tl.constexpr = True,
):
    # Program (output column tile, row tile, K split): K tiles [pid_k * tiles_per_split, ...).
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = offs_m < M
    mask_n = offs_n < N
    a_rows = a_ptr + offs_m[:, None].to(tl.int64) * stride_am
    b_rows = b_ptr + offs_n[:, None].to(tl.int64) * stride_bn
    first = pid_k * tiles_per_split
    last = tl.minimum(first + tiles_per_split, tl.cdiv(K, BLOCK_K))
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for t in tl.range(first, last):
        k = t * BLOCK_K + offs_k
        if EVEN_K:
            a = tl.load(a_rows + k[None, :], mask=mask_m[:, None], other=0.0)
            b = tl.load(b_rows + k[None, :], mask=mask_n[:, None], other=0.0)
        else:
            a = tl.load(a_rows + k[None, :], mask=mask_m[:, None] & (k < K)[None, :], other=0.0)
            b = tl.load(b_rows + k[None, :], mask=mask_n[:, None] & (k < K)[None, :], other=0.0)
        acc = tl.dot(a, tl.trans(b), acc)
    if HAS_SCALES:  # else 16-bit operands (splitk_gemm)
        a_scale = tl.load(a_scale_ptr + offs_m, mask=mask_m, other=0.0)
        b_scale = tl.load(b_scale_ptr + offs_n, mask=mask_n, other=0.0)
        acc = acc * a_scale[:, None] * b_scale[None, :]
    _finish(acc, pid_k, pid_n + pid_m * tl.num_programs(0), offs_m, offs_n, mask_m, mask_n, M, N, bias_ptr,
            partial_ptr, counter_ptr, out_ptr, SPLIT_K, HAS_BIAS)


@dataclass(frozen=True)
class Fp8GemmConfig:
    """Launch parameters: row and column tile, K split, warps, pipeline stages (K tiles of 128)."""

    block_m: int
    block_n: int
    split_k: int
    num_warps: int = 4
    num_stages: int = 4
    block_k: int = 128


MAX_ROWS = 256  # fp8_gemm_config gives no config above this many rows


def counters_size(M: int, N: int, config: Fp8GemmConfig) -> int:
    """Split-K arrival counters (int32) one call with ``M`` rows and ``N`` outputs needs."""
    return triton.cdiv(M, config.block_m) * triton.cdiv(N, config.block_n)


def max_counters_size(N: int) -> int:
    """Counters enough for every config ``fp8_gemm_config`` gives a layer of ``N`` outputs."""
    return triton.cdiv(MAX_ROWS, 16) * triton.cdiv(N, 64)


def fp8_gemm_config(M: int, N: int, K: int, num_sms: int) -> Fp8GemmConfig | None:
    """The Triton kernel's config for ``[M, K] @ [N, K]^T``, or None where ``torch._scaled_mm`` is faster.

    Fitted to the H200 sweep of the Qwen2.5-7B shapes (``fp8_gemm_layouts.py --triton-sweep``,
    ``benchmarks/results/fp8-gemm-triton-sweep_h200_2026-12-01.json``; microseconds, Triton against cuBLASLt):

    - up to 16 rows, 16 x 64 tiles, K split until the tiles fill 1.5 waves of SMs: every shape (qkv 8.9
      against 12.4, o 8.0 / 12.5, gate_up 38.2 / 60.6, down 22.7 / 50.3);
    - up to 64 rows, 64 x 64 tiles, K split 4 ways where K >= 2N (down: 27.5 / 47.9), else whole (qkv
      10.9 / 12.7, o 10.7 / 12.5, gate_up 41.2 / 55.0);
    - up to 128 rows, the same except wide layers (N >= 4K: gate_up 51.5 / 48.3 goes to cuBLASLt) and
      128-row tiles split 4 ways for K >= 2N (down 31.7 / 47.7);
    - up to 256 rows, only K >= N: 128 x 128 tiles split 2 ways for K >= 2N (down 41.7 / 48.5), else
      128 x 64 whole (o 11.8 / 12.9, ``fp8-gemm-triton-wide_h200_2026-12-01.json``); qkv (13.4 / 12.7)
      and gate_up (75.7 / 64.2 with the wider grid's best tiles) stay on cuBLASLt;
    - above 256 rows, none.
    """
    k_heavy, wide = K >= 2 * N, N >= 4 * K
    if M <= 16:
        tiles, split_k, k_tiles = triton.cdiv(N, 64), 1, triton.cdiv(K, 128)
        while tiles * split_k < 1.5 * num_sms and split_k < 8 and k_tiles >= 6 * split_k:
            split_k *= 2
        return Fp8GemmConfig(16, 64, split_k)
    if M <= 64:
        return Fp8GemmConfig(64, 64, 4 if k_heavy else 1)
    if M <= 128:
        if wide:
            return None
        return Fp8GemmConfig(128, 64, 4, num_warps=8) if k_heavy else Fp8GemmConfig(64, 64, 1)
    if M <= MAX_ROWS and K >= N:
        return Fp8GemmConfig(128, 128, 2, num_warps=8) if k_heavy else Fp8GemmConfig(128, 64, 1, num_warps=8)
    return None


def fp8_gemm(a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor,
             config: Fp8GemmConfig, bias: torch.Tensor | None = None, out_dtype: torch.dtype = torch.bfloat16,
             counters: torch.Tensor | None = None) -> torch.Tensor:
    """``(a @ b^T) * a_scale * b_scale^T + bias`` on FP8 tensor cores; ``[M, N]`` in ``out_dtype``.

    Args:
        a: ``[M, K]`` float8_e4m3fn codes, unit column stride; a_scale: ``[M, 1]`` (or ``[M]``) float32.
        b: ``[N, K]`` float8_e4m3fn codes, unit column stride; b_scale: ``[N]`` (or ``[N, 1]``) float32.
        config: tiles and K split (``Fp8GemmConfig``).
        bias: ``[N]``, added in float32. counters: ``[>= counters_size(M, N, config)]`` int32 zeros, kept
            between calls (the kernel leaves them zero); allocated per call when None.
    Raises:
        ValueError: on mismatched shapes, non-FP8 operands, or too few counters.
    """
    M, K = a.shape
    N = b.shape[0]
    if b.shape[1] != K or a.dtype != torch.float8_e4m3fn or b.dtype != torch.float8_e4m3fn:
        raise ValueError(f"FP8 GEMM: a {tuple(a.shape)} {a.dtype} and b {tuple(b.shape)} {b.dtype} must be "
                         "float8_e4m3fn [M, K] and [N, K]")
    if a.stride(1) != 1 or b.stride(1) != 1:
        raise ValueError("FP8 GEMM: both operands need a unit column stride")
    if a_scale.numel() != M or b_scale.numel() != N:
        raise ValueError(f"FP8 GEMM: {a_scale.numel()} row scales for {M} rows, {b_scale.numel()} column scales "
                         f"for {N} columns")
    a_scale, b_scale = a_scale.reshape(-1).contiguous(), b_scale.reshape(-1).contiguous()
    return _launch(a, a_scale, b, b_scale, config, bias, torch.empty((M, N), dtype=out_dtype, device=a.device),
                   counters, "FP8 GEMM")


def _launch(a, a_scale, b, b_scale, config: Fp8GemmConfig, bias, out: torch.Tensor, counters, what: str):
    # a_scale None: 16-bit operands, no scales (splitk_gemm).
    M, K = a.shape
    N = b.shape[0]
    plan = plan_split_k(M, N, triton.cdiv(K, config.block_k), config.split_k, config.block_m, config.block_n, out,
                        counters, what)
    if M:
        _fp8_gemm_kernel[plan.grid](
            a, a_scale if a_scale is not None else out, b, b_scale if b_scale is not None else out,
            bias if bias is not None else out, plan.partial, plan.counters if plan.counters is not None else out,
            out, M, N, K, a.stride(0), b.stride(0), plan.tiles_per_split, BLOCK_M=config.block_m,
            BLOCK_N=config.block_n, BLOCK_K=config.block_k, SPLIT_K=plan.grid[2], HAS_BIAS=bias is not None,
            EVEN_K=K % config.block_k == 0, HAS_SCALES=a_scale is not None, num_warps=config.num_warps,
            num_stages=config.num_stages)
    return out


def splitk_gemm(a: torch.Tensor, b: torch.Tensor, config: Fp8GemmConfig, bias: torch.Tensor | None = None,
                counters: torch.Tensor | None = None) -> torch.Tensor:
    """``a @ b^T + bias`` for 16-bit operands with the same tiles and K split as :func:`fp8_gemm`.

    Not used by the engine: on the H200 it did not beat cuBLAS on Qwen2.5-0.5B's decode GEMMs at 64-256
    rows (``gemm-sweep-w2_h200_2026-12-01.json``); kept for that sweep (``benchmarks/gemm_sweep.py``).

    Args:
        a: ``[M, K]`` bf16/fp16, unit column stride; b: ``[N, K]`` same dtype, unit column stride.
        config, bias, counters: as in :func:`fp8_gemm`.
    Returns:
        ``[M, N]`` in the operands' dtype (float32 accumulation).
    Raises:
        ValueError: on mismatched shapes or dtypes, or too few counters.
    """
    M, K = a.shape
    N = b.shape[0]
    if b.shape[1] != K or a.dtype != b.dtype or a.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"GEMM: a {tuple(a.shape)} {a.dtype} and b {tuple(b.shape)} {b.dtype} must be "
                         "[M, K] and [N, K] of one 16-bit dtype")
    if a.stride(1) != 1 or b.stride(1) != 1:
        raise ValueError("GEMM: both operands need a unit column stride")
    return _launch(a, None, b, None, config, bias, torch.empty((M, N), dtype=a.dtype, device=a.device), counters,
                   "GEMM")
