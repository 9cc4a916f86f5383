"""Triton W4A16 kernel for 17-64 rows with the weights as the MMA's B operand: ``out [M, N] = x [M, K] @ W [K, N]``.

The decode tile kernel (``triton_w4a16_decode._w4a16_decode_tile_kernel``) computes the transpose so that the
dequantized weights are the A operand, read from registers. That suits a few rows: the MMA's M side (64 on
Hopper's wgmma) is then the output tile, and x is a narrow B. From 32 rows on the tensor cores do as much work as
the weights' bytes allow, and the issue is their rate: with A from registers the dequantization and the MMA
share each warp's issue slots, and at 64 rows the tile kernel reads int4 at 470-1,110 GB/s on the 7B shape's
layers, slower than bf16 cuBLAS on qkv and o (``w4a16-tile-sweep_h100_2026-12-07.json``).

Here x is the A operand, ``[BLOCK_M, 128]`` per K tile (the MMA's M side is the batch, 64 rows filling one
wgmma), and the weight tile is unpacked in registers, as ``code - zero`` exactly (the operand helpers of
``triton_w4a16_operand``), then handed to the MMA as ``[128, BLOCK_N]``: Triton stores it to shared memory once
per K tile and both operands are read from there, so one x tile serves a ``BLOCK_N``-wide output tile of up to
256 columns. The group's scale multiplies the MMA's float32 result, one multiply per output element and K tile.
Split-K and its epilogue as the decode kernels (``triton_splitk._finish``).

Groups must be a multiple of 128 rows (one group per K tile). Reference and test oracle: ``packing.dequantize``
then ``torch.matmul``. Source of the operand roles: Marlin (Frantar et al., 2024, arXiv:2408.11743) feeds the
dequantized weights to the MMA as B with the activations as A for the same reason, on mma.sync fragments.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .triton_splitk import _finish
from .triton_w4a16_operand import _group_params, _tile_operand


@triton.jit
def _x_rows(x_ptr, perm_ptr, t, offs_kk, offs_m, mask_m, stride_xm, K, HAS_PERM: tl.constexpr,
            EVEN_K: tl.constexpr):
    # x tile [BLOCK_M, 128]: input columns 128t .. 128t + 127 (act-order: the columns perm names), zeros past K
    offs_k = t * 128 + offs_kk
    if HAS_PERM:
        cols = tl.load(perm_ptr + offs_k, mask=offs_k < K, other=0)
    else:
        cols = offs_k
    if EVEN_K:
        mask = mask_m[:, None]
    else:
        mask = mask_m[:, None] & (offs_k < K)[None, :]
    return tl.load(x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + cols[None, :], mask=mask, other=0.0)


@triton.jit
def _w4a16_wide_kernel(
    x_ptr, qweight_ptr, scales_ptr, qzeros_ptr, perm_ptr, bias_ptr, partial_ptr, counter_ptr, out_ptr,
    M, N, K, G, stride_xm, tiles_per_split,
    GROUP_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT_K: tl.constexpr,
    HAS_PERM: tl.constexpr, HAS_BIAS: tl.constexpr, MAGIC: tl.constexpr, EVEN_K: tl.constexpr,
    EVEN_N: tl.constexpr, ASM: tl.constexpr, SCALE_IN_B: tl.constexpr,
):
    # Arguments as triton_w4a16_decode._w4a16_decode_kernel; GROUP_SIZE a multiple of 128. SCALE_IN_B: the group's
    # scale multiplies the operand (the dequantized weight, as the reference rounds it), so that every MMA adds
    # into one accumulator and the next tile's unpacking need not wait for this tile's MMA to finish.
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_kk = tl.arange(0, 128)
    mask_m = offs_m < M
    mask_n = offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    first = pid_k * tiles_per_split
    last = tl.minimum(first + tiles_per_split, tl.cdiv(K, 128))
    w_ptrs = qweight_ptr + (first * 16 + tl.arange(0, 16))[None, :].to(tl.int64) * N + offs_n[:, None]  # [BN, 16]
    for t in range(first, last):
        x = _x_rows(x_ptr, perm_ptr, t, offs_kk, offs_m, mask_m, stride_xm, K, HAS_PERM, EVEN_K)
        if EVEN_N:
            words = tl.load(w_ptrs)
        else:
            words = tl.load(w_ptrs, mask=mask_n[:, None], other=0)
        w_ptrs += 16 * N
        s, _, z = _group_params(scales_ptr, qzeros_ptr, (t * 128) // GROUP_SIZE, offs_n, mask_n, N, EVEN_N)
        if SCALE_IN_B:
            a = _tile_operand(words, MAGIC, BLOCK_N, x.dtype == tl.float32, z.to(tl.int32), x.dtype == tl.bfloat16,
                              ASM, s)
            if x.dtype == tl.float32:
                acc = tl.dot(x, tl.trans(a), acc, input_precision="ieee")
            else:
                acc = tl.dot(x, tl.trans(a.to(x.dtype, bitcast=True)), acc)
        elif x.dtype == tl.float32:
            a = _tile_operand(words, MAGIC, BLOCK_N, True, z.to(tl.int32))
            acc += tl.dot(x, tl.trans(a), input_precision="ieee") * s[None, :]
        else:
            a = _tile_operand(words, MAGIC, BLOCK_N, False, z.to(tl.int32), x.dtype == tl.bfloat16, ASM)
            acc += tl.dot(x, tl.trans(a.to(x.dtype, bitcast=True))) * s[None, :]   # a = code - zero, exact
    _finish(acc, pid_k, pid_n + pid_m * tl.num_programs(0), offs_m, offs_n, mask_m, mask_n, M, N, bias_ptr,
            partial_ptr, counter_ptr, out_ptr, SPLIT_K, HAS_BIAS)
