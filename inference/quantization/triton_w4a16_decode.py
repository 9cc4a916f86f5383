"""Triton W4A16 decode kernel: ``x [M, K] @ dequant(qweight) [K, N] (+ bias)`` for few rows (M <= 64).

Decode is a matrix-vector product bound by reading the int4 weights, so the kernel is built to stream
them: each program owns a ``BLOCK_N``-wide output tile and a contiguous range of 128-row K tiles
(split-K, so that thin layers such as O and down still put several programs on every SM). It computes
the transpose, ``out^T [BLOCK_N, BLOCK_M] = W^T x^T``, so that the dequantized weights are the MMA's A
operand, which Hopper's wgmma (and mma.sync elsewhere) reads from registers: Triton unpacks the codes
straight into the operand layout, and nothing dequantized goes through shared memory (the previous
version, ``x @ W``, stored every dequantized slice to shared memory with two barriers per 16 rows and
ran at 400-650 GB/s of int4 on the H200; this one at 700-1,300 GB/s,
``benchmarks/results/w4a16-sweep_h200_2026-11-30.json``). One ``[BLOCK_N, 16]`` int32 block per K
tile (128 input rows) is loaded through Triton's pipelined asynchronous copies; the internal K-tiled
layout (``packing.pack_ktiled``) keeps input rows ``2p`` and ``2p + 1`` of each 16-row chunk in the two
16-bit halves of one word, so one shift and one mask produce a register of the MMA's A operand. The eight x^T
chunks of the next K tile are loaded while the current one computes.

A code ``c`` becomes a 16-bit float by OR-ing it into the mantissa of ``OFFSET`` (bfloat16 128.0, float16
1024.0, both with a step of exactly 1): no integer-to-float conversion and no subtraction per weight
(the exponent trick of Kim et al., 2022, "Who Says Elephants Can't Run", arXiv:2211.10017, with the
offset folded out). The MMA sums ``x * (OFFSET + c)``; per group, ``s * part - s * (OFFSET + z) * sum(x)``
removes the offset and the zero point (the x sums cost one add per x element). float32 activations
(CPU tests, float32 models) subtract the offset per weight instead, exactly.

For groups of a multiple of 128 rows, a second kernel (``_w4a16_decode_tile_kernel``, the default)
unpacks a whole K tile into one ``[BLOCK_N, 128]`` A operand and issues one MMA per tile; one ``lop3`` (inline
PTX) masks two codes and ORs them into ``OFFSET``. By default it then subtracts ``OFFSET + zero`` from each
register of two codes with one packed ``sub.bf16x2`` / ``sub.f16x2``, leaving the exact integers
``code - zero``, so the MMA's result needs only the group's scale (``zero_in_regs``), and lets Triton's
pipeliner copy the x tiles with the weights (``x_in_loop``). The variant that takes off
``s * (OFFSET + zero) * sum(x)`` after the MMA instead, the tile's ``sum(x)`` summed from the x tile
(``x_sums``), was the default up to 16 rows until the 2026-12-06 sweep found it 9-13% slower; it stays the
choice for bfloat16 before sm_90, which has no ``sub.bf16x2`` (``fit_config``). Its first version took that sum
from a second MMA against an all-ones A (still
``zero_in_regs=False, x_sums=False``): twice the tensor-core work, and ptxas serializes those MMAs, which bounded
it from 32 rows on (1.0x bf16's decode step at batch 32). The next tile's scales and zero points load while a tile
computes (``prefetch``): the per-tile epilogue, which waits for the tile's MMA, is what bounds the kernel
(``benchmarks/w4a16_stage_probe.py``; ``docs/quantization.md``).

Split-K partial sums (float32) go to a workspace; the last program of a tile to finish (a per-tile
arrival counter, which it resets to zero) adds them in split order, adds the bias and writes the
output in ``x.dtype`` (``triton_splitk._finish``): one launch per linear, deterministic, no memset, safe
inside CUDA graphs. ``DecodeConfig(gemv=True)`` (``decode_config``'s choice for one row of the narrower
layers) sends up to four rows to the CUDA-core kernel of ``triton_w4a16_gemv`` instead (same layout and
epilogue, no MMA); rows, groups or a K that it does not take go to the tile kernel's config.
GPTQ act-order layers pass ``perm``; the kernel gathers the activation columns itself.

Reference, CPU path and test oracle: ``packing.dequantize_internal`` then ``torch.matmul``
(``int4.Int4LinearMethod``). Sources: the reduction by the last-arriving program is the "fixup" of
stream-K (Osama et al., 2023, arXiv:2301.03598) on a plain split-K grid; the weight layout chosen so
that unpacking needs no shuffle is the idea behind Marlin's offline repacking (Frantar et al., 2024,
arXiv:2408.11743), here for Triton's ``tl.dot`` instead of raw MMA fragments.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .packing import PACK_K
from .triton_splitk import _finish
from .triton_w4a16_gemv import MAX_GEMV_ROWS, w4a16_gemv
from .triton_w4a16_launch import DecodeConfig, decode_config, fit_config, plan_split_k, tile_config
from .triton_w4a16_operand import _group_params, _tile_operand, _x_tile

MAX_DECODE_ROWS = 64  # rows (tokens) this kernel serves; more go to the GEMM or the dequantize path
# A 4-bit code c OR-ed into the mantissa of a 16-bit float: (bit pattern, value at c = 0). bfloat16 0x4300 is
# 128.0 with a step of 1 (7 mantissa bits), float16 0x6400 is 1024.0 with a step of 1 (10 bits): OFFSET + c.
_CODE_OFFSET = {torch.bfloat16: (0x4300, 128.0), torch.float16: (0x6400, 1024.0)}


@triton.jit
def _x_chunk(x_ptr, perm_ptr, t, i: tl.constexpr, offs_r, offs_m, mask_m, stride_xm, last, K,
             HAS_PERM: tl.constexpr, EVEN_K: tl.constexpr):
    # x^T chunk [16, BLOCK_M]: input rows 128t + 16i .. 128t + 16i + 15 (see _x_tile)
    return _x_tile(x_ptr, perm_ptr, t, i * 16 + offs_r, offs_m, mask_m, stride_xm, last, K, HAS_PERM, EVEN_K)


@triton.jit
def _chunk_mma(words, j: tl.constexpr, xc, part, xs, MAGIC: tl.constexpr, BLOCK_N: tl.constexpr):
    # Chunk 4h + j of a K tile from its half h's words [BLOCK_N, 8]: word p holds rows 2p and 2p + 1 in bits
    # 4j and 16 + 4j, so one shift and one mask leave the pair in the two 16-bit halves, each OR-ed into the
    # mantissa of OFFSET (see the kernel); [BLOCK_N, 8, 2] -> [BLOCK_N, 16] keeps the pair in one register.
    pairs = (words >> (4 * j)) & 0x000F000F
    if xc.dtype == tl.float32:
        lo = (pairs & 0xF | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0     # exact code, offset 0
        hi = ((pairs >> 16) | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0
        w = tl.reshape(tl.join(lo, hi), (BLOCK_N, 16))
        part = tl.dot(w, xc, part, input_precision="ieee")
    else:
        pairs = pairs | (MAGIC * 0x10001)
        w = tl.reshape(tl.join(pairs.to(tl.int16), (pairs >> 16).to(tl.int16)), (BLOCK_N, 16))
        part = tl.dot(w.to(xc.dtype, bitcast=True), xc, part)                      # OFFSET + code, exact
    return part, xs + xc.to(tl.float32)


@triton.jit
def _apply_group(acc, part, xs, scales_ptr, qzeros_ptr, t, i: tl.constexpr, offs_n, mask_n, N, G,
                 GROUP_SIZE: tl.constexpr, CHUNKS_PER_GROUP: tl.constexpr, OFFSET: tl.constexpr,
                 EVEN_N: tl.constexpr):
    # After the last chunk of a group: acc += s * part - s * (OFFSET + z) * sum(x of the group's rows).
    if (i + 1) % CHUNKS_PER_GROUP == 0:
        group = tl.minimum((t * 128 + (i + 1 - CHUNKS_PER_GROUP) * 16) // GROUP_SIZE, G - 1)
        s, zs, _ = _group_params(scales_ptr, qzeros_ptr, group, offs_n, mask_n, N, EVEN_N)
        acc += part * s[:, None] - tl.sum(xs, axis=0)[None, :] * (OFFSET * s + zs)[:, None]
        part = tl.zeros(part.shape, dtype=tl.float32)
        xs = tl.zeros(xs.shape, dtype=tl.float32)
    return acc, part, xs


@triton.jit
def _chunk_step(acc, part, xs, words, i: tl.constexpr, xc, scales_ptr, qzeros_ptr, t, offs_n, mask_n, N, G,
                GROUP_SIZE: tl.constexpr, CHUNKS_PER_GROUP: tl.constexpr, MAGIC: tl.constexpr, OFFSET: tl.constexpr,
                EVEN_N: tl.constexpr, BLOCK_N: tl.constexpr):
    # Chunk i of a K tile (its half's words, slot i % 4), then the group correction if chunk i ends a group.
    part, xs = _chunk_mma(words, i % 4, xc, part, xs, MAGIC, BLOCK_N)
    return _apply_group(acc, part, xs, scales_ptr, qzeros_ptr, t, i, offs_n, mask_n, N, G, GROUP_SIZE,
                        CHUNKS_PER_GROUP, OFFSET, EVEN_N)


@triton.jit
def _w4a16_decode_kernel(
    x_ptr,        # [M, K] activations (float16/bfloat16/float32), row stride stride_xm, unit column stride
    qweight_ptr,  # [K_pad/8, N] int32 contiguous, K-tiled (packing.pack_ktiled): word row 16t+8h+p holds
                  # rows 128t+16(4h+j)+2p (+1) in bits 4j (16+4j)
    scales_ptr,   # [G, N] float16 contiguous
    qzeros_ptr,   # [G, N/8] int32 contiguous, packed along N (slot i of word c <- column 8c+i)
    perm_ptr,     # [K] int64 (HAS_PERM): activation column that feeds input row k
    bias_ptr,     # [N] (HAS_BIAS)
    partial_ptr,  # [SPLIT_K, M, N] float32 workspace (SPLIT_K > 1)
    counter_ptr,  # [>= cdiv(M, BLOCK_M) * cdiv(N, BLOCK_N)] int32, zero on entry, left zero (SPLIT_K > 1)
    out_ptr,      # [M, N] in x's dtype, contiguous
    M, N, K, G, stride_xm, tiles_per_split,
    GROUP_SIZE: tl.constexpr, CHUNKS_PER_GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    SPLIT_K: tl.constexpr, HAS_PERM: tl.constexpr, HAS_BIAS: tl.constexpr, MAGIC: tl.constexpr,
    OFFSET: tl.constexpr, EVEN_K: tl.constexpr, EVEN_N: tl.constexpr,
):
    # Computed transposed, out^T [BLOCK_N, BLOCK_M] = W^T x^T, so that the dequantized weights are the MMA's
    # A operand, which Hopper's wgmma (and mma.sync) read from registers: the codes are unpacked straight
    # into the operand layout, never stored to shared memory. The x^T chunks (B operand, small) of the
    # next K tile are loaded while this one computes.
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_r = tl.arange(0, 16)
    mask_m = offs_m < M
    mask_n = offs_n < N
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    part = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    xs = tl.zeros((16, BLOCK_M), dtype=tl.float32)
    first = pid_k * tiles_per_split
    last = tl.minimum(first + tiles_per_split, tl.cdiv(K, 128))
    x0 = _x_chunk(x_ptr, perm_ptr, first, 0, offs_r, offs_m, mask_m, stride_xm, last, K, HAS_PERM, EVEN_K)
    x1 = _x_chunk(x_ptr, perm_ptr, first, 1, offs_r, offs_m, mask_m, stride_xm, last, K, HAS_PERM, EVEN_K)
    x2 = _x_chunk(x_ptr, perm_ptr, first, 2, offs_r, offs_m, mask_m, stride_xm, last, K, HAS_PERM, EVEN_K)
    x3 = _x_chunk(x_ptr, perm_ptr, first, 3, offs_r, offs_m, mask_m, stride_xm, last, K, HAS_PERM, EVEN_K)
    x4 = _x_chunk(x_ptr, perm_ptr, first, 4, offs_r, offs_m, mask_m, stride_xm, last, K, HAS_PERM, EVEN_K)
    x5 = _x_chunk(x_ptr, perm_ptr, first, 5, offs_r, offs_m, mask_m, stride_xm, last, K, HAS_PERM, EVEN_K)
    x6 = _x_chunk(x_ptr, perm_ptr, first, 6, offs_r, offs_m, mask_m, stride_xm, last, K, HAS_PERM, EVEN_K)
    x7 = _x_chunk(x_ptr, perm_ptr, first, 7, offs_r, offs_m, mask_m, stride_xm, last, K, HAS_PERM, EVEN_K)
    offs_p = tl.arange(0, 8)
    w_ptrs = qweight_ptr + (first * 16 + offs_p)[None, :].to(tl.int64) * N + offs_n[:, None]     # [BLOCK_N, 8]
    for t in range(first, last):
        if EVEN_N:
            lo_words = tl.load(w_ptrs)                   # word rows 16t + p: chunks 0-3
            hi_words = tl.load(w_ptrs + 8 * N)           # word rows 16t + 8 + p: chunks 4-7
        else:
            lo_words = tl.load(w_ptrs, mask=mask_n[:, None], other=0)
            hi_words = tl.load(w_ptrs + 8 * N, mask=mask_n[:, None], other=0)
        w_ptrs += 16 * N
        acc, part, xs = _chunk_step(acc, part, xs, lo_words, 0, x0, scales_ptr, qzeros_ptr, t, offs_n, mask_n, N, G,
                                    GROUP_SIZE, CHUNKS_PER_GROUP, MAGIC, OFFSET, EVEN_N, BLOCK_N)
        acc, part, xs = _chunk_step(acc, part, xs, lo_words, 1, x1, scales_ptr, qzeros_ptr, t, offs_n, mask_n, N, G,
                                    GROUP_SIZE, CHUNKS_PER_GROUP, MAGIC, OFFSET, EVEN_N, BLOCK_N)
        acc, part, xs = _chunk_step(acc, part, xs, lo_words, 2, x2, scales_ptr, qzeros_ptr, t, offs_n, mask_n, N, G,
                                    GROUP_SIZE, CHUNKS_PER_GROUP, MAGIC, OFFSET, EVEN_N, BLOCK_N)
        acc, part, xs = _chunk_step(acc, part, xs, lo_words, 3, x3, scales_ptr, qzeros_ptr, t, offs_n, mask_n, N, G,
                                    GROUP_SIZE, CHUNKS_PER_GROUP, MAGIC, OFFSET, EVEN_N, BLOCK_N)
        acc, part, xs = _chunk_step(acc, part, xs, hi_words, 4, x4, scales_ptr, qzeros_ptr, t, offs_n, mask_n, N, G,
                                    GROUP_SIZE, CHUNKS_PER_GROUP, MAGIC, OFFSET, EVEN_N, BLOCK_N)
        acc, part, xs = _chunk_step(acc, part, xs, hi_words, 5, x5, scales_ptr, qzeros_ptr, t, offs_n, mask_n, N, G,
                                    GROUP_SIZE, CHUNKS_PER_GROUP, MAGIC, OFFSET, EVEN_N, BLOCK_N)
        acc, part, xs = _chunk_step(acc, part, xs, hi_words, 6, x6, scales_ptr, qzeros_ptr, t, offs_n, mask_n, N, G,
                                    GROUP_SIZE, CHUNKS_PER_GROUP, MAGIC, OFFSET, EVEN_N, BLOCK_N)
        acc, part, xs = _chunk_step(acc, part, xs, hi_words, 7, x7, scales_ptr, qzeros_ptr, t, offs_n, mask_n, N, G,
                                    GROUP_SIZE, CHUNKS_PER_GROUP, MAGIC, OFFSET, EVEN_N, BLOCK_N)
        x0 = _x_chunk(x_ptr, perm_ptr, t + 1, 0, offs_r, offs_m, mask_m, stride_xm, last, K, HAS_PERM, EVEN_K)
        x1 = _x_chunk(x_ptr, perm_ptr, t + 1, 1, offs_r, offs_m, mask_m, stride_xm, last, K, HAS_PERM, EVEN_K)
        x2 = _x_chunk(x_ptr, perm_ptr, t + 1, 2, offs_r, offs_m, mask_m, stride_xm, last, K, HAS_PERM, EVEN_K)
        x3 = _x_chunk(x_ptr, perm_ptr, t + 1, 3, offs_r, offs_m, mask_m, stride_xm, last, K, HAS_PERM, EVEN_K)
        x4 = _x_chunk(x_ptr, perm_ptr, t + 1, 4, offs_r, offs_m, mask_m, stride_xm, last, K, HAS_PERM, EVEN_K)
        x5 = _x_chunk(x_ptr, perm_ptr, t + 1, 5, offs_r, offs_m, mask_m, stride_xm, last, K, HAS_PERM, EVEN_K)
        x6 = _x_chunk(x_ptr, perm_ptr, t + 1, 6, offs_r, offs_m, mask_m, stride_xm, last, K, HAS_PERM, EVEN_K)
        x7 = _x_chunk(x_ptr, perm_ptr, t + 1, 7, offs_r, offs_m, mask_m, stride_xm, last, K, HAS_PERM, EVEN_K)

    _finish(tl.trans(acc), pid_k, pid_n + pid_m * tl.num_programs(0), offs_m, offs_n, mask_m, mask_n, M, N, bias_ptr,
            partial_ptr, counter_ptr, out_ptr, SPLIT_K, HAS_BIAS)


@triton.jit
def _tile_sums(xt, BLOCK_N: tl.constexpr, X_SUMS: tl.constexpr):
    # sum(x) over the tile's 128 rows, float32: [1, BLOCK_M] summed from the x tile (X_SUMS), or [BLOCK_N, BLOCK_M]
    # from an MMA against an all-ones A
    if X_SUMS:
        sums = tl.sum(xt.to(tl.float32), axis=0)[None, :]
    elif xt.dtype == tl.float32:
        sums = tl.dot(tl.full((BLOCK_N, 128), 1.0, tl.float32), xt, input_precision="ieee")
    else:
        sums = tl.dot(tl.full((BLOCK_N, 128), 1.0, tl.float32).to(xt.dtype), xt)
    return sums


@triton.jit
def _w4a16_decode_tile_kernel(
    x_ptr, qweight_ptr, scales_ptr, qzeros_ptr, perm_ptr, bias_ptr, partial_ptr, counter_ptr, out_ptr,
    M, N, K, G, stride_xm, tiles_per_split,
    GROUP_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT_K: tl.constexpr,
    HAS_PERM: tl.constexpr, HAS_BIAS: tl.constexpr, MAGIC: tl.constexpr, OFFSET: tl.constexpr,
    EVEN_K: tl.constexpr, EVEN_N: tl.constexpr, ZERO_IN_REGS: tl.constexpr, X_SUMS: tl.constexpr, ASM: tl.constexpr,
    PREFETCH: tl.constexpr, X_IN_LOOP: tl.constexpr,
):
    # The same product for groups of a multiple of 128 rows (one group per K tile): one [BLOCK_N, 128] A
    # operand and one MMA per K tile instead of eight 16-row chunks, each with its own wait and x^T buffer.
    # The offset and zero point come off either in registers (ZERO_IN_REGS: (OFFSET + code) - (OFFSET + zero)
    # is the exact small integer code - zero, one packed subtraction per pair of weights, then one MMA) or
    # after the MMA, as s * (OFFSET + zero) * sum(x), the tile's sum(x) summed from the x tile (X_SUMS) or
    # taken from a second MMA against an all-ones A (twice the tensor-core work, and ptxas serializes the MMAs:
    # it bounds the kernel from about 32 rows on). PREFETCH loads the next tile's group parameters while this
    # tile computes; X_IN_LOOP loads each x tile at the top of its iteration (pipelined through shared memory by
    # Triton) instead of into registers one iteration ahead. Arguments as in _w4a16_decode_kernel.
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_kk = tl.arange(0, 128)
    mask_m = offs_m < M
    mask_n = offs_n < N
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    first = pid_k * tiles_per_split
    last = tl.minimum(first + tiles_per_split, tl.cdiv(K, 128))
    if not X_IN_LOOP:
        xt = _x_tile(x_ptr, perm_ptr, first, offs_kk, offs_m, mask_m, stride_xm, last, K, HAS_PERM, EVEN_K)
    w_ptrs = qweight_ptr + (first * 16 + tl.arange(0, 16))[None, :].to(tl.int64) * N + offs_n[:, None]  # [BN, 16]
    if PREFETCH:
        s_next, zs_next, z_next = _group_params(scales_ptr, qzeros_ptr, (first * 128) // GROUP_SIZE, offs_n, mask_n,
                                                N, EVEN_N)
    for t in range(first, last):
        if X_IN_LOOP:  # loaded where it is used: Triton's pipeliner streams it into shared memory with async copies
            xt = _x_tile(x_ptr, perm_ptr, t, offs_kk, offs_m, mask_m, stride_xm, last, K, HAS_PERM, EVEN_K)
        if EVEN_N:
            words = tl.load(w_ptrs)
        else:
            words = tl.load(w_ptrs, mask=mask_n[:, None], other=0)
        w_ptrs += 16 * N
        if PREFETCH:  # this tile's group parameters were loaded during the last tile; load the next tile's now
            s, zs, z = s_next, zs_next, z_next
            next_group = tl.minimum((t + 1) * 128 // GROUP_SIZE, G - 1)
            s_next, zs_next, z_next = _group_params(scales_ptr, qzeros_ptr, next_group, offs_n, mask_n, N, EVEN_N)
        else:
            s, zs, z = _group_params(scales_ptr, qzeros_ptr, (t * 128) // GROUP_SIZE, offs_n, mask_n, N, EVEN_N)
        if ZERO_IN_REGS:
            if xt.dtype == tl.float32:
                a = _tile_operand(words, MAGIC, BLOCK_N, True, z.to(tl.int32))
                acc += tl.dot(a, xt, input_precision="ieee") * s[:, None]
            else:
                a = _tile_operand(words, MAGIC, BLOCK_N, False, z.to(tl.int32), xt.dtype == tl.bfloat16, ASM)
                acc += tl.dot(a.to(xt.dtype, bitcast=True), xt) * s[:, None]        # a = code - zero, exact
        else:  # zero point taken off after the MMA (float32: the operand is the code itself, OFFSET 0)
            if xt.dtype == tl.float32:
                part = tl.dot(_tile_operand(words, MAGIC, BLOCK_N, True), xt, input_precision="ieee")
            else:
                a = _tile_operand(words, MAGIC, BLOCK_N, False, ASM=ASM)
                part = tl.dot(a.to(xt.dtype, bitcast=True), xt)                     # exact OFFSET + code
            acc += part * s[:, None] - _tile_sums(xt, BLOCK_N, X_SUMS) * (OFFSET * s + zs)[:, None]
        if not X_IN_LOOP:  # the next tile's x, into registers while this tile's results are used
            xt = _x_tile(x_ptr, perm_ptr, t + 1, offs_kk, offs_m, mask_m, stride_xm, last, K, HAS_PERM, EVEN_K)
    _finish(tl.trans(acc), pid_k, pid_n + pid_m * tl.num_programs(0), offs_m, offs_n, mask_m, mask_n, M, N, bias_ptr,
            partial_ptr, counter_ptr, out_ptr, SPLIT_K, HAS_BIAS)


@functools.lru_cache(maxsize=None)
def _capability(device: torch.device) -> tuple[int, int]:
    """The compute capability of a CUDA device; (9, 0) elsewhere (the interpreter runs no PTX)."""
    return torch.cuda.get_device_capability(device) if device.type == "cuda" else (9, 0)


def w4a16_decode(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, qzeros: torch.Tensor,
                 group_size: int, perm: torch.Tensor | None = None, bias: torch.Tensor | None = None,
                 counters: torch.Tensor | None = None, num_sms: int = 132,
                 config: DecodeConfig | None = None) -> torch.Tensor:
    """``x [M, K] @ W [K, N] + bias`` for ``M <= 64``, W the int4 weights; result ``[M, N]`` in ``x.dtype``.

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
        ValueError: ``M > 64``, ``group_size`` not a multiple of 16, or weights that do not cover ``x``'s K or
            have another N than the scales.
    """
    M, K = x.shape
    N = qweight.shape[1]
    if M > MAX_DECODE_ROWS or group_size % 16:
        raise ValueError(f"W4A16 decode kernel: needs at most {MAX_DECODE_ROWS} rows (got {M}) and a group "
                         f"size that is a multiple of 16 (got {group_size})")
    if qweight.shape[0] * 8 < K or scales.shape[0] * group_size < K or scales.shape[1] != N:
        raise ValueError(f"W4A16 decode kernel: x has {K} input features; qweight {tuple(qweight.shape)} and scales "
                         f"{tuple(scales.shape)} (group size {group_size}) cover fewer, or another output width")
    if x.stride(1) != 1:
        x = x.contiguous()
    chosen = config is None
    config = config or decode_config(M, N, K, num_sms)
    if config.gemv:
        if M <= MAX_GEMV_ROWS and group_size % PACK_K == 0 and K % PACK_K == 0:
            return w4a16_gemv(x, qweight, scales, qzeros, group_size, config, perm=perm, bias=bias,
                              counters=counters)
        config, chosen = tile_config(M, N, K, num_sms), True
    if chosen:
        config = fit_config(config, x.dtype, _capability(x.device))
    block_m = 16 if M <= 16 else 32 if M <= 32 else 64
    out = torch.empty((M, N), dtype=x.dtype, device=x.device)
    plan = plan_split_k(M, N, triton.cdiv(K, PACK_K), config.split_k, block_m, config.block_n, out, counters,
                        "W4A16 decode kernel")
    if group_size % PACK_K == 0:
        chunks_per_group = 8          # one group per K tile
    elif PACK_K % group_size == 0:
        chunks_per_group = group_size // 16
    else:                             # groups straddle tiles (e.g. 192 rows): scale every 16-row chunk
        chunks_per_group = 1
    magic, offset = _CODE_OFFSET.get(x.dtype, (0, 0.0))
    args = (x, qweight, scales, qzeros, perm if perm is not None else x, bias if bias is not None else x,
            plan.partial, plan.counters if plan.counters is not None else qweight, out,
            M, N, K, scales.shape[0], x.stride(0), plan.tiles_per_split)
    meta = dict(GROUP_SIZE=group_size, BLOCK_M=block_m, BLOCK_N=config.block_n, SPLIT_K=plan.grid[2],
                HAS_PERM=perm is not None, HAS_BIAS=bias is not None, MAGIC=magic, OFFSET=offset,
                EVEN_K=K % PACK_K == 0, EVEN_N=N % config.block_n == 0,
                num_warps=config.num_warps, num_stages=config.num_stages)
    if config.tile_mma and group_size % PACK_K == 0:
        kernel, meta["ZERO_IN_REGS"], meta["X_SUMS"] = _w4a16_decode_tile_kernel, config.zero_in_regs, config.x_sums
        meta["PREFETCH"], meta["X_IN_LOOP"] = config.prefetch, config.x_in_loop
        meta["ASM"] = not triton.knobs.runtime.interpret
    else:
        kernel, meta["CHUNKS_PER_GROUP"] = _w4a16_decode_kernel, chunks_per_group
    kernel[plan.grid](*args, **meta)
    return out
