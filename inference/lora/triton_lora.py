"""Triton kernels of the batched LoRA matmuls (segmented gather matmuls, after Punica's SGMV,
Chen et al., "Punica: Multi-Tenant LoRA Serving", 2023). :mod:`.torch_ref` is their reference.

The token rows that use an adapter are grouped by slot (``sorted_rows``, segments ``slot_starts``) and cut
into tiles of ``BLOCK_M`` rows of one slot (:func:`.tiles.segment_tiles`, built on the host once a step). Each
program takes one tile; the grid has ``max_tiles(T, S)`` tiles, a bound that depends only on the batch's
row count and the slot count, so a CUDA graph captures it once (the unused tiles are empty and return at
once).
"""
from __future__ import annotations

import triton
import triton.language as tl
import torch

from ..triton_utils import num_sms
from .tiles import TILE_ROWS, max_tiles

BLOCK_M = TILE_ROWS
BLOCK_K = 64
BLOCK_N = 64


@triton.jit
def _lora_shrink_kernel(
    x_ptr,            # [T, K] model dtype, row stride stride_xm, unit column stride
    a_ptr,            # [S, R, K] model dtype, strides (stride_as, stride_ar, 1)
    part_ptr,         # [SPLIT_K, T, R] float32 partial sums, strides (stride_pk, stride_pm, 1)
    sorted_rows_ptr,  # [>= T] int32 token rows grouped by slot
    tiles_ptr,        # [>= grid 0, 3] int32 (slot, first, end) positions in sorted_rows; first == end: empty
    K, R, k_per_split, stride_xm, stride_as, stride_ar, stride_pk, stride_pm,
    BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    # Program (row tile, K slice, rank tile): the tile's rows over one slice of K.
    pid_t, pid_k, pid_r = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    slot = tl.load(tiles_ptr + pid_t * 3)
    m0 = tl.load(tiles_ptr + pid_t * 3 + 1)
    end = tl.load(tiles_ptr + pid_t * 3 + 2)
    if m0 < end:
        offs_m = m0 + tl.arange(0, BLOCK_M)
        mask_m = offs_m < end
        rows = tl.load(sorted_rows_ptr + offs_m, mask=mask_m, other=0).to(tl.int64)
        offs_r = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
        mask_r = offs_r < R
        k_begin = pid_k * k_per_split
        k_end = tl.minimum(k_begin + k_per_split, K)
        acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
        for k0 in range(k_begin, k_end, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            mask_k = offs_k < k_end
            x = tl.load(x_ptr + rows[:, None] * stride_xm + offs_k[None, :],
                        mask=mask_m[:, None] & mask_k[None, :], other=0.0)
            a = tl.load(a_ptr + slot * stride_as + offs_r[None, :] * stride_ar + offs_k[:, None],
                        mask=mask_r[None, :] & mask_k[:, None], other=0.0)  # [BLOCK_K, BLOCK_R]
            acc += tl.dot(x, a, input_precision=DOT_PRECISION)
        tl.store(part_ptr + pid_k * stride_pk + rows[:, None] * stride_pm + offs_r[None, :], acc,
                 mask=mask_m[:, None] & mask_r[None, :])


@triton.jit
def _lora_expand_kernel(
    s_ptr,             # [T, >= num_slices * r_max] float32 or model dtype, row stride stride_sm; a row's values
                       # for slot s start at column s * stride_s_slot (0: one set of columns for every slot)
    b_ptr,             # [S, N, r_max] model dtype, strides (stride_bs, stride_bn, 1)
    out_ptr,           # [T, N] model dtype, row stride stride_om, updated in place
    sorted_rows_ptr,   # [>= T] int32 token rows grouped by slot
    tiles_ptr,         # [>= grid 0, 3] int32 (slot, first, end) positions in sorted_rows; first == end: empty
    slice_starts_ptr,  # [num_slices + 1] int32 column offsets of the slices in out
    r_max, stride_sm, stride_s_slot, stride_bs, stride_bn, stride_om,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    # Program (row tile, column tile, slice).
    pid_t, pid_n, piece = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    slot = tl.load(tiles_ptr + pid_t * 3)
    m0 = tl.load(tiles_ptr + pid_t * 3 + 1)
    end = tl.load(tiles_ptr + pid_t * 3 + 2)
    n0 = tl.load(slice_starts_ptr + piece)
    n1 = tl.load(slice_starts_ptr + piece + 1)
    first_n = n0 + pid_n * BLOCK_N
    if (m0 < end) & (first_n < n1):
        offs_m = m0 + tl.arange(0, BLOCK_M)
        mask_m = offs_m < end
        rows = tl.load(sorted_rows_ptr + offs_m, mask=mask_m, other=0).to(tl.int64)
        offs_j = tl.arange(0, BLOCK_R)
        mask_j = offs_j < r_max
        offs_n = first_n + tl.arange(0, BLOCK_N)
        mask_n = offs_n < n1
        s = tl.load(s_ptr + rows[:, None] * stride_sm + (slot * stride_s_slot + piece * r_max + offs_j)[None, :],
                    mask=mask_m[:, None] & mask_j[None, :], other=0.0)
        b = tl.load(b_ptr + slot * stride_bs + offs_n[None, :] * stride_bn + offs_j[:, None],
                    mask=mask_j[:, None] & mask_n[None, :], other=0.0)  # [BLOCK_R, BLOCK_N]
        acc = tl.dot(s.to(b.dtype), b, input_precision=DOT_PRECISION)
        out_ptrs = out_ptr + rows[:, None] * stride_om + offs_n[None, :]
        mask = mask_m[:, None] & mask_n[None, :]
        out = tl.load(out_ptrs, mask=mask, other=0.0)
        tl.store(out_ptrs, (out.to(tl.float32) + acc).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _lora_expand_all_slots_kernel(
    y_ptr,             # [T, N + S * num_slices * r_max] model dtype, row stride stride_ym, unit column stride: the
                       # base outputs, then every slot's shrink at columns N + (slot * num_slices + slice) * r_max + j
    b_ptr,             # [S, N, r_max] model dtype, strides (stride_bs, stride_bn, 1)
    bias_ptr,          # [N] model dtype (read only with HAS_BIAS)
    row_slots_ptr,     # [>= T] int32 slot of each row, -1: no adapter
    out_ptr,           # [T, N] model dtype, row stride stride_om, unit column stride
    slice_starts_ptr,  # [num_slices + 1] int32 column offsets of the slices in out
    T, N, r_max, num_slots, num_slices, stride_ym, stride_bs, stride_bn, stride_om,
    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    # Program (row tile, column tile, slice): rows in their own order, each reading only its own slot's shrink
    # columns (the others are masked to zero), against the stacked B of every slot.
    pid_m, pid_n, piece = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    n0 = tl.load(slice_starts_ptr + piece)
    n1 = tl.load(slice_starts_ptr + piece + 1)
    first_n = n0 + pid_n * BLOCK_N
    if first_n < n1:
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        mask_m = offs_m < T
        slot = tl.load(row_slots_ptr + offs_m, mask=mask_m, other=-1)
        offs_n = first_n + tl.arange(0, BLOCK_N)
        mask_n = offs_n < n1
        offs_c = tl.arange(0, BLOCK_C)  # column c of the stacked B: slot c // r_max, rank c % r_max
        c_slot = offs_c // r_max
        c_j = offs_c % r_max
        mask_c = offs_c < num_slots * r_max
        rows = offs_m.to(tl.int64)[:, None] * stride_ym
        s = tl.load(y_ptr + rows + (N + (c_slot * num_slices + piece) * r_max + c_j)[None, :],
                    mask=mask_m[:, None] & mask_c[None, :] & (c_slot[None, :] == slot[:, None]), other=0.0)
        b = tl.load(b_ptr + c_slot[:, None] * stride_bs + offs_n[None, :] * stride_bn + c_j[:, None],
                    mask=mask_c[:, None] & mask_n[None, :], other=0.0)  # [BLOCK_C, BLOCK_N]
        acc = tl.dot(s.to(b.dtype), b, input_precision=DOT_PRECISION)
        mask = mask_m[:, None] & mask_n[None, :]
        acc += tl.load(y_ptr + rows + offs_n[None, :], mask=mask, other=0.0).to(tl.float32)
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :],
                 acc.to(out_ptr.dtype.element_ty), mask=mask)


def _dot_precision(dtype: torch.dtype) -> str:
    # float32 models multiply in full float32 ("ieee"), as the attention and W4A16 kernels do; Triton's
    # default for float32 operands is TF32 (10 mantissa bits), 1e-3 off the PyTorch path on a GPU.
    return "ieee" if dtype == torch.float32 else "tf32"


def _block_r(width: int) -> int:
    return max(16, triton.next_power_of_2(width))


def shrink_split_k(num_tokens: int, k: int, device: torch.device) -> int:
    """Slices of K the shrink splits into: a decode batch has few row tiles per slot (one program per slot
    and tile would leave most SMs idle while each walks all of K), so K is split until the row tiles times
    the slices are about four programs per SM; never below ``BLOCK_K`` columns a slice. Depends only on
    the batch's row count (a CUDA graph captures it once)."""
    row_tiles = triton.cdiv(num_tokens, BLOCK_M)
    k_blocks = triton.cdiv(k, BLOCK_K)
    wanted = max(1, min(k_blocks, triton.cdiv(4 * num_sms(device), row_tiles)))
    return triton.cdiv(k_blocks, triton.cdiv(k_blocks, wanted))  # slices of whole, equal block counts


def lora_shrink(x: torch.Tensor, a: torch.Tensor, sorted_rows: torch.Tensor, tiles: torch.Tensor) -> torch.Tensor:
    """``[T, R]`` float32 low-rank activations; rows without an adapter hold no meaningful value (never read).

    Args:
        x: ``[T, K]`` contiguous rows; a: ``[S, R, K]`` contiguous, same dtype as ``x``.
        sorted_rows: ``[>= T]`` int32; tiles: ``[>= max_tiles(T, S), 3]`` int32 from :func:`.tiles.segment_tiles`.

    K is split over programs (:func:`shrink_split_k`); the slices' partial sums are added in a fixed order
    (deterministic, unlike atomics).
    """
    num_tokens, k = x.shape
    num_slots, r, _ = a.shape
    split_k = shrink_split_k(num_tokens, k, x.device)
    k_per_split = triton.cdiv(triton.cdiv(k, BLOCK_K), split_k) * BLOCK_K
    part = torch.empty((split_k, num_tokens, r), dtype=torch.float32, device=x.device)
    block_r = min(_block_r(r), 64)
    grid = (max_tiles(num_tokens, num_slots), split_k, triton.cdiv(r, block_r))
    _lora_shrink_kernel[grid](x, a, part, sorted_rows, tiles, k, r, k_per_split, x.stride(0), a.stride(0),
                              a.stride(1), part.stride(0), part.stride(1), BLOCK_M=BLOCK_M, BLOCK_R=block_r,
                              BLOCK_K=BLOCK_K, DOT_PRECISION=_dot_precision(x.dtype))
    return part[0] if split_k == 1 else part.sum(0)


def lora_shrink_all_slots(x: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    """``[T, S * R]`` in the dtype of ``x``: every row against every slot's ``A`` in one dense matmul (cuBLAS),
    row ``t``'s own values at columns ``slot(t) * R ..`` (pass ``slot_stride=R`` to :func:`lora_expand_`).
    For small batches (a decode step): ``S`` times the FLOPs of :func:`lora_shrink`, which are negligible
    there, in one kernel instead of the shrink and the sum of its split-K partials.

    Args:
        x: ``[T, K]``; a: ``[S, R, K]`` contiguous, same dtype as ``x``.
    """
    return x @ a.view(-1, a.shape[2]).t()


def lora_expand_(out: torch.Tensor, s: torch.Tensor, b: torch.Tensor, sorted_rows: torch.Tensor,
                 tiles: torch.Tensor, slice_starts: torch.Tensor, r_max: int, max_slice_width: int,
                 slot_stride: int = 0) -> None:
    """``out += B s`` per slot segment and slice, in place (see :func:`.torch_ref.lora_expand_ref`).

    Args:
        out: ``[T, N]`` with unit column stride; s: ``[T, num_slices * r_max]`` float32 (:func:`lora_shrink`),
            or ``[T, S * num_slices * r_max]`` (:func:`lora_shrink_all_slots`, with ``slot_stride`` its
            ``num_slices * r_max``), unit column stride;
        b: ``[S, N, r_max]`` contiguous; tiles: ``[>= max_tiles(T, S), 3]`` int32 (:func:`.tiles.segment_tiles`);
        slice_starts: ``[num_slices + 1]`` int32 on the device;
        max_slice_width: the widest slice's columns (host int, sizes the grid).
    """
    num_tokens = out.shape[0]
    num_slices = slice_starts.shape[0] - 1
    grid = (max_tiles(num_tokens, b.shape[0]), triton.cdiv(max_slice_width, BLOCK_N), num_slices)
    _lora_expand_kernel[grid](s, b, out, sorted_rows, tiles, slice_starts, r_max, s.stride(0), slot_stride,
                              b.stride(0), b.stride(1), out.stride(0), BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,
                              BLOCK_R=_block_r(r_max), DOT_PRECISION=_dot_precision(b.dtype))


def lora_expand_all_slots(y: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None, row_slots: torch.Tensor,
                          slice_starts: torch.Tensor, max_slice_width: int) -> torch.Tensor:
    """``[T, N]`` new tensor: ``y[:, :N] + B[slot(t)] s[t] (+ bias)``, ``s[t]`` row ``t``'s own slot's shrink out of
    the every-slot shrink that ``y`` carries after its ``N`` base columns (a GEMM against the base weight with
    every slot's ``A`` stacked below it computes both, see :class:`.layers.LoRALinear`). Rows of slot -1 get the
    base output (and bias) alone. For small batches: each program reads the ``B`` of every slot, which a decode
    step reads anyway when its rows use every slot.

    Args:
        y: ``[T, N + S * num_slices * r_max]``, unit column stride, columns ``N + (slot * num_slices + k) * r_max + j``
            the shrink of slice ``k``; b: ``[S, N, r_max]`` contiguous; bias: ``[N]`` or None;
        row_slots: ``[>= T]`` int32 on the device; slice_starts: ``[num_slices + 1]`` int32 on the device;
        max_slice_width: the widest slice's columns (host int, sizes the grid).
    """
    num_tokens = y.shape[0]
    num_slots, n, r_max = b.shape
    num_slices = slice_starts.shape[0] - 1
    out = torch.empty((num_tokens, n), dtype=y.dtype, device=y.device)
    block_m = min(32, max(16, triton.next_power_of_2(num_tokens)))
    grid = (triton.cdiv(num_tokens, block_m), triton.cdiv(max_slice_width, BLOCK_N), num_slices)
    _lora_expand_all_slots_kernel[grid](
        y, b, y if bias is None else bias, row_slots, out, slice_starts, num_tokens, n, r_max, num_slots,
        num_slices, y.stride(0), b.stride(0), b.stride(1), out.stride(0), HAS_BIAS=bias is not None,
        BLOCK_M=block_m, BLOCK_N=BLOCK_N, BLOCK_C=_block_r(num_slots * r_max), DOT_PRECISION=_dot_precision(b.dtype))
    return out
