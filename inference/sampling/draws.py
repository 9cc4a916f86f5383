"""The sampler's categorical draw, one token per row of probabilities: :func:`draw_tokens`.

On a GPU: the exponential race (``argmax(p / E)``, ``E ~ Exp(1)``, one exponential per vocabulary entry),
a few elementwise passes there. On the CPU: inversion of the cumulative distribution, one uniform number
per row. There, PyTorch draws exponentials at about 20 ns an element, single-threaded: 62 ms a step for
64 rows of SmolLM2's 49,152 entries, against 2 ms for the softmax (``benchmarks/sampler_cpu.py``).

A float32 prefix sum over the whole row would round each token's share of ``[0, 1)`` to the spacing of
floats near 1 (6e-8), which erases the tail; a float64 one converts the whole row (4-5x the softmax's
time). So the draw is two-level (inversion by blocks, Devroye, 1986, "Non-Uniform Random Variate
Generation", ch. 3): a block of ``BLOCK`` entries is chosen from the float64 prefix sum of the block
masses (accumulated in float64), then a token inside it from the float64 prefix sum of that block alone.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..host_to_device import tensor_to_device

BLOCK = 256  # vocabulary entries per block of the two-level inversion


def _first_above(cdf: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Per row, the first index ``i`` with ``cdf[i] > u`` (the entry whose interval holds ``u``); where
    rounding leaves ``u`` at or past the row's total, the last entry of nonzero mass instead.

    Args:
        cdf: ``[N, L]`` non-decreasing prefix sums.
        u: ``[N, 1]`` same dtype.
    Returns:
        ``[N, 1]`` int64 indices into ``L``.
    """
    idx = torch.searchsorted(cdf, u, right=True)
    past = idx >= cdf.shape[1]
    if bool(past.any()):
        last = torch.searchsorted(cdf, cdf[:, -1:], right=False)  # a trailing zero mass never holds u
        idx = torch.where(past, last, idx)
    return idx


def inverse_cdf_sample(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """One token per row of ``probs``, drawn with probability proportional to its entry.

    Args:
        probs: ``[N, V]`` float32, non-negative, rows of positive sum (need not sum to 1: masked
            entries such as min-p's may have been zeroed without renormalising).
        uniforms: ``[N]`` float64 in ``[0, 1)``, one per row (a seeded row's from its own generator).
    Returns:
        ``[N]`` int64 token ids; an entry of zero probability is never returned.
    """
    rows, vocab = probs.shape
    pad = (-vocab) % BLOCK
    blocks = (F.pad(probs, (0, pad)) if pad else probs).view(rows, -1, BLOCK)  # [N, nb, BLOCK]
    block_cdf = blocks.sum(-1, dtype=torch.float64).cumsum(-1)  # [N, nb]
    u = uniforms[:, None] * block_cdf[:, -1:]
    block = _first_above(block_cdf, u)  # [N, 1]
    below = torch.where(block > 0, block_cdf.gather(1, (block - 1).clamp_(min=0)), torch.zeros_like(u))
    inner_cdf = blocks.gather(1, block[:, :, None].expand(rows, 1, BLOCK)).squeeze(1).cumsum(-1, dtype=torch.float64)
    inner = _first_above(inner_cdf, u - below)  # inner_cdf: [N, BLOCK]
    return (block * BLOCK + inner).squeeze(1)


def exponential_race(probs: torch.Tensor, generators: dict[int, torch.Generator]) -> torch.Tensor:
    """``argmax(p / E)`` with ``E ~ Exp(1)`` per entry: a draw from ``p`` (the exponential race).

    Args:
        probs: ``[N, V]`` float32, non-negative.
        generators: row -> CPU ``torch.Generator`` of a seeded row (its noise is drawn on the host).
    Returns:
        ``[N]`` int64 token ids, on ``probs``' device.
    """
    noise = torch.empty_like(probs).exponential_()
    for row, generator in generators.items():
        noise[row] = tensor_to_device(torch.empty(probs.shape[1], dtype=probs.dtype).exponential_(
            generator=generator), probs.device)
    return (probs / noise).argmax(dim=-1)


def uniforms_for(rows: int, generators: dict[int, torch.Generator]) -> torch.Tensor:
    """``[rows]`` float64 uniforms in ``[0, 1)``; a seeded row's from its own generator."""
    uniforms = torch.rand(rows, dtype=torch.float64)
    for row, generator in generators.items():
        uniforms[row] = torch.rand(1, dtype=torch.float64, generator=generator)
    return uniforms


def draw_tokens(probs: torch.Tensor, generators: dict[int, torch.Generator]) -> torch.Tensor:
    """One token per row of ``probs [N, V]`` (float32): by inversion on the CPU, by the exponential race
    elsewhere. Returns ``[N]`` int64 on ``probs``' device."""
    if probs.device.type == "cpu":
        return inverse_cdf_sample(probs, uniforms_for(probs.shape[0], generators))
    return exponential_race(probs, generators)
