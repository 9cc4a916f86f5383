"""The grammar bitmask as a Triton kernel: one program per (constrained row, vocabulary block),
which reads the block's bitmask words and writes ``-inf`` over the tokens whose bit is clear.

Reference and CPU path: :func:`.bitmask.apply_token_bitmask_reference`. Importing this module
imports Triton.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 4096  # vocabulary entries per program


@triton.jit
def _apply_bitmask_kernel(
    logits_ptr,     # [N, V] any float dtype, row stride stride_l, unit column stride
    bitmask_ptr,    # [R, W] int32, row stride stride_b; bit t % 32 of word t // 32: token t allowed
    rows_ptr,       # [R] int64: the logits row of each bitmask row
    stride_l, stride_b, vocab_size,
    BLOCK: tl.constexpr,
):
    i = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = cols < vocab_size
    row = tl.load(rows_ptr + i)
    words = tl.load(bitmask_ptr + i * stride_b + cols // 32, mask=inside, other=-1)
    allowed = ((words >> (cols % 32)) & 1) != 0
    tl.store(logits_ptr + row * stride_l + cols, tl.full([BLOCK], float("-inf"), tl.float32)
             .to(logits_ptr.dtype.element_ty), mask=inside & ~allowed)


def apply_token_bitmask_triton(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> None:
    """In place, as :func:`.bitmask.apply_token_bitmask_reference` (shapes there)."""
    vocab = logits.shape[1]
    if rows.shape[0] == 0:
        return
    grid = (rows.shape[0], triton.cdiv(vocab, BLOCK))
    _apply_bitmask_kernel[grid](logits, bitmask, rows, logits.stride(0), bitmask.stride(0), vocab, BLOCK=BLOCK)
