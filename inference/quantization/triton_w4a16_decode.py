"""Triton W4A16 decode kernel: ``x [M, K] @ dequant(qweight) [K, N] (+ bias)`` for few rows (M <= 32).

Decode is a matrix-vector product bound by reading the int4 weights, so the kernel is built to stream
them: each program owns a ``BLOCK_N``-wide output tile and a contiguous range of 128-row K tiles
(split-K, so that thin layers such as O and down still put a few programs on every SM), loads one
``[16, BLOCK_N]`` int32 block per K tile (128 input rows x BLOCK_N columns of codes), and turns each of
its eight nibble slots into a ``[16, BLOCK_N]`` weight slice that one ``tl.dot`` multiplies with 16
consecutive activation columns: the internal K-tiled layout (``packing.pack_ktiled``) puts input row
``128t + 16i + r`` in slot ``i`` of word row ``16t + r`` precisely so that no nibble is reshuffled.
Scales and zero points are read once per group (once per K tile for groups of 128 or more) and folded
into one multiply-add per weight: ``w = code * s - z * s``; codes become floats through the exponent
trick (``float_bits(0x4B000000 | code) - 2^23``, as in Kim et al., 2022, "Who Says Elephants Can't Run",
arXiv:2211.10017) rather than integer-to-float conversions, which run at 1/8 of the FMA rate.

Split-K partial sums (float32) go to a workspace; the last program of a tile to finish (a per-tile
arrival counter, which it resets to zero) adds them in split order, adds the bias and writes the
output in ``x.dtype``: one launch per linear, deterministic, no memset, safe inside CUDA graphs.
GPTQ act-order layers pass ``perm``; the kernel gathers the activation columns itself.

Known limit (``benchmarks/compile_sm90.py``, no GPU measurement yet): on sm_90 the main loop issues
about 10 instructions a weight, a third of them moving each dequantized slice through shared memory
into the ``tl.dot`` operand layout; streaming HBM needs about 4, so the kernel is likely issue-bound
near 40% of bandwidth. A layout whose registers already match the MMA operand fragments (Marlin's)
would remove that traffic.

Reference, CPU path and test oracle: ``packing.dequantize_internal`` then ``torch.matmul``
(``int4.Int4LinearMethod``). Sources: the reduction by the last-arriving program is the "fixup" of
stream-K (Osama et al., 2023, arXiv:2301.03598) on a plain split-K grid; the weight layout chosen so
that unpacking needs no shuffle is the idea behind Marlin's offline repacking (Frantar et al., 2024,
arXiv:2408.11743), here for Triton's ``tl.dot`` instead of raw MMA fragments.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .packing import PACK_K

MAX_DECODE_ROWS = 32  # rows (tokens) this kernel serves; more go to the prefill kernel


@triton.jit
def _group_params(scales_ptr, qzeros_ptr, group, offs_n, mask_n, N, EVEN_N: tl.constexpr):
    # scales_ptr: [G, N] float16 contiguous; qzeros_ptr: [G, N/8] int32, column n in bits 4(n%8).. of word n//8
    if EVEN_N:
        s = tl.load(scales_ptr + group * N + offs_n).to(tl.float32)
        zp = tl.load(qzeros_ptr + group * (N // 8) + offs_n // 8)
    else:
        s = tl.load(scales_ptr + group * N + offs_n, mask=mask_n, other=0.0).to(tl.float32)
        zp = tl.load(qzeros_ptr + group * (N // 8) + offs_n // 8, mask=mask_n, other=0)
    z = ((zp >> ((offs_n % 8) * 4)) & 0xF).to(tl.float32)
    return s, z * s


@triton.jit
def _w4a16_decode_kernel(
    x_ptr,        # [M, K] activations (float16/bfloat16/float32), row stride stride_xm, unit column stride
    qweight_ptr,  # [K_pad/8, N] int32 contiguous, K-tiled: word row 16t+r, slot i <- input row 128t+16i+r
    scales_ptr,   # [G, N] float16 contiguous
    qzeros_ptr,   # [G, N/8] int32 contiguous, packed along N (slot i of word c <- column 8c+i)
    perm_ptr,     # [K] int64 (HAS_PERM): activation column that feeds input row k
    bias_ptr,     # [N] (HAS_BIAS)
    partial_ptr,  # [SPLIT_K, M, N] float32 workspace (SPLIT_K > 1)
    counter_ptr,  # [>= cdiv(M, BLOCK_M) * cdiv(N, BLOCK_N)] int32, zero on entry, left zero (SPLIT_K > 1)
    out_ptr,      # [M, N] in x's dtype, contiguous
    M, N, K, G, stride_xm, tiles_per_split,
    GROUP_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT_K: tl.constexpr,
    HAS_PERM: tl.constexpr, HAS_BIAS: tl.constexpr, DOT_PRECISION: tl.constexpr,
    EVEN_K: tl.constexpr, EVEN_N: tl.constexpr,  # K % 128 == 0, N % BLOCK_N == 0: loads need no bounds mask
):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_r = tl.arange(0, 16)
    mask_m = offs_m < M
    mask_n = offs_n < N
    x_rows = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    first = pid_k * tiles_per_split
    last = tl.minimum(first + tiles_per_split, tl.cdiv(K, 128))
    for t in range(first, last):
        w_ptrs = qweight_ptr + (t * 16 + offs_r)[:, None].to(tl.int64) * N + offs_n[None, :]
        if EVEN_N:
            packed = tl.load(w_ptrs)                                               # [16, BLOCK_N]
        else:
            packed = tl.load(w_ptrs, mask=mask_n[None, :], other=0)
        packed = packed.to(tl.uint32, bitcast=True)                              # logical shifts below
        s, zs = _group_params(scales_ptr, qzeros_ptr, tl.minimum(t * 128 // GROUP_SIZE, G - 1), offs_n, mask_n, N,
                              EVEN_N)
        for i in tl.static_range(8):
            offs_k = t * 128 + i * 16 + offs_r                                    # 16 consecutive input rows
            mask_k = offs_k < K
            if HAS_PERM:
                cols = tl.load(perm_ptr + offs_k, mask=mask_k, other=0)
            else:
                cols = offs_k
            if GROUP_SIZE % 128 != 0:  # groups of 16..112 rows, or not aligned to the tile: per slice
                s, zs = _group_params(scales_ptr, qzeros_ptr, tl.minimum((t * 128 + i * 16) // GROUP_SIZE, G - 1),
                                      offs_n, mask_n, N, EVEN_N)
            # Nibble i masked in place (slots 5..7 from the word shifted right by 12) under the exponent of
            # 2^23: float32 2^23 + code * 16^j exactly (j = i or i - 3; one LOP3), minus 2^23, times
            # s / 16^j (exact): the code's weight without an int-to-float conversion.
            if i < 5:
                nibble = packed & (0xF << (4 * i))
                unit = 1.0 / (1 << (4 * i))
            else:
                nibble = (packed >> 12) & (0xF << (4 * (i - 3)))
                unit = 1.0 / (1 << (4 * (i - 3)))
            codes = (nibble | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0
            w = codes * (s * unit)[None, :] - zs[None, :]
            if EVEN_K:
                x = tl.load(x_rows + cols[None, :], mask=mask_m[:, None], other=0.0)
            else:
                x = tl.load(x_rows + cols[None, :], mask=mask_m[:, None] & mask_k[None, :], other=0.0)
            acc += tl.dot(x, w.to(x.dtype), input_precision=DOT_PRECISION)

    _finish(acc, pid_k, pid_n + pid_m * tl.num_programs(0), offs_m, offs_n, mask_m, mask_n, M, N, bias_ptr,
            partial_ptr, counter_ptr, out_ptr, SPLIT_K, HAS_BIAS)


@triton.jit
def _finish(acc, pid_k, tile, offs_m, offs_n, mask_m, mask_n, M, N, bias_ptr, partial_ptr, counter_ptr, out_ptr,
            SPLIT_K: tl.constexpr, HAS_BIAS: tl.constexpr):
    # Split-K epilogue: partial sums to the workspace; the last split of the tile to arrive adds them in
    # split order (deterministic), adds the bias, writes the output and resets the tile's counter.
    out_offs = offs_m[:, None].to(tl.int64) * N + offs_n[None, :]
    mask_out = mask_m[:, None] & mask_n[None, :]
    if SPLIT_K > 1:
        tl.store(partial_ptr + pid_k.to(tl.int64) * M * N + out_offs, acc, mask=mask_out)
        tl.debug_barrier()  # every thread's partial is written before the release below
        arrived = tl.atomic_add(counter_ptr + tile, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT_K - 1:  # the last split of this tile: reduce in split order
            acc = tl.zeros(acc.shape, dtype=tl.float32)
            for split in range(SPLIT_K):
                acc += tl.load(partial_ptr + split * M * N + out_offs, mask=mask_out, other=0.0,
                               cache_modifier=".cg")
            _store_output(acc, bias_ptr, out_ptr, out_offs, offs_n, mask_n, mask_out, HAS_BIAS)
            tl.atomic_xchg(counter_ptr + tile, 0, sem="relaxed", scope="gpu")
    else:
        _store_output(acc, bias_ptr, out_ptr, out_offs, offs_n, mask_n, mask_out, HAS_BIAS)


@triton.jit
def _w4a16_gemv_kernel(
    x_ptr,        # [1, K] activations (float16/bfloat16/float32), unit column stride
    qweight_ptr,  # [K_pad/8, N] int32 contiguous, K-tiled: word row 16t+r, slot i <- input row 128t+16i+r
    scales_ptr,   # [G, N] float16 contiguous
    qzeros_ptr,   # [G, N/8] int32 contiguous, packed along N
    perm_ptr,     # [K] int64 (HAS_PERM): activation column that feeds input row k
    bias_ptr,     # [N] (HAS_BIAS)
    partial_ptr,  # [SPLIT_K, 1, N] float32 workspace (SPLIT_K > 1)
    counter_ptr,  # [>= cdiv(N, BLOCK_N)] int32, zero on entry, left zero (SPLIT_K > 1)
    out_ptr,      # [1, N] in x's dtype
    N, K, G, tiles_per_split,
    GROUP_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT_K: tl.constexpr,
    HAS_PERM: tl.constexpr, HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr, EVEN_N: tl.constexpr,
):
    # One row, groups a multiple of 128 rows: a K tile shares one scale and zero per column, so
    # sum_k x_k (c_kn s_n - z_n s_n) = s_n sum_k x_k c_kn - z_n s_n sum_k x_k: 4 instructions a weight.
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_r = tl.arange(0, 16)
    slots = tl.arange(0, 8)
    shifts = (slots * 4).to(tl.uint32)[:, None, None]                       # [8, 1, 1]
    mask_n = offs_n < N
    acc = tl.zeros((16, BLOCK_N), dtype=tl.float32)
    first = pid_k * tiles_per_split
    last = tl.minimum(first + tiles_per_split, tl.cdiv(K, 128))
    for t in range(first, last):
        w_ptrs = qweight_ptr + (t * 16 + offs_r)[:, None].to(tl.int64) * N + offs_n[None, :]
        if EVEN_N:
            packed = tl.load(w_ptrs)
        else:
            packed = tl.load(w_ptrs, mask=mask_n[None, :], other=0)
        packed = packed.to(tl.uint32, bitcast=True)                              # [16, BLOCK_N]
        offs_k = t * 128 + slots[:, None] * 16 + offs_r[None, :]                # [8, 16]: slot i, word row r
        if HAS_PERM:
            cols = tl.load(perm_ptr + offs_k, mask=offs_k < K, other=0)
        else:
            cols = offs_k
        if EVEN_K:
            x = tl.load(x_ptr + cols).to(tl.float32)
        else:
            x = tl.load(x_ptr + cols, mask=offs_k < K, other=0.0).to(tl.float32)
        codes = (((packed[None, :, :] >> shifts) & 0xF) | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0
        cx = tl.sum(codes * x[:, :, None], axis=0)                              # [16, BLOCK_N]
        s, zs = _group_params(scales_ptr, qzeros_ptr, tl.minimum(t * 128 // GROUP_SIZE, G - 1), offs_n, mask_n, N,
                              EVEN_N)
        acc += cx * s[None, :] - tl.sum(x, axis=0)[:, None] * zs[None, :]
    out = tl.sum(acc, axis=0)[None, :]
    offs_m = tl.arange(0, 1)
    _finish(out, pid_k, pid_n, offs_m, offs_n, offs_m < 1, mask_n, 1, N, bias_ptr, partial_ptr, counter_ptr, out_ptr,
            SPLIT_K, HAS_BIAS)


@triton.jit
def _store_output(acc, bias_ptr, out_ptr, out_offs, offs_n, mask_n, mask_out, HAS_BIAS: tl.constexpr):
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + out_offs, acc.to(out_ptr.dtype.element_ty), mask=mask_out)


@dataclass(frozen=True)
class DecodeConfig:
    """Launch parameters of the decode kernels: output tile width, K split, warps and pipeline stages,
    and whether a single row takes the FMA GEMV kernel (``gemv``; groups of a multiple of 128 rows only)
    rather than 16-row ``tl.dot`` tiles."""

    block_n: int
    split_k: int
    num_warps: int = 4
    num_stages: int = 4
    gemv: bool = False


def decode_config(M: int, N: int, K: int, num_sms: int) -> DecodeConfig:
    """A config for ``x [M, K] @ W [K, N]`` on ``num_sms`` SMs, from a bandwidth argument (untuned; the
    benchmark's ``--sweep`` measures the alternatives, the FMA GEMV for one row among them: Triton does
    not software-pipeline its loads, so the 16-row ``tl.dot`` path, whose loads it pipelines through
    shared memory, is the default even for one row): about four programs per SM, so that enough
    weight loads are in flight; K split for that, but each program keeps at least two 128-row K tiles
    and the float32 partial sums (``split * M * N * 4`` bytes) stay under about a quarter of the int4
    weight bytes (``K * N / 2``); 128-wide output tiles unless that leaves too few programs."""
    k_tiles = triton.cdiv(K, PACK_K)
    split_cap = max(1, min(k_tiles // 2, K // (32 * M)))
    target = 4 * num_sms
    block_n = 128 if triton.cdiv(N, 128) * split_cap >= target // 2 else 64
    tiles = triton.cdiv(N, block_n)
    split_k = max(1, min(split_cap, triton.cdiv(target, tiles)))
    # 8 warps at 128 columns: 75 registers a thread on sm_90 (147 with 4), so more programs fit per SM.
    return DecodeConfig(block_n=block_n, split_k=split_k, num_warps=8 if block_n >= 128 else 4)


def w4a16_decode(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, qzeros: torch.Tensor,
                 group_size: int, perm: torch.Tensor | None = None, bias: torch.Tensor | None = None,
                 counters: torch.Tensor | None = None, num_sms: int = 132,
                 config: DecodeConfig | None = None) -> torch.Tensor:
    """``x [M, K] @ W [K, N] + bias`` for ``M <= 32``, W the int4 weights; result ``[M, N]`` in ``x.dtype``.

    Args:
        x: ``[M, K]`` float16/bfloat16/float32, unit column stride.
        qweight: ``[K_pad/8, N]`` int32, K-tiled (``packing.pack_ktiled``); qzeros ``[G, N/8]`` int32;
            scales ``[G, N]`` float16 (the internal layout, ``K = G * group_size``).
        group_size: input rows per group, a multiple of 16.
        perm: ``[K]`` int64, act-order: input row ``k`` multiplies ``x[:, perm[k]]``.
        bias: ``[N]``, added in float32.
        counters: ``[>= packing.counters_size(N)]`` int32 zeros, kept between calls (a layer's buffer); allocated
            per call when None.
        num_sms: SMs to fill; config: launch parameters (default ``decode_config``).

    Raises:
        ValueError: ``M > 32``, or ``group_size`` not a multiple of 16.
    """
    M, K = x.shape
    N = qweight.shape[1]
    if M > MAX_DECODE_ROWS or group_size % 16:
        raise ValueError(f"W4A16 decode kernel: needs at most {MAX_DECODE_ROWS} rows (got {M}) and a group "
                         f"size that is a multiple of 16 (got {group_size})")
    if x.stride(1) != 1:
        x = x.contiguous()
    config = config or decode_config(M, N, K, num_sms)
    gemv = config.gemv and M == 1 and group_size % PACK_K == 0
    block_m = 16 if M <= 16 else 32
    k_tiles = triton.cdiv(K, PACK_K)
    tiles_per_split = triton.cdiv(k_tiles, config.split_k)
    split_k = triton.cdiv(k_tiles, tiles_per_split)
    grid = (triton.cdiv(N, config.block_n), triton.cdiv(M, block_m), split_k)
    out = torch.empty((M, N), dtype=x.dtype, device=x.device)
    partial = out
    if split_k > 1:
        partial = torch.empty((split_k, M, N), dtype=torch.float32, device=x.device)
        if counters is None:
            counters = torch.zeros(grid[0] * grid[1], dtype=torch.int32, device=x.device)
        if counters.numel() < grid[0] * grid[1]:
            raise ValueError(f"W4A16 decode kernel: {counters.numel()} split-K counters for {grid[0] * grid[1]} tiles")
    if gemv:
        _w4a16_gemv_kernel[(grid[0], split_k)](
            x, qweight, scales, qzeros, perm if perm is not None else x, bias if bias is not None else x,
            partial, counters if counters is not None else qweight, out, N, K, scales.shape[0], tiles_per_split,
            GROUP_SIZE=group_size, BLOCK_N=config.block_n, SPLIT_K=split_k, HAS_PERM=perm is not None,
            HAS_BIAS=bias is not None, EVEN_K=K % PACK_K == 0, EVEN_N=N % config.block_n == 0,
            num_warps=config.num_warps, num_stages=config.num_stages)
        return out
    _w4a16_decode_kernel[grid](
        x, qweight, scales, qzeros, perm if perm is not None else x, bias if bias is not None else x,
        partial, counters if counters is not None else qweight, out,
        M, N, K, scales.shape[0], x.stride(0), tiles_per_split,
        GROUP_SIZE=group_size, BLOCK_M=block_m, BLOCK_N=config.block_n, SPLIT_K=split_k,
        HAS_PERM=perm is not None, HAS_BIAS=bias is not None, EVEN_K=K % PACK_K == 0, EVEN_N=N % config.block_n == 0,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        num_warps=config.num_warps, num_stages=config.num_stages)
    return out
