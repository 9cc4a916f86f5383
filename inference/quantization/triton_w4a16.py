"""Triton W4A16 matmul: ``x [M, K] @ dequant(qweight) [K, N]`` with the int4 weights dequantized inside
the kernel (no full-size copy of the weights is ever made).

Reference, CPU path and test oracle: ``int4.Int4LinearMethod`` dequantizes with
``packing.dequantize`` and calls ``torch.matmul``. Weights are in Tessera's internal layout (see
``packing``): ``qweight [K/8, N]`` int32 packed along K, ``qzeros [G, N/8]`` int32 packed along N,
``scales [G, N]`` float16, rows sorted by group (act-order checkpoints permute ``x`` instead).

Decode (small M) is a matrix-vector product bound by reading the weights; too few output tiles
would leave most SMs idle, so the K loop is split over ``SPLIT_K`` programs whose float32 partial
sums are added afterwards (deterministic, unlike atomics). Importing this module imports Triton.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl


@triton.jit
def _w4a16_kernel(
    x_ptr,        # [M, K] activations (float16/bfloat16/float32), row stride stride_xm, unit column stride
    qweight_ptr,  # [K/8, N] int32, contiguous: bits 4i..4i+3 of row r hold input row 8r+i
    scales_ptr,   # [G, N] float16, contiguous
    qzeros_ptr,   # [G, N/8] int32, contiguous: bits 4i..4i+3 of column c hold output column 8c+i
    out_ptr,      # [SPLIT_K, M, N] float32, contiguous: one partial sum per K split
    row_groups_ptr,  # [K] int32: the group of each input row (read only when ROW_GROUPS)
    M, N, K, stride_xm, group_size, k_blocks_per_split,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
    ROW_GROUPS: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < N
    offs_packed = tl.arange(0, BLOCK_K // 8)
    shifts = tl.arange(0, 8) * 4                    # code slot i of an int32: bits 4i..4i+3
    zero_shifts = (offs_n % 8) * 4
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    first = pid_k * k_blocks_per_split
    last = tl.minimum(first + k_blocks_per_split, K // BLOCK_K)
    for kb in range(first, last):
        k0 = kb * BLOCK_K
        offs_k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + offs_k[None, :],
                    mask=mask_m[:, None], other=0.0)
        packed = tl.load(qweight_ptr + (k0 // 8 + offs_packed)[:, None].to(tl.int64) * N + offs_n[None, :],
                         mask=mask_n[None, :], other=0)                    # [BLOCK_K/8, BLOCK_N]
        codes = (packed[:, None, :] >> shifts[None, :, None]) & 0xF          # [BLOCK_K/8, 8, BLOCK_N]
        codes = tl.reshape(codes, (BLOCK_K, BLOCK_N))                      # row 8r+i <- slot i of row r
        if ROW_GROUPS:  # act-order rows of a row-parallel shard: each row reads its own group
            groups = tl.load(row_groups_ptr + offs_k).to(tl.int64)           # [BLOCK_K]
            scale = tl.load(scales_ptr + groups[:, None] * N + offs_n[None, :], mask=mask_n[None, :],
                            other=0.0).to(tl.float32)                          # [BLOCK_K, BLOCK_N]
            zp = tl.load(qzeros_ptr + groups[:, None] * (N // 8) + (offs_n // 8)[None, :], mask=mask_n[None, :],
                         other=0)
            zero = ((zp >> zero_shifts[None, :]) & 0xF).to(tl.float32)
            w = ((codes.to(tl.float32) - zero) * scale).to(x.dtype)
        else:
            group = k0 // group_size              # BLOCK_K divides group_size: one group per block
            scale = tl.load(scales_ptr + group * N + offs_n, mask=mask_n, other=0.0).to(tl.float32)
            zp = tl.load(qzeros_ptr + group * (N // 8) + offs_n // 8, mask=mask_n, other=0)
            zero = ((zp >> zero_shifts) & 0xF).to(tl.float32)
            w = ((codes.to(tl.float32) - zero[None, :]) * scale[None, :]).to(x.dtype)
        acc += tl.dot(x, w, input_precision=DOT_PRECISION)
    out = out_ptr + pid_k.to(tl.int64) * M * N + offs_m[:, None].to(tl.int64) * N + offs_n[None, :]
    tl.store(out, acc, mask=mask_m[:, None] & mask_n[None, :])


@functools.lru_cache(maxsize=None)
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _block_k(K: int, group_size: int) -> int:
    for block in (128, 64, 32, 16):
        if group_size % block == 0 and K % block == 0:
            return block
    raise ValueError(f"W4A16 kernel: group size {group_size} and in_features {K} need a common "
                     "divisor among 16, 32, 64, 128")


def tile_config(M: int, N: int, K: int, group_size: int, num_sms: int) -> tuple[int, int, int, int]:
    """``(BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K)`` for a problem: small M (decode) takes narrow tiles
    and splits K until the grid covers about two waves of the ``num_sms`` SMs."""
    block_k = _block_k(K, group_size)
    if M <= 16:
        block_m, block_n = 16, 64
    elif M <= 32:
        block_m, block_n = 32, 64
    else:
        block_m, block_n = 64, 128
    tiles = triton.cdiv(M, block_m) * triton.cdiv(N, block_n)
    k_blocks = K // block_k
    split_k = max(1, min(k_blocks, (2 * num_sms) // tiles, 16))
    return block_m, block_n, block_k, split_k


def w4a16_matmul(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, qzeros: torch.Tensor,
                 group_size: int, num_sms: int | None = None,
                 row_groups: torch.Tensor | None = None) -> torch.Tensor:
    """``x [M, K] @ W [K, N]`` with W the int4 weights, result ``[M, N]`` in ``x.dtype``.

    Args:
        x: ``[M, K]`` float16/bfloat16/float32, unit column stride.
        qweight: ``[K/8, N]`` int32; qzeros ``[G, N/8]`` int32; scales ``[G, N]`` float16 (internal layout).
        group_size: input rows per group (K for per-channel), a multiple of 16.
        num_sms: SMs to fill (default: the device's; fixed in tests under the interpreter).
        row_groups: ``[K]`` int32, the group of each row when rows are not sorted by group (GPTQ
            act-order on a row-parallel rank); ``group_size`` then only sizes the K blocks.
    """
    M, K = x.shape
    N = qweight.shape[1]
    if x.stride(1) != 1:
        x = x.contiguous()
    if num_sms is None:
        num_sms = _num_sms(x.device.index or 0) if x.is_cuda else 8
    block_m, block_n, block_k, split_k = tile_config(M, N, K, group_size, num_sms)
    k_blocks_per_split = triton.cdiv(K // block_k, split_k)
    split_k = triton.cdiv(K // block_k, k_blocks_per_split)
    partial = torch.empty((split_k, M, N), dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(N, block_n), triton.cdiv(M, block_m), split_k)
    _w4a16_kernel[grid](x, qweight, scales, qzeros, partial, qweight if row_groups is None else row_groups,
                        M, N, K, x.stride(0), group_size, k_blocks_per_split,
                        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
                        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
                        ROW_GROUPS=row_groups is not None, num_warps=4, num_stages=3)
    out = partial[0] if split_k == 1 else partial.sum(0)
    return out.to(x.dtype)
