"""Greedy argmax over the vocabulary in two Triton kernels, for the captured decode windows.

``torch.argmax`` over W2's bfloat16 logits (151,936 a row, about 243 rows) took 54 us a step on the H200,
about three times the 18 us of reading 256 such rows once at 4.25 TB/s
(``w2-kernel-profile_h200_2026-12-01_a.json``); these two kernels took 27.0 + 1.5 us
(``w2-kernel-profile_h200_2026-12-01_b.json``). Each program of the first kernel takes the maximum of one
slice of a row's vocabulary, and the second picks the row's best slice.
Two launches cost host time on the step-by-step path (a Triton argmax there lost W2 2-4%), so only the window graphs (:mod:`inference.runner.window_graph`), replayed with no per-kernel
host work, use it.

Importing this module imports Triton; the CPU engine never imports it.
Reference: ``torch.argmax(logits, dim=-1)``, which it matches, ties included (the lowest index wins), and
NaN too (a NaN counts as larger than any number, the first NaN wins), except that a +inf before a row's
first NaN wins here.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

SLICE = 8192  # vocabulary entries per program of the first kernel


@triton.jit
def _slice_max_kernel(
    logits_ptr,     # [B, V] any float dtype, row stride stride_l, unit column stride
    best_ptr,       # [B, S] float32: each slice's maximum
    index_ptr,      # [B, S] int32: its lowest vocabulary index
    stride_l, vocab_size, num_slices,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    s = tl.program_id(1)
    cols = s * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(logits_ptr + row * stride_l + cols, mask=cols < vocab_size, other=float("-inf")).to(tl.float32)
    # NaN as +inf, as torch.argmax takes NaN for the maximum: compared as they are, a NaN would lose to
    # whichever value the reduction order brings next (masked padding included, an index past the vocabulary).
    x = tl.where(x != x, float("inf"), x)
    best, where = tl.max(x, 0, return_indices=True, return_indices_tie_break_left=True)
    tl.store(best_ptr + row * num_slices + s, best)
    tl.store(index_ptr + row * num_slices + s, s * BLOCK + where)


@triton.jit
def _row_argmax_kernel(
    best_ptr, index_ptr,  # [B, S] from _slice_max_kernel
    out_ptr,              # [B] int64, element stride stride_o
    stride_o, num_slices,
    BLOCK_S: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_S)
    mask = offs < num_slices
    best = tl.load(best_ptr + row * num_slices + offs, mask=mask, other=float("-inf"))
    _, where = tl.max(best, 0, return_indices=True, return_indices_tie_break_left=True)
    where = tl.minimum(where, num_slices - 1)  # a padding lane never wins a tie, but never read past the row
    token = tl.load(index_ptr + row * num_slices + where)
    tl.store(out_ptr + row * stride_o, token.to(tl.int64))


def greedy_argmax(logits: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``argmax(logits, dim=-1)``: the lowest index of each row's maximum.

    Args:
        logits: ``[B, V]`` float16/bfloat16/float32, ``V > 0``, unit column stride, any row stride.
        out: optional ``[B]`` int64 destination on the same device, any stride (e.g. a column of a ``[B, N]``
            token buffer).
    Returns:
        ``[B]`` int64 token ids (``out`` when given).
    Raises:
        ValueError: ``logits`` not 2-D with unit column stride, of another dtype or with no column, or ``out``
            of the wrong shape, dtype or device.
    """
    if logits.dim() != 2 or logits.stride(1) != 1 or logits.shape[1] == 0:
        raise ValueError(f"logits must be [B, V] with V > 0 and unit column stride, got {tuple(logits.shape)} "
                         f"strides {logits.stride()}")
    if logits.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"logits must be float16, bfloat16 or float32, got {logits.dtype}")
    batch, vocab = logits.shape
    if out is None:
        out = torch.empty(batch, dtype=torch.int64, device=logits.device)
    elif out.shape != (batch,) or out.dtype != torch.int64 or out.device != logits.device:
        raise ValueError(f"out must be [{batch}] int64 on {logits.device}, got {tuple(out.shape)} {out.dtype} "
                         f"on {out.device}")
    if batch == 0:
        return out
    num_slices = triton.cdiv(vocab, SLICE)
    best = torch.empty(batch, num_slices, dtype=torch.float32, device=logits.device)
    index = torch.empty(batch, num_slices, dtype=torch.int32, device=logits.device)
    _slice_max_kernel[(batch, num_slices)](logits, best, index, logits.stride(0), vocab, num_slices,
                                           BLOCK=SLICE, num_warps=8)
    _row_argmax_kernel[(batch,)](best, index, out, out.stride(0), num_slices,
                                 BLOCK_S=triton.next_power_of_2(num_slices), num_warps=1)
    return out
