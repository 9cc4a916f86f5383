"""Applying grammar bitmasks to logits: tokens a grammar does not allow next get ``-inf``.

The bitmask layout is xgrammar's: ``[R, ceil(V / 32)]`` int32, bit ``t % 32`` of word ``t // 32``
set when token ``t`` is allowed. Only the ``R`` constrained rows of the step's logits are named
(``rows``); the others are not touched. On CUDA a Triton kernel (:mod:`.triton_bitmask`) does it
in one launch; :func:`apply_token_bitmask_reference` is the CPU path and its test oracle.
"""
from __future__ import annotations

import torch

WORD_BITS = 32


def bitmask_width(vocab_size: int) -> int:
    """int32 words per row of a bitmask over ``vocab_size`` tokens."""
    return -(-vocab_size // WORD_BITS)


def apply_token_bitmask_reference(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> None:
    """In place: ``logits[rows[i], t] = -inf`` where bit ``t`` of ``bitmask[i]`` is clear.

    Args:
        logits: ``[N, V]`` float (any float dtype), modified in place.
        bitmask: ``[R, ceil(V / 32)]`` int32, on ``logits``' device.
        rows: ``[R]`` int64 row indices into ``logits``.
    """
    vocab = logits.shape[1]
    shifts = torch.arange(WORD_BITS, device=bitmask.device, dtype=torch.int32)
    allowed = ((bitmask[:, :, None] >> shifts) & 1).reshape(bitmask.shape[0], -1)[:, :vocab].bool()
    logits[rows] = logits[rows].masked_fill(~allowed, float("-inf"))


def apply_token_bitmask_(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> None:
    """:func:`apply_token_bitmask_reference`, on CUDA by the Triton kernel.

    Raises:
        ValueError: ``bitmask`` is narrower than ``logits`` needs or ``rows`` and ``bitmask``
            disagree on ``R``.
    """
    if bitmask.shape[1] < bitmask_width(logits.shape[1]) or bitmask.shape[0] != rows.shape[0]:
        raise ValueError(f"bitmask {tuple(bitmask.shape)} does not cover logits {tuple(logits.shape)} "
                         f"at rows {tuple(rows.shape)}")
    if logits.is_cuda:
        from .triton_bitmask import apply_token_bitmask_triton  # noqa: PLC0415 - the CPU engine never imports Triton

        apply_token_bitmask_triton(logits, bitmask, rows)
    else:
        apply_token_bitmask_reference(logits, bitmask, rows)
