"""Triton W4A16 matrix-vector kernel for one to a few rows: ``x [M, K] @ dequant(qweight) [K, N] (+ bias)`` on
the CUDA cores, without tensor-core MMAs.

At one row the MMA tile kernel (:mod:`.triton_w4a16_decode`) wastes 15 of the MMA's 16 rows, and its bound is
not the MMA but the per-tile epilogue that waits for it: the group's scale, zero point and the x tile meet the
accumulator in the MMA's layout, and every such layout conversion is a block barrier (7-8 a K tile in the sm_90
SASS; ``benchmarks/w4a16_stage_probe.py``). Here every value a thread touches lives in one layout, that of the
packed words it loads: each thread keeps float32 partial sums ``[its columns, its word rows, BLOCK_M]`` over
the whole K split, and the word rows are summed across threads once, at the end.

Per weight the loop issues one ``lop3`` and one FMA to dequantize, and one FMA per row. A code ``c`` in bits
``4i..4i+3`` of a 16-bit half (``i`` < 4) becomes a float32 by masking it in place and OR-ing in the exponent of
``2^23``: the float is ``2^23 + c * 16^i`` exactly, and one FMA, ``that * 16^-i - (2^23 * 16^-i + z)``, leaves
``c - z`` exactly (scaling by a power of two is exact, and so is the difference of two integers below 2^24).
The zero point's ``2^23 + z`` comes from the same OR. Only the high half of each word needs a shift. Per K tile
and group the partial sums take the group's scale. (The exponent trick: Kim et al., 2022, "Who Says Elephants
Can't Run", arXiv:2211.10017; here in float32, with the nibble's position folded into the FMA's factor instead
of shifting every code down.)

Weights, scales, zero points, act-order ``perm`` and the split-K epilogue are the tile kernel's
(``packing.pack_ktiled`` layout, groups of a multiple of 128 rows). Reference, CPU path and test oracle:
``packing.dequantize_internal`` then ``torch.matmul``.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .packing import PACK_K
from .triton_splitk import _finish
from .triton_w4a16_launch import DecodeConfig, plan_split_k

# Rows this kernel serves: each costs one FMA a weight (the unpacking is shared), and from 8 rows Triton's
# layouts put the x loads through shared memory.
MAX_GEMV_ROWS = 4


@triton.jit
def _slot(half, i: tl.constexpr, ASM: tl.constexpr):
    # bits 4i..4i+3 of each int32 in ``half`` (the rest cleared) OR 2^23's exponent, as float32: 2^23 + code * 16^i.
    # ASM: one lop3 (ptxas emits an AND and an OR for two constants); else the same bits (Triton's interpreter)
    if ASM:
        if i == 0:
            bits = tl.inline_asm_elementwise("lop3.b32 $0, $1, 0x0000000F, 0x4B000000, 0xEA;", "=r,r", [half],
                                             dtype=tl.int32, is_pure=True, pack=1)
        elif i == 1:
            bits = tl.inline_asm_elementwise("lop3.b32 $0, $1, 0x000000F0, 0x4B000000, 0xEA;", "=r,r", [half],
                                             dtype=tl.int32, is_pure=True, pack=1)
        elif i == 2:
            bits = tl.inline_asm_elementwise("lop3.b32 $0, $1, 0x00000F00, 0x4B000000, 0xEA;", "=r,r", [half],
                                             dtype=tl.int32, is_pure=True, pack=1)
        else:
            bits = tl.inline_asm_elementwise("lop3.b32 $0, $1, 0x0000F000, 0x4B000000, 0xEA;", "=r,r", [half],
                                             dtype=tl.int32, is_pure=True, pack=1)
    else:
        bits = (half & (0xF << (4 * i))) | 0x4B000000
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _tile_loads(w_ptrs, scales_ptr, qzeros_ptr, group, n3, n_vec, N, EVEN_N: tl.constexpr, valid=True):
    # One K tile's words [BN, 16, 1] int32 and its group's scales [BN, 16, 1] float16 and zero-point words
    # [BN, 16, 1] int32 (n_vec: each column's index broadcast over the word rows, so that all three loads share
    # the words' layout). ``valid`` False: nothing is read (a prefetch past the split's last tile).
    if EVEN_N:
        mask, mask_s = valid, valid
    else:
        mask, mask_s = (n3 < N) & valid, (n_vec < N) & valid
    words = tl.load(w_ptrs, mask=mask, other=0)
    s = tl.load(scales_ptr + group * N + n_vec, mask=mask_s, other=0.0)
    zp = tl.load(qzeros_ptr + group * (N // 8) + n_vec // 8, mask=mask_s, other=0)
    return words, s, zp


@triton.jit
def _x_pair(x_ptrs, x_rows, perm_ptrs, off: tl.constexpr, mask, HAS_PERM: tl.constexpr, X_PAIRS: tl.constexpr):
    # x at input rows ``off`` and ``off + 1`` after each word row's first (the slots of its low and high halves), as
    # float32 [1, 16, BM]. X_PAIRS: 16-bit x, both in one 32-bit load (the host checked the alignment); bfloat16
    # widens by a shift or a mask, float16 by a conversion of each half.
    if HAS_PERM:
        lo = tl.load(x_rows + tl.load(perm_ptrs + off), mask=mask, other=0.0).to(tl.float32)
        hi = tl.load(x_rows + tl.load(perm_ptrs + (off + 1)), mask=mask, other=0.0).to(tl.float32)
    elif X_PAIRS:
        both = tl.load((x_ptrs + off).to(tl.pointer_type(tl.int32), bitcast=True), mask=mask, other=0)
        if x_ptrs.dtype.element_ty == tl.bfloat16:
            lo = (both << 16).to(tl.float32, bitcast=True)
            hi = (both & -65536).to(tl.float32, bitcast=True)
        else:
            lo = both.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
            hi = (both >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    else:
        lo = tl.load(x_ptrs + off, mask=mask, other=0.0).to(tl.float32)
        hi = tl.load(x_ptrs + (off + 1), mask=mask, other=0.0).to(tl.float32)
    return lo, hi


@triton.jit
def _w4a16_gemv_kernel(
    x_ptr, qweight_ptr, scales_ptr, qzeros_ptr, perm_ptr, bias_ptr, partial_ptr, counter_ptr, out_ptr,
    M, N, K, G, stride_xm, tiles_per_split,
    GROUP_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT_K: tl.constexpr,
    HAS_PERM: tl.constexpr, HAS_BIAS: tl.constexpr, EVEN_N: tl.constexpr, ASM: tl.constexpr,
    PREFETCH: tl.constexpr, X_PAIRS: tl.constexpr,
):
    # Grid (N tiles, M tiles, K splits). Word row r = 8h + p of a K tile holds, in its half e (bits 16e..), input
    # rows 64h + 16i + 2p + e in nibble i (packing.pack_ktiled): slot (e, i) of word row r multiplies x at
    # 128t + k_word[r] + 16i + e. Arguments as in triton_w4a16_decode._w4a16_decode_kernel.
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_r = tl.arange(0, 16)
    mask_m = offs_m < M
    mask_n = offs_n < N
    first = pid_k * tiles_per_split
    last = tl.minimum(first + tiles_per_split, tl.cdiv(K, 128))
    # Every tensor is [BLOCK_N, 16 word rows, BLOCK_M rows] or broadcast to it: the words' load fixes the layout
    # (four columns a thread, one 16-byte load), the rows stay in each thread's registers.
    n3 = offs_n[:, None, None]
    r3 = offs_r[None, :, None]
    k_word = 64 * (r3 // 8) + 2 * (r3 % 8)                                                    # [1, 16, 1]
    x_rows = x_ptr + offs_m[None, None, :].to(tl.int64) * stride_xm                          # [1, 1, BM]
    x_ptrs = x_rows + (first * 128 + k_word)               # [1, 16, BM]: each word row's first input row in tile t
    perm_ptrs = perm_ptr + (first * 128 + k_word)          # act-order: the column of x that input row reads
    w_ptrs = qweight_ptr + (first * 16 + r3).to(tl.int64) * N + n3                           # [BN, 16, 1]
    # one scale and zero word per column, loaded as [BN, 16, 1] like the words (4 columns a thread): no
    # layout conversion, so no shared memory and no barrier in the loop
    n_vec = tl.max_contiguous(n3, [4, 1, 1]) + 0 * r3
    acc = tl.zeros((BLOCK_N, 16, BLOCK_M), dtype=tl.float32)
    if PREFETCH:
        words_next, s_next, zp_next = _tile_loads(w_ptrs, scales_ptr, qzeros_ptr, (first * 128) // GROUP_SIZE, n3,
                                                  n_vec, N, EVEN_N)
    for t in range(first, last):
        if PREFETCH:  # this tile's loads were issued during the last tile; issue the next tile's now
            words, s, zp = words_next, s_next, zp_next
            w_ptrs += 16 * N
            words_next, s_next, zp_next = _tile_loads(w_ptrs, scales_ptr, qzeros_ptr,
                                                      tl.minimum(t + 1, last - 1) * 128 // GROUP_SIZE, n3, n_vec, N,
                                                      EVEN_N, t + 1 < last)
        else:
            words, s, zp = _tile_loads(w_ptrs, scales_ptr, qzeros_ptr, (t * 128) // GROUP_SIZE, n3, n_vec, N, EVEN_N)
            w_ptrs += 16 * N
        s = s.to(tl.float32)
        # 2^23 + z: the zero point OR-ed into 2^23's mantissa, as the codes are (no integer-to-float conversion)
        z_magic = (((zp >> ((n3 % 8) * 4)) & 0xF) | 0x4B000000).to(tl.float32, bitcast=True)
        part = tl.zeros((BLOCK_N, 16, BLOCK_M), dtype=tl.float32)
        high = words >> 16  # the high halves; the arithmetic shift fills bits the masks clear
        for i in tl.static_range(4):
            x_lo, x_hi = _x_pair(x_ptrs, x_rows, perm_ptrs, 16 * i, mask_m[None, None, :], HAS_PERM, X_PAIRS)
            # (2^23 + c 16^i) 16^-i - (2^23 16^-i + z) = c - z, exact in one FMA
            offset = z_magic - (8388608.0 - 8388608.0 / (1 << (4 * i)))
            part += (_slot(words, i, ASM) * (1.0 / (1 << (4 * i))) - offset) * x_lo
            part += (_slot(high, i, ASM) * (1.0 / (1 << (4 * i))) - offset) * x_hi
        x_ptrs += 128
        perm_ptrs += 128
        acc += part * s
    _finish(tl.sum(acc, axis=1).trans(), pid_k, pid_n + pid_m * tl.num_programs(0), offs_m, offs_n, mask_m, mask_n,
            M, N, bias_ptr, partial_ptr, counter_ptr, out_ptr, SPLIT_K, HAS_BIAS)


def w4a16_gemv(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, qzeros: torch.Tensor,
               group_size: int, config: DecodeConfig, perm: torch.Tensor | None = None,
               bias: torch.Tensor | None = None, counters: torch.Tensor | None = None) -> torch.Tensor:
    """``x [M, K] @ W [K, N] + bias`` for ``M <= MAX_GEMV_ROWS`` on the CUDA cores; result ``[M, N]`` in
    ``x.dtype``. Arguments as :func:`.triton_w4a16_decode.w4a16_decode` (``config``: ``block_n``, ``split_k``,
    ``num_warps``, ``num_stages``).

    Raises:
        ValueError: more than ``MAX_GEMV_ROWS`` rows, or ``group_size`` or ``K`` not a multiple of 128.
    """
    M, K = x.shape
    N = qweight.shape[1]
    if M > MAX_GEMV_ROWS or group_size % PACK_K or K % PACK_K:
        raise ValueError(f"W4A16 GEMV kernel: needs at most {MAX_GEMV_ROWS} rows (got {M}), and a group size (got "
                         f"{group_size}) and input features (got {K}) that are multiples of {PACK_K}")
    if M == 0:
        return x.new_empty((0, N))
    if x.stride(1) != 1:
        x = x.contiguous()
    pairs = x.dtype in (torch.float16, torch.bfloat16) and perm is None
    if pairs and (x.stride(0) % 2 or x.data_ptr() % 4):  # 32-bit loads of two values need 4-byte alignment
        x = x.clone()
    block_m = triton.next_power_of_2(M)
    out = torch.empty((M, N), dtype=x.dtype, device=x.device)
    plan = plan_split_k(M, N, triton.cdiv(K, PACK_K), config.split_k, block_m, config.block_n, out, counters,
                        "W4A16 GEMV kernel")
    _w4a16_gemv_kernel[plan.grid](
        x, qweight, scales, qzeros, perm if perm is not None else x, bias if bias is not None else x,
        plan.partial, plan.counters if plan.counters is not None else qweight, out,
        M, N, K, scales.shape[0], x.stride(0), plan.tiles_per_split,
        GROUP_SIZE=group_size, BLOCK_M=block_m, BLOCK_N=config.block_n, SPLIT_K=plan.grid[2],
        HAS_PERM=perm is not None, HAS_BIAS=bias is not None, EVEN_N=N % config.block_n == 0,
        ASM=not triton.knobs.runtime.interpret, PREFETCH=config.prefetch, X_PAIRS=pairs, num_warps=config.num_warps,
        num_stages=config.num_stages)
    return out
