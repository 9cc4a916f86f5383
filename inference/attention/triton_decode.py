"""Triton paged decode attention: one query token per request, split over the KV length.

Flash-decoding (Dao, Haziza, Massa, Sizov, "Flash-Decoding for long-context inference", 2023):
each program computes an online-softmax partial result (Milakov & Gimelshein, 2018) over one
slice of a request's context, and a second kernel merges the slices with their log-sum-exps.
Keys and values are read through the block table of the paged cache (Kwon et al., SOSP 2023);
each program loads a K/V tile once and serves all ``Hq / Hk`` query heads of its group
(grouped-query attention, Ainslie et al., 2023), so K/V are never repeated per query head.

Importing this module imports Triton; the CPU engine never imports it (see ``triton_ops``).
Reference and CPU path: ``torch_ref._decode`` (``paged_decode_attention_ref`` in ``triton_ops``).
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ..triton_utils import num_sms as triton_num_sms
from .kv_quant import FP8_DTYPE
from .triton_cache import from_cache

_LOG2E = 1.4426950408889634
# The split kernel's keys per inner iteration (may span several cache blocks), warps and pipeline stages, by
# head size. Head size 64 (Qwen2.5-0.5B, W2): 128 keys and 2 stages, 47.6 against 51.3 us at 256 requests of
# 100-2,000 tokens (decode-sweep-w2_h200_2026-12-01.json); head size 128 (the 7B shapes) as tuned before.
DECODE_LAUNCH = {64: {"block_n": 128, "num_warps": 4, "num_stages": 2},
                 128: {"block_n": 64, "num_warps": 4, "num_stages": 3}}
# An FP8 cache at head size 128: twice the keys per iteration, so that as many bytes are in flight as with a
# 16-bit cache (with 64 keys the W3 decode kernel took as long as with bf16, 41.1 against 41.5 ms over 16
# steps on the H100: w3-kv-fp8-kernel-profile_h100_2026-12-05.json).
DECODE_LAUNCH_FP8_128 = {"block_n": 128, "num_warps": 4, "num_stages": 3}
_MIN_SPLIT_TOKENS = 256  # never split a context into slices shorter than this
# Programs per SM the KV splits aim for. One program per (request, KV head) and slice: the step lasts as long
# as the program with the longest slice, so with contexts of unequal length (W2: 100-2,000 tokens) finer
# slices balance the SMs; a benchmark knob (benchmarks/throughput.py --decode-programs-per-sm).
PROGRAMS_PER_SM = 8


def decode_launch(head_dim: int, element_size: int = 2) -> dict:
    """The split kernel's default ``block_n``, ``num_warps`` and ``num_stages`` for ``head_dim`` and the
    cache's bytes per element. float32 caches keep 64 keys per iteration: two stages of 128 float32 K and V
    tiles of 64 would take 128 KB of shared memory, more than GPUs below the H100 class have per block."""
    if head_dim <= 64 and element_size <= 2:
        return DECODE_LAUNCH[64]
    if element_size == 1 and head_dim == 128:
        return DECODE_LAUNCH_FP8_128
    return DECODE_LAUNCH[128]


# stride_btb is the padded width of the step's block table, which changes from step to step: unspecialized,
# so that a new width divisible by 16 (or of 1) does not build a new variant mid-run (W2 on the H200 spent
# 0.57 s of a 3.1 s run building one); the int32 arrays' alignment too (views in mixed steps).
@triton.jit(do_not_specialize=["stride_btb"], do_not_specialize_on_alignment=["block_tables_ptr", "seq_lens_ptr"])
def _decode_split_kernel(
    q_ptr,                      # [B, Hq, D] model dtype, any strides
    k_cache_ptr, v_cache_ptr,   # [num_blocks, block_size, Hk, D] model dtype: kv_cache[0], kv_cache[1]
    block_tables_ptr,           # [B, max_blocks] int32 physical block ids (unused tail arbitrary)
    seq_lens_ptr,               # [B] int32 tokens in the cache for each request, new token included; 0 = padding
    out_ptr,                    # NUM_SPLITS == 1: [B, Hq, D] model dtype (final output)
    part_out_ptr,               # NUM_SPLITS > 1: [B, Hq, NUM_SPLITS, D] float32, contiguous; normalised slice output
    part_lse_ptr,               # NUM_SPLITS > 1: [B, Hq, NUM_SPLITS] float32, contiguous; slice log2-sum-exp2
    qk_scale,                   # softmax scale * log2(e)
    k_scale, v_scale,           # FP8: the layer's scales
    stride_qb, stride_qh, stride_qd,
    stride_cb, stride_cs, stride_ch, stride_cd,
    stride_btb, stride_ob, stride_oh, stride_od,
    group_size, head_dim, block_size,
    NUM_SPLITS: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr, FP8: tl.constexpr,
):
    # Program (request b, kv head h, slice s): query heads h*G .. h*G+G-1 over keys [start, end).
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + b)
    split_len = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = s * split_len
    end = tl.minimum(start + split_len, seq_len)

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    heads = h * group_size + offs_g
    gd_mask = (offs_g[:, None] < group_size) & (offs_d[None, :] < head_dim)
    q = tl.load(q_ptr + b.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + offs_d[None, :] * stride_qd,
                mask=gd_mask, other=0.0)

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    table = block_tables_ptr + b.to(tl.int64) * stride_btb
    for n0 in range(start, end, BLOCK_N):
        pos = n0 + offs_n
        n_mask = pos < end
        blocks = tl.load(table + pos // block_size, mask=n_mask, other=0).to(tl.int64)
        kv_off = (blocks[:, None] * stride_cb + (pos % block_size)[:, None] * stride_cs
                  + h * stride_ch + offs_d[None, :] * stride_cd)
        nd_mask = n_mask[:, None] & (offs_d[None, :] < head_dim)
        k = from_cache(tl.load(k_cache_ptr + kv_off, mask=nd_mask, other=0.0), k_scale, q.dtype, FP8)
        scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # [BLOCK_G, BLOCK_N], log2 units
        scores = tl.where(n_mask[None, :], scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        p = tl.exp2(scores - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        v = from_cache(tl.load(v_cache_ptr + kv_off, mask=nd_mask, other=0.0), v_scale, q.dtype, FP8)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        l_i = l_i * alpha + tl.sum(p, 1)
        m_i = m_new

    # An empty slice (or a zero-length padding request) leaves l_i = 0: output zeros, lse = -inf.
    safe_l = tl.where(l_i > 0, l_i, 1.0)
    result = acc / safe_l[:, None]
    if NUM_SPLITS == 1:
        dst = out_ptr + b.to(tl.int64) * stride_ob + heads[:, None] * stride_oh + offs_d[None, :] * stride_od
        tl.store(dst, result.to(out_ptr.dtype.element_ty), mask=gd_mask)
    else:
        row = (b.to(tl.int64) * tl.num_programs(1) * group_size + heads) * NUM_SPLITS + s  # [BLOCK_G]
        tl.store(part_out_ptr + row[:, None] * BLOCK_D + offs_d[None, :], result, mask=gd_mask)
        lse = tl.where(l_i > 0, m_i + tl.log2(safe_l), float("-inf"))
        tl.store(part_lse_ptr + row, lse, mask=offs_g < group_size)


@triton.jit
def _decode_reduce_kernel(
    part_out_ptr,   # [B, Hq, NUM_SPLITS, BLOCK_D] float32, contiguous
    part_lse_ptr,   # [B, Hq, NUM_SPLITS] float32, contiguous; -inf for empty slices
    out_ptr,        # [B, Hq, D] model dtype, any strides
    stride_ob, stride_oh, stride_od,
    num_heads, head_dim,
    NUM_SPLITS: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
):
    # Program (request b, query heads j*BLOCK_H ..): out = sum_s w_s * o_s / sum_s w_s, w_s = 2^(lse_s - max lse).
    b = tl.program_id(0)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    h_mask = offs_h < num_heads
    hs_mask = h_mask[:, None] & (offs_s[None, :] < NUM_SPLITS)
    row = (b.to(tl.int64) * num_heads + offs_h[:, None]) * NUM_SPLITS + offs_s[None, :]  # [BLOCK_H, BLOCK_S]
    lse = tl.load(part_lse_ptr + row, mask=hs_mask, other=float("-inf"))
    lse_max = tl.max(lse, 1)
    lse_max = tl.where(lse_max == float("-inf"), 0.0, lse_max)  # all slices empty: weights all 0
    w = tl.exp2(lse - lse_max[:, None])
    parts = tl.load(part_out_ptr + row[:, :, None] * BLOCK_D + offs_d[None, None, :],
                    mask=hs_mask[:, :, None] & (offs_d[None, None, :] < head_dim), other=0.0)
    total = tl.sum(w, 1)
    result = tl.sum(parts * w[:, :, None], 1) / tl.where(total > 0, total, 1.0)[:, None]
    dst = out_ptr + b.to(tl.int64) * stride_ob + offs_h[:, None] * stride_oh + offs_d[None, :] * stride_od
    tl.store(dst, result.to(out_ptr.dtype.element_ty), mask=h_mask[:, None] & (offs_d[None, :] < head_dim))


def reduce_heads(num_heads: int, num_splits: int, block_d: int) -> int:
    """Query heads per program of the merge kernel (a power of two): as many of a request's as fit in 8,192
    partial elements a program at head size 64, 4,096 above (one head when a head's splits alone exceed that).
    One head per program left 256-request W2 steps with 3,584 programs of 256 elements each. At W2's shape, one
    sweep (``decode-layouts_h200_2026-12-01.json``, split kernel included) gave 49.2 / 29.4 / 10.8 / 8.5 us with
    one head at 256 / 128 / 32 / 16 requests and 48.4 / 27.0 / 10.2 / 8.1 with 16 (at 256 requests 4 and 8
    heads took 47.1 and 46.1). It follows the shape and the split count, so it adds no compiled variant beyond
    those of ``NUM_SPLITS``. At head size 128 (the 7B shapes), 8,192 elements took 254 registers a thread at 4
    warps, 4,096 about half."""
    max_elements = 8192 if block_d <= 64 else 4096
    per_head = triton.next_power_of_2(num_splits) * block_d
    return max(1, min(triton.next_power_of_2(num_heads), max_elements // per_head))


def choose_num_splits(batch_size: int, num_kv_heads: int, max_seq_len: int, device: torch.device) -> int:
    """Slices per request so that ``B * Hk * splits`` programs are about ``PROGRAMS_PER_SM`` per SM of the GPU.

    A power of two (each count is a separate compiled kernel), at most 64, and no slice shorter
    than ``_MIN_SPLIT_TOKENS`` tokens. Host-only arithmetic, no synchronisation.
    """
    num_sms = triton_num_sms(device)
    programs = max(batch_size * num_kv_heads, 1)
    wanted = triton.next_power_of_2(math.ceil(PROGRAMS_PER_SM * num_sms / programs))
    longest = triton.next_power_of_2(math.ceil(max(max_seq_len, 1) / _MIN_SPLIT_TOKENS))
    return max(1, min(wanted, longest, 64))


def paged_decode_attention(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                           seq_lens: torch.Tensor, scale: float, out: torch.Tensor | None = None,
                           max_seq_len: int | None = None, num_splits: int | None = None,
                           launch: dict | None = None, k_scale: float = 1.0, v_scale: float = 1.0) -> torch.Tensor:
    """Attention of one new query token per request over its paged context (new token's K/V already stored).

    Args:
        q: ``[B, Hq, D]`` fp16/bf16/fp32, any strides.
        kv_cache: ``[2, num_blocks, block_size, Hk, D]``, same dtype or float8 e4m3 (read back as
            ``stored * k_scale`` / ``* v_scale`` in registers, :mod:`.kv_quant`), ``Hq % Hk == 0``.
        block_tables: ``[B, max_blocks]`` int32 physical block ids (padding entries are never read).
        seq_lens: ``[B]`` int32 context length in tokens including the new token; 0 marks a padding
            row, whose output is zeros.
        scale: softmax scale, usually ``D ** -0.5``.
        out: optional ``[B, Hq, D]`` output buffer, dtype of ``q``.
        max_seq_len: an upper bound on ``seq_lens`` (tokens); defaults to ``max_blocks * block_size``
            so that no device-to-host copy is needed.
        num_splits: slices per request; default from :func:`choose_num_splits`.
        launch: the split kernel's ``block_n`` (keys per iteration), ``num_warps`` and ``num_stages``, each
            defaulting to :func:`decode_launch`, and the merge kernel's ``reduce_heads`` (query heads per
            program, rounded up to a power of two; default :func:`reduce_heads`): benchmark knobs,
            ``benchmarks/decode_sweep.py``.
    Returns:
        ``[B, Hq, D]``, dtype of ``q``; softmax and accumulation in float32.
    Raises:
        ValueError: on mismatched shapes or dtypes.
    """
    batch_size, num_heads, head_dim = q.shape
    _, _, block_size, num_kv_heads, cache_dim = kv_cache.shape
    if cache_dim != head_dim or num_heads % num_kv_heads or kv_cache.dtype not in (q.dtype, FP8_DTYPE):
        raise ValueError(f"q {tuple(q.shape)} {q.dtype} does not fit kv_cache {tuple(kv_cache.shape)} {kv_cache.dtype}")
    if block_tables.shape[0] != batch_size or seq_lens.shape != (batch_size,):
        raise ValueError(f"block_tables {tuple(block_tables.shape)} / seq_lens {tuple(seq_lens.shape)} "
                         f"do not match batch size {batch_size}")
    if block_tables.dtype != torch.int32 or seq_lens.dtype != torch.int32:
        raise ValueError("block_tables and seq_lens must be int32")
    if out is None:
        out = torch.empty_like(q)
    if batch_size == 0:
        return out
    if max_seq_len is None:
        max_seq_len = block_tables.shape[1] * block_size
    if num_splits is None:
        num_splits = choose_num_splits(batch_size, num_kv_heads, max_seq_len, q.device)
    group_size = num_heads // num_kv_heads
    block_d = triton.next_power_of_2(head_dim)
    if num_splits > 1:
        part_out = torch.empty(batch_size, num_heads, num_splits, block_d, dtype=torch.float32, device=q.device)
        part_lse = torch.empty(batch_size, num_heads, num_splits, dtype=torch.float32, device=q.device)
    else:
        part_out = part_lse = out  # unused
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    launch = {**decode_launch(head_dim, kv_cache.element_size()), **(launch or {})}
    _decode_split_kernel[(batch_size, num_kv_heads, num_splits)](
        q, k_cache, v_cache, block_tables, seq_lens, out, part_out, part_lse, scale * _LOG2E, k_scale, v_scale,
        *q.stride(), *k_cache.stride(), block_tables.stride(0), *out.stride(),
        group_size, head_dim, block_size,
        NUM_SPLITS=num_splits, BLOCK_G=max(16, triton.next_power_of_2(group_size)), BLOCK_N=launch["block_n"],
        BLOCK_D=block_d, DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        FP8=kv_cache.dtype == FP8_DTYPE, num_warps=launch["num_warps"], num_stages=launch["num_stages"],
    )
    if num_splits > 1:
        block_h = triton.next_power_of_2(launch.get("reduce_heads") or reduce_heads(num_heads, num_splits, block_d))
        _decode_reduce_kernel[(batch_size, triton.cdiv(num_heads, block_h))](
            part_out, part_lse, out, *out.stride(), num_heads, head_dim,
            NUM_SPLITS=num_splits, BLOCK_H=block_h, BLOCK_S=triton.next_power_of_2(num_splits), BLOCK_D=block_d,
            num_warps=4,
        )
    return out
