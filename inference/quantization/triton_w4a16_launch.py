"""Host side of the W4A16 decode kernels (:mod:`.triton_w4a16_decode`) and of the split-K launches that share
their epilogue (the FP8 GEMM's too): the K split and its workspace, and the decode kernel's config by shape."""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
import triton

from .packing import PACK_K


@dataclass(frozen=True)
class SplitKPlan:
    """Host side of a split-K launch whose epilogue is ``_finish``: the grid ``(N tiles, M tiles,
    splits)``, K tiles per split, and the workspace (``partial``, ``counters``) that splits need."""

    grid: tuple[int, int, int]
    tiles_per_split: int
    partial: torch.Tensor
    counters: torch.Tensor | None


def plan_split_k(M: int, N: int, k_tiles: int, split_k: int, block_m: int, block_n: int, out: torch.Tensor,
                 counters: torch.Tensor | None, what: str) -> SplitKPlan:
    """The launch of ``k_tiles`` K tiles cut into at most ``split_k`` non-empty splits, writing ``out``.
    With more than one split: a ``[splits, M, N]`` float32 workspace, and ``counters`` (allocated as zeros
    when None; they are left zero by the kernel). ``partial`` is ``out`` itself with one split.

    Raises:
        ValueError: fewer ``counters`` than output tiles (``what`` names the kernel in the message).
    """
    tiles_per_split = triton.cdiv(k_tiles, split_k)
    splits = triton.cdiv(k_tiles, tiles_per_split)
    grid = (triton.cdiv(N, block_n), triton.cdiv(M, block_m), splits)
    partial = out
    if splits > 1:
        partial = torch.empty((splits, M, N), dtype=torch.float32, device=out.device)
        if counters is None:
            counters = torch.zeros(grid[0] * grid[1], dtype=torch.int32, device=out.device)
        if counters.numel() < grid[0] * grid[1]:
            raise ValueError(f"{what}: {counters.numel()} split-K counters for {grid[0] * grid[1]} tiles")
    return SplitKPlan(grid, tiles_per_split, partial, counters)


@dataclass(frozen=True)
class DecodeConfig:
    """Launch parameters of the decode kernels: output tile width, K split, warps, pipeline stages, and which
    kernel and loop variant runs (``prefetch``: the next K tile's loads issued while a tile computes, in the tile
    and GEMV kernels)."""

    block_n: int
    split_k: int
    num_warps: int = 4
    num_stages: int = 4
    tile_mma: bool = False  # one MMA per 128-row K tile (_w4a16_decode_tile_kernel) where groups allow it
    zero_in_regs: bool = True  # tile kernel: zero point subtracted before the MMA, not by a second MMA
    x_sums: bool = False  # tile kernel without zero_in_regs: each tile's sum(x) from the x tile, not an all-ones MMA
    prefetch: bool = True  # tile kernel: the next K tile's scales and zero points loaded while this tile computes
    x_in_loop: bool = False  # tile kernel: x tiles async-copied by Triton's pipeliner, not loaded ahead into registers
    gemv: bool = False  # up to 4 rows, groups of a multiple of 128: the CUDA-core kernel (triton_w4a16_gemv)


def decode_config(M: int, N: int, K: int, num_sms: int) -> DecodeConfig:
    """A config for ``x [M, K] @ W [K, N]`` on ``num_sms`` SMs, chosen by the H100 sweep of the variants
    (``w4a16-sweep-gemv_h100_2026-12-06.json``, the 7B shapes, the variants in one run):

    - one row and ``N < 16384`` (qkv, o, down): the CUDA-core GEMV kernel without prefetch (``gemv_config``):
      on down 20.8 us against 24.6 for the tile kernel's previous config, qkv 8.3 against 9.6;
    - otherwise the tile kernel with one MMA per 128-row K tile, the zero point subtracted in registers, x tiles
      loaded by Triton's pipeliner inside the loop (``x_in_loop``) and 128-column output tiles: at one row on
      gate_up 37.4 us against 41.1; at 8 and 16 rows 9-13% faster on gate_up and down; at 64 rows 62.2 against
      93.3 us on gate_up and 34.8 against 44.3 on down. At 2 and 4 rows the GEMV kernel took 1.2-2.2x longer.

    K is not split where the 128-column output tiles alone give two programs an SM (gate_up: 296 tiles on 132 SMs;
    at one row 38.6 against 42.8 us with two splits, at 16 rows 37.9 against 40.8,
    ``w4a16-tile-sweep-warps_h100_2026-12-07.json``; 37.1 against 39.7 at 16 rows in
    ``w4a16-split-k_h100_2026-12-07.json``). Elsewhere it is split to the power of two nearest to about four
    programs per SM up to 16 rows (counted over 64-column tiles where ``N < 16384``, as swept), two above; at most
    16 splits, each of at least three 128-row K tiles."""
    if M == 1 and N < 16384:
        return replace(gemv_config(M, N, K, num_sms), prefetch=False)
    return tile_config(M, N, K, num_sms)


def tile_config(M: int, N: int, K: int, num_sms: int) -> DecodeConfig:
    """``decode_config``'s choice for the tile kernel (also where a GEMV config meets rows, groups or a K that
    the GEMV kernel does not take)."""
    k_tiles = triton.cdiv(K, PACK_K)
    small = M <= 16
    split_tile_n = (128 if N >= 16384 else 64) if small else 128
    programs_per_sm = 4 if small else 2
    split_k = 2 ** max(0, round(math.log2(max(1.0, programs_per_sm * num_sms / triton.cdiv(N, split_tile_n)))))
    split_k = max(1, min(split_k, 16, k_tiles // 3))
    if triton.cdiv(N, 128) >= 2 * num_sms:  # the output tiles alone give two programs an SM: no split
        split_k = 1
    return DecodeConfig(block_n=128, split_k=split_k, num_warps=4, tile_mma=True, zero_in_regs=True,
                        x_in_loop=True)


def fit_config(config: DecodeConfig, dtype: torch.dtype, capability: tuple[int, int]) -> DecodeConfig:
    """``config`` (a ``decode_config`` or ``tile_config`` choice, timed on an H100) made to run with ``dtype``
    activations on a GPU of compute ``capability``: float32 x tiles stay out of the pipeline (``x_in_loop``
    would hold 112-184 KB of shared memory, over the 99 KB of an sm_86/sm_89 block), and before sm_90 bfloat16
    takes the zero point off after the MMA (``x_sums``), as ``sub.bf16x2`` needs sm_90."""
    if config.gemv:
        return config
    if dtype == torch.float32 and config.x_in_loop:
        config = replace(config, x_in_loop=False)
    if dtype == torch.bfloat16 and config.zero_in_regs and tuple(capability) < (9, 0):
        config = replace(config, zero_in_regs=False, x_sums=True)
    return config


def gemv_config(M: int, N: int, K: int, num_sms: int) -> DecodeConfig:
    """A config for the CUDA-core GEMV kernel (``M <= 4``, ``triton_w4a16_gemv``): 128-column tiles of 4 warps (four
    columns a thread, one 16-byte load of each word row), and K split to the power of two nearest to about four
    programs per SM, at most 16 splits of at least two 128-row K tiles (``decode_config`` takes it, without
    prefetch, for one row of the narrower layers)."""
    k_tiles = triton.cdiv(K, PACK_K)
    split_k = 2 ** max(0, round(math.log2(max(1.0, 4 * num_sms / triton.cdiv(N, 128)))))
    return DecodeConfig(block_n=128, split_k=max(1, min(split_k, 16, k_tiles // 2)), num_warps=4, gemv=True)
