"""Large-row-count W4A16 path: dequantize the int4 weights to the activations' dtype with a Triton kernel,
then multiply with ``torch.matmul`` (cuBLAS).

A prefill of thousands of rows is compute-bound: the weight bytes no longer matter, the tensor cores'
rate does, and cuBLAS on 16-bit operands beats any kernel that unpacks int4 inside its main loop. The
dequantized copy costs 2.5 bytes per weight of memory traffic (0.5 read, 2 written) plus the 2 bytes cuBLAS
reads back, against ``2 M`` FLOPs per weight for the product: see ``triton_w4a16.DEQUANT_MIN_ROWS`` for
where that pays. The copy is made in chunks of output columns into a scratch tensor of at most
``DEQUANT_CHUNK_BYTES`` (one chunk for every Qwen2.5-7B layer but gate_up, which takes two), so the extra
memory stays bounded whatever the layer.

Layout written: ``[N_chunk, K]`` row-major, like ``nn.Linear.weight``, so the product is the same
``F.linear`` GEMM (cuBLAS "TN") a bf16 layer runs. Reference, CPU path and test oracle:
``packing.dequantize_internal`` (rows sorted by group) or ``packing.dequantize`` with ``row_groups``.
Importing this module imports Triton.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .packing import PACK_K

DEQUANT_CHUNK_BYTES = 160 << 20  # scratch for one chunk of dequantized weights: 7B's down (130 MiB) fits whole
_BLOCK_N = 64


@triton.jit
def _dequant_kernel(
    qweight_ptr,     # [K_pad/8, N] int32 contiguous, K-tiled (packing.pack_ktiled)
    scales_ptr,      # [G, N] float16 contiguous
    qzeros_ptr,      # [G, N/8] int32 contiguous: bits 4i..4i+3 of word c hold output column 8c+i
    row_groups_ptr,  # [K] int32: the group of each input row (read only when ROW_GROUPS)
    out_ptr,         # [n_end - n_start, K] in the activations' dtype, contiguous (row n - n_start = column n)
    N, K, G, n_start, n_end,
    GROUP_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, ROW_GROUPS: tl.constexpr,
):
    # One program: a 128-row K tile of BLOCK_N output columns, read as [16, BLOCK_N] words, written as
    # w[n, k] = (code - zero) * scale, transposed into the nn.Linear layout.
    kb = tl.program_id(0)
    offs_n = n_start + tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = kb * 128 + tl.arange(0, 128)
    mask_n = offs_n < n_end
    mask_k = offs_k < K
    packed = tl.load(qweight_ptr + (kb * 16 + tl.arange(0, 16))[:, None].to(tl.int64) * N + offs_n[None, :],
                     mask=mask_n[None, :], other=0)                               # [16, BLOCK_N]
    # slot s = 4e + j of word row q = 8h + p holds tile row 64h + 16j + 2p + e (packing.pack_ktiled)
    codes = (packed[None, :, :] >> (tl.arange(0, 8) * 4)[:, None, None]) & 0xF  # [(e, j), (h, p), BLOCK_N]
    codes = tl.permute(tl.reshape(codes, (2, 4, 2, 8, BLOCK_N)), (2, 1, 3, 0, 4))
    codes = tl.reshape(codes, (128, BLOCK_N)).to(tl.float32)                   # natural row order
    if ROW_GROUPS:     # act-order rows of a row-parallel shard, in checkpoint order: each reads its own group
        group = tl.load(row_groups_ptr + offs_k, mask=mask_k, other=0).to(tl.int64)[:, None]
    elif GROUP_SIZE % 128 == 0:
        group = tl.minimum(kb * 128 // GROUP_SIZE, G - 1).to(tl.int64) + tl.zeros((1, 1), tl.int64)
    else:
        group = tl.minimum(offs_k // GROUP_SIZE, G - 1).to(tl.int64)[:, None]
    scale = tl.load(scales_ptr + group * N + offs_n[None, :], mask=mask_n[None, :], other=0.0).to(tl.float32)
    zp = tl.load(qzeros_ptr + group * (N // 8) + offs_n[None, :] // 8, mask=mask_n[None, :], other=0)
    zero = ((zp >> ((offs_n % 8) * 4)[None, :]) & 0xF).to(tl.float32)
    w = (codes - zero) * scale                                                  # [128, BLOCK_N]
    out = out_ptr + (offs_n - n_start)[None, :].to(tl.int64) * K + offs_k[:, None]
    tl.store(out, w.to(out_ptr.dtype.element_ty), mask=mask_k[:, None] & mask_n[None, :])


def dequantize_w4a16(qweight: torch.Tensor, scales: torch.Tensor, qzeros: torch.Tensor, group_size: int,
                     in_features: int, dtype: torch.dtype, n_start: int = 0, n_end: int | None = None,
                     row_groups: torch.Tensor | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """Output columns ``n_start:n_end`` of the int4 weights as ``[n_end - n_start, in_features]`` in ``dtype``
    (the ``nn.Linear.weight`` layout): ``(code - zero) * scale``, computed in float32.

    Args:
        qweight: ``[K_pad/8, N]`` int32 K-tiled; scales ``[G, N]`` float16; qzeros ``[G, N/8]`` int32.
        group_size: input rows per group (rows sorted by group unless ``row_groups`` is given).
        in_features: ``K``. row_groups: ``[K]`` int32, each row's group (GPTQ act-order on a row-parallel rank).
        out: a contiguous tensor of that shape and dtype to write (a reused scratch), or None to allocate.
    """
    N = qweight.shape[1]
    n_end = N if n_end is None else n_end
    if out is None:
        out = torch.empty((n_end - n_start, in_features), dtype=dtype, device=qweight.device)
    grid = (triton.cdiv(in_features, PACK_K), triton.cdiv(n_end - n_start, _BLOCK_N))
    _dequant_kernel[grid](qweight, scales, qzeros, qweight if row_groups is None else row_groups, out,
                          N, in_features, scales.shape[0], n_start, n_end, GROUP_SIZE=group_size,
                          BLOCK_N=_BLOCK_N, ROW_GROUPS=row_groups is not None, num_warps=4)
    return out


def chunk_columns(N: int, K: int, element_size: int) -> int:
    """Output columns per dequantized chunk: all ``N`` if ``[N, K]`` fits ``DEQUANT_CHUNK_BYTES``, else
    an equal split into the fewest chunks that fit, each a multiple of the kernel's 64-column tile."""
    chunks = triton.cdiv(N * K * element_size, DEQUANT_CHUNK_BYTES)
    return N if chunks <= 1 else triton.cdiv(triton.cdiv(N, chunks), _BLOCK_N) * _BLOCK_N


def dequant_matmul(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, qzeros: torch.Tensor,
                   group_size: int, row_groups: torch.Tensor | None = None) -> torch.Tensor:
    """``x [M, K] @ W [K, N]`` by dequantizing W chunk by chunk and ``F.linear`` (cuBLAS); ``[M, N]`` in
    ``x.dtype`` (float16/bfloat16/float32). Rows of ``x`` must already be in the weights' row order (act-order
    ``perm`` applied). Arguments as ``dequantize_w4a16``'s."""
    M, K = x.shape
    N = qweight.shape[1]
    cols = chunk_columns(N, K, x.element_size())
    if cols >= N:
        return F.linear(x, dequantize_w4a16(qweight, scales, qzeros, group_size, K, x.dtype, row_groups=row_groups))
    out = torch.empty((M, N), dtype=x.dtype, device=x.device)
    scratch = torch.empty((cols, K), dtype=x.dtype, device=x.device)
    for n_start in range(0, N, cols):
        n_end = min(N, n_start + cols)
        weight = dequantize_w4a16(qweight, scales, qzeros, group_size, K, x.dtype, n_start, n_end,
                                  row_groups, scratch[:n_end - n_start])
        torch.mm(x, weight.t(), out=out[:, n_start:n_end])   # strided output: cuBLAS writes with ldc = N
    return out
