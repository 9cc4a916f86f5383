"""Triton W4A16 matmul: ``x [M, K] @ dequant(qweight) [K, N]`` with the int4 weights dequantized inside
the kernel (no full-size copy of the weights is ever made).

``w4a16_matmul`` is the entry point, by the number of rows M:

* up to ``MAX_DECODE_ROWS`` (decode): the split-K kernel of ``triton_w4a16_decode``;
* from ``DEQUANT_MIN_ROWS`` on (prefill, mixed batches with a prompt chunk): the weights dequantized to
  ``x.dtype`` in column chunks, then cuBLAS (``triton_w4a16_dequant``);
* in between: the tiled GEMM here, which dequantizes a ``[128, BLOCK_N]`` weight tile once per ``BLOCK_M``
  rows and multiplies it with one ``tl.dot``.

A layer whose rows carry their own group indices (``row_groups``: GPTQ act-order on a row-parallel rank)
takes the GEMM below ``DEQUANT_MIN_ROWS`` (the decode kernel reads one group per 16 rows).

Reference, CPU path and test oracle: ``int4.Int4LinearMethod`` dequantizes with
``packing.dequantize_internal`` and calls ``torch.matmul``. Weights are in Tessera's internal K-tiled
layout (see ``packing``): ``qweight [K_pad/8, N]`` int32, ``qzeros [G, N/8]`` int32 packed along N,
``scales [G, N]`` float16, rows sorted by group (act-order checkpoints permute ``x`` instead, except on a
row-parallel rank, whose rows stay in checkpoint order with ``row_groups``).
Importing this module imports Triton.
"""
from __future__ import annotations


import torch
import triton
import triton.language as tl

from ..triton_utils import num_sms as device_num_sms
from .packing import PACK_K
from .triton_w4a16_decode import MAX_DECODE_ROWS, w4a16_decode
from .triton_w4a16_dequant import dequant_matmul

# Rows from which dequantize-then-cuBLAS beats the W4A16 GEMM kernel. Per weight, the dequantized copy
# moves 2.5 bytes (0.5 read, 2 written; about 0.6 ps at the H200's 4,250 GB/s) while the product costs 2M
# FLOPs: 2.5 ps per 1,000 rows at cuBLAS's 790 TFLOP/s, about 3x that through the GEMM kernel (prefill
# through it made TTFT 2.4x bf16's). Break-even is then near 0.6 / (7.7 - 2.5) * 1,000 = 115 rows; at 2,048
# rows the copy adds under 12% to cuBLAS's time. The sweep (benchmarks/w4a16_sweep.py) times both at
# 64 and 256 rows; ``w4a16_matmul(dequant_min_rows=...)`` overrides it.
DEQUANT_MIN_ROWS = 128


@triton.jit
def _w4a16_kernel(
    x_ptr,        # [M, K] activations (float16/bfloat16/float32), row stride stride_xm, unit column stride
    qweight_ptr,  # [K_pad/8, N] int32 contiguous, K-tiled (packing.pack_ktiled)
    scales_ptr,   # [G, N] float16, contiguous
    qzeros_ptr,   # [G, N/8] int32, contiguous: bits 4i..4i+3 of column c hold output column 8c+i
    out_ptr,      # [SPLIT_K, M, N] float32, contiguous: one partial sum per K split
    row_groups_ptr,  # [K] int32: the group of each input row (read only when ROW_GROUPS)
    M, N, K, G, stride_xm, k_blocks_per_split,
    GROUP_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
    ROW_GROUPS: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < N
    offs_packed = tl.arange(0, 16)
    shifts = tl.arange(0, 8) * 4                    # code slot i of an int32: bits 4i..4i+3
    zero_shifts = (offs_n % 8) * 4
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    first = pid_k * k_blocks_per_split
    last = tl.minimum(first + k_blocks_per_split, tl.cdiv(K, 128))
    for kb in range(first, last):
        offs_k = kb * 128 + tl.arange(0, 128)
        x = tl.load(x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + offs_k[None, :],
                    mask=mask_m[:, None] & (offs_k < K)[None, :], other=0.0)
        packed = tl.load(qweight_ptr + (kb * 16 + offs_packed)[:, None].to(tl.int64) * N + offs_n[None, :],
                         mask=mask_n[None, :], other=0)                    # [16, BLOCK_N]
        # slot s = 4e + j of word row q = 8h + p holds tile row 64h + 16j + 2p + e (packing.pack_ktiled)
        codes = (packed[None, :, :] >> shifts[:, None, None]) & 0xF          # [(e, j), (h, p), BLOCK_N]
        codes = tl.permute(tl.reshape(codes, (2, 4, 2, 8, BLOCK_N)), (2, 1, 3, 0, 4))   # [h, j, p, e, BLOCK_N]
        codes = tl.reshape(codes, (128, BLOCK_N)).to(tl.float32)           # natural row order
        if ROW_GROUPS:  # act-order rows of a row-parallel shard, in checkpoint order: each reads its own group
            group = tl.load(row_groups_ptr + offs_k, mask=offs_k < K, other=0).to(tl.int64)[:, None]
            scale = tl.load(scales_ptr + group * N + offs_n[None, :], mask=mask_n[None, :], other=0.0).to(tl.float32)
            zp = tl.load(qzeros_ptr + group * (N // 8) + offs_n[None, :] // 8, mask=mask_n[None, :], other=0)
        elif GROUP_SIZE % 128 == 0:               # one group per K tile
            group = tl.minimum(kb * 128 // GROUP_SIZE, G - 1)
            scale = tl.load(scales_ptr + group * N + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
            zp = tl.load(qzeros_ptr + group * (N // 8) + offs_n // 8, mask=mask_n, other=0)[None, :]
        else:                                     # a group per row
            group = tl.minimum(offs_k // GROUP_SIZE, G - 1)[:, None]
            scale = tl.load(scales_ptr + group * N + offs_n[None, :], mask=mask_n[None, :], other=0.0).to(tl.float32)
            zp = tl.load(qzeros_ptr + group * (N // 8) + offs_n[None, :] // 8, mask=mask_n[None, :], other=0)
        zero = ((zp >> zero_shifts[None, :]) & 0xF).to(tl.float32)
        w = ((codes - zero) * scale).to(x.dtype)
        acc += tl.dot(x, w, input_precision=DOT_PRECISION)
    out = out_ptr + pid_k.to(tl.int64) * M * N + offs_m[:, None].to(tl.int64) * N + offs_n[None, :]
    tl.store(out, acc, mask=mask_m[:, None] & mask_n[None, :])


def tile_config(M: int, N: int, K: int, num_sms: int, float32: bool = False) -> tuple[int, int, int]:
    """``(BLOCK_M, BLOCK_N, SPLIT_K)`` of the GEMM kernel: small M takes narrow tiles and splits K
    (in 128-row tiles) until the grid covers about two waves of the ``num_sms`` SMs. float32 activations
    keep tiles 64 columns wide (and ``w4a16_gemm`` pipelines two stages, not three): 64 x 128 float32
    tiles in three stages asked for 344 KB of shared memory on the H200, over its 227 KB."""
    if M <= 16:
        block_m, block_n = 16, 64
    elif M <= 32:
        block_m, block_n = 32, 64
    elif float32:
        block_m, block_n = 64, 64
    else:
        block_m, block_n = 64, 128
    tiles = triton.cdiv(M, block_m) * triton.cdiv(N, block_n)
    split_k = max(1, min(triton.cdiv(K, PACK_K), (2 * num_sms) // tiles, 16))
    return block_m, block_n, split_k


def w4a16_gemm(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, qzeros: torch.Tensor,
               group_size: int, num_sms: int, row_groups: torch.Tensor | None = None) -> torch.Tensor:
    """The tiled GEMM kernel alone (any M): ``x [M, K] @ W [K, N]``, result ``[M, N]`` in ``x.dtype``.
    Arguments as ``w4a16_matmul``'s."""
    M, K = x.shape
    N = qweight.shape[1]
    if x.stride(1) != 1:
        x = x.contiguous()
    float32 = x.dtype == torch.float32
    block_m, block_n, split_k = tile_config(M, N, K, num_sms, float32)
    k_blocks_per_split = triton.cdiv(triton.cdiv(K, PACK_K), split_k)
    split_k = triton.cdiv(triton.cdiv(K, PACK_K), k_blocks_per_split)
    partial = torch.empty((split_k, M, N), dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(N, block_n), triton.cdiv(M, block_m), split_k)
    _w4a16_kernel[grid](x, qweight, scales, qzeros, partial, qweight if row_groups is None else row_groups,
                        M, N, K, scales.shape[0], x.stride(0), k_blocks_per_split, GROUP_SIZE=group_size,
                        BLOCK_M=block_m, BLOCK_N=block_n, DOT_PRECISION="ieee" if float32 else "tf32",
                        ROW_GROUPS=row_groups is not None, num_warps=4, num_stages=2 if float32 else 3)
    out = partial[0] if split_k == 1 else partial.sum(0)
    return out.to(x.dtype)


def w4a16_matmul(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, qzeros: torch.Tensor,
                 group_size: int, perm: torch.Tensor | None = None, bias: torch.Tensor | None = None,
                 counters: torch.Tensor | None = None, num_sms: int | None = None,
                 row_groups: torch.Tensor | None = None, dequant_min_rows: int = DEQUANT_MIN_ROWS) -> torch.Tensor:
    """``x [M, K] @ W [K, N] + bias`` with W the int4 weights, result ``[M, N]`` in ``x.dtype``.

    Args:
        x: ``[M, K]`` float16/bfloat16/float32.
        qweight: ``[K_pad/8, N]`` int32 K-tiled; qzeros ``[G, N/8]`` int32; scales ``[G, N]`` float16
            (internal layout, ``K = G * group_size`` unless ``row_groups`` is given).
        group_size: input rows per group (K for per-channel), a multiple of 16.
        perm: ``[K]`` int64 act-order permutation: input row ``k`` multiplies ``x[:, perm[k]]``.
        bias: ``[N]`` or None. counters: the decode kernel's split-K counters (see ``w4a16_decode``).
        num_sms: SMs to fill (default: the device's; fixed in tests under the interpreter).
        row_groups: ``[K]`` int32, the group of each row when rows are not sorted by group (GPTQ
            act-order on a row-parallel rank, ``perm`` None); ``G`` is then the full layer's groups.
        dequant_min_rows: from this many rows on, dequantize then cuBLAS (``DEQUANT_MIN_ROWS``).

    Raises:
        ValueError: ``group_size`` not a multiple of 16.
    """
    if num_sms is None:
        num_sms = device_num_sms(x.device)
    M = x.shape[0]
    # The decode kernels read one scale and zero point per 16-row slice of a K tile, which per-row groups
    # (row_groups) break; those layers take the GEMM kernel, which reads a group per row, below the
    # dequantize path.
    if M <= MAX_DECODE_ROWS and M < dequant_min_rows and row_groups is None:
        return w4a16_decode(x, qweight, scales, qzeros, group_size, perm=perm, bias=bias, counters=counters,
                            num_sms=num_sms)
    if group_size % 16:
        raise ValueError(f"W4A16 kernel: group size {group_size} is not a multiple of 16")
    if perm is not None:
        x = x.index_select(1, perm)
    if M >= dequant_min_rows:
        out = dequant_matmul(x, qweight, scales, qzeros, group_size, row_groups)
    else:
        out = w4a16_gemm(x, qweight, scales, qzeros, group_size, num_sms, row_groups)
    return out if bias is None else out + bias.to(out.dtype)
