"""Triton paged prefill attention: chunks of new tokens over their cached context plus themselves.

FlashAttention-2 forward pass (Dao, "FlashAttention-2: Faster Attention with Better Parallelism
and Work Partitioning", 2023): one program owns a tile of query rows, streams key/value tiles
through an online softmax in float32 and writes each row once. Two phases per program:

1. the request's cached context ``[0, context_len)`` read through its block table from the paged
   cache (Kwon et al., SOSP 2023), no mask needed: every new token comes after it;
2. the new tokens themselves, read from ``k``/``v`` directly (not from the cache), causally
   masked, stopping at the tile's last query token.

Grouped-query attention (Ainslie et al., 2023): a program serves one KV head, and its query rows
are the flattened (token, query head of the group) pairs, so each K/V tile is loaded once for all
``Hq / Hk`` heads and a decode row (query length 1) fills ``Hq / Hk`` rows instead of one.

Importing this module imports Triton; the CPU engine never imports it (see ``triton_ops``).
Reference and CPU path: ``torch_ref._prefill`` (``paged_prefill_attention_ref`` in ``triton_ops``).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .kv_quant import FP8_DTYPE
from .triton_cache import as_stored, from_cache

_LOG2E = 1.4426950408889634


@triton.jit
def _online_softmax_step(q, k, v, mask, m_i, l_i, acc, qk_scale, DOT_PRECISION: tl.constexpr,
                         MASKED: tl.constexpr = True):
    # One FlashAttention-2 update with a [BLOCK_N, BLOCK_D] key/value tile; mask [BLOCK_M, BLOCK_N]
    # (ignored when not MASKED: every row may see every key of the tile, so no row's maximum is -inf).
    scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
    if MASKED:
        scores = tl.where(mask, scores, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(scores, 1))
    if MASKED:
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing allowed yet
    else:
        m_safe = m_new
    p = tl.exp2(scores - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    l_i = l_i * alpha + tl.sum(p, 1)
    return m_new, l_i, acc


# stride_btb is the padded width of the step's block table, which changes from step to step: unspecialized,
# so that a new width divisible by 16 (or of 1) does not build a new variant mid-run (W2 on the H200 spent
# 0.57 s of a 3.1 s run building one). Likewise the alignment of the per-request int32 arrays,
# which a mixed step passes as views past its leading decodes (two variants, 1.08 s, in the first W2 run).
@triton.jit(do_not_specialize=["stride_btb"],
            do_not_specialize_on_alignment=["block_tables_ptr", "cu_seqlens_q_ptr", "context_lens_ptr"])
def _prefill_kernel(
    q_ptr,                      # [T, Hq, D] model dtype, any strides
    k_ptr, v_ptr,               # [T, Hk, D] model dtype, any strides: the new tokens' keys and values
    k_cache_ptr, v_cache_ptr,   # [num_blocks, block_size, Hk, D] model dtype: kv_cache[0], kv_cache[1]
    block_tables_ptr,           # [B, max_blocks] int32 physical block ids, covering the context
    cu_seqlens_q_ptr,           # [B + 1] int32 row offsets of each request's new tokens in the batch
    context_lens_ptr,           # [B] int32 tokens already cached before this step
    out_ptr,                    # [T, Hq, D] model dtype, any strides
    qk_scale,                   # softmax scale * log2(e)
    k_scale, v_scale,           # FP8: the layer's scales
    stride_qt, stride_qh, stride_qd,
    stride_kt, stride_kh, stride_kd,
    stride_vt, stride_vh, stride_vd,
    stride_cb, stride_cs, stride_ch, stride_cd,
    stride_btb, stride_ot, stride_oh, stride_od,
    group_size, head_dim, block_size,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, DOT_PRECISION: tl.constexpr,
    FP8: tl.constexpr,
):
    # Program (row tile, request b, kv head h); row r of the tile is (token r // G, head h*G + r % G).
    tile = tl.program_id(0)
    b = tl.program_id(1)
    h = tl.program_id(2)
    q_start = tl.load(cu_seqlens_q_ptr + b)
    q_len = tl.load(cu_seqlens_q_ptr + b + 1) - q_start
    if tile * BLOCK_M >= q_len * group_size:
        return
    context_len = tl.load(context_lens_ptr + b)

    offs_m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    tok = offs_m // group_size          # new-token index within the request
    head = h * group_size + offs_m % group_size
    d_mask = offs_d < head_dim
    md_mask = (tok < q_len)[:, None] & d_mask[None, :]
    q_rows = (q_start + tok).to(tl.int64)
    q = tl.load(q_ptr + q_rows[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :] * stride_qd,
                mask=md_mask, other=0.0)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)

    # Phase 1: the cached context, through the block table; whole tiles unmasked, then the partial one.
    table = block_tables_ptr + b.to(tl.int64) * stride_btb
    whole = context_len // BLOCK_N * BLOCK_N
    for n0 in range(0, whole, BLOCK_N):
        pos = n0 + offs_n
        blocks = tl.load(table + pos // block_size).to(tl.int64)
        kv_off = (blocks[:, None] * stride_cb + (pos % block_size)[:, None] * stride_cs
                  + h * stride_ch + offs_d[None, :] * stride_cd)
        k = from_cache(tl.load(k_cache_ptr + kv_off, mask=d_mask[None, :], other=0.0), k_scale, q.dtype, FP8)
        v = from_cache(tl.load(v_cache_ptr + kv_off, mask=d_mask[None, :], other=0.0), v_scale, q.dtype, FP8)
        m_i, l_i, acc = _online_softmax_step(q, k, v, None, m_i, l_i, acc, qk_scale, DOT_PRECISION, False)
    for n0 in range(whole, context_len, BLOCK_N):
        pos = n0 + offs_n
        n_mask = pos < context_len
        blocks = tl.load(table + pos // block_size, mask=n_mask, other=0).to(tl.int64)
        kv_off = (blocks[:, None] * stride_cb + (pos % block_size)[:, None] * stride_cs
                  + h * stride_ch + offs_d[None, :] * stride_cd)
        nd_mask = n_mask[:, None] & d_mask[None, :]
        k = from_cache(tl.load(k_cache_ptr + kv_off, mask=nd_mask, other=0.0), k_scale, q.dtype, FP8)
        v = from_cache(tl.load(v_cache_ptr + kv_off, mask=nd_mask, other=0.0), v_scale, q.dtype, FP8)
        m_i, l_i, acc = _online_softmax_step(q, k, v, n_mask[None, :], m_i, l_i, acc, qk_scale, DOT_PRECISION)

    # Phase 2: the new tokens from k/v. Key tiles that end at or before the tile's first query token
    # are visible to all its rows (unmasked); then causally masked tiles up to its last token.
    first_tok = (tile * BLOCK_M) // group_size
    below = (first_tok + 1) // BLOCK_N * BLOCK_N
    for n0 in range(0, below, BLOCK_N):
        kv_rows = (q_start + n0 + offs_n).to(tl.int64)
        k = tl.load(k_ptr + kv_rows[:, None] * stride_kt + h * stride_kh + offs_d[None, :] * stride_kd,
                    mask=d_mask[None, :], other=0.0)
        v = tl.load(v_ptr + kv_rows[:, None] * stride_vt + h * stride_vh + offs_d[None, :] * stride_vd,
                    mask=d_mask[None, :], other=0.0)
        k, v = as_stored(k, k_scale, k_cache_ptr.dtype.element_ty, FP8), as_stored(v, v_scale, k_cache_ptr.dtype.element_ty, FP8)
        m_i, l_i, acc = _online_softmax_step(q, k, v, None, m_i, l_i, acc, qk_scale, DOT_PRECISION, False)
    last_tok = tl.minimum((tile * BLOCK_M + BLOCK_M - 1) // group_size, q_len - 1)
    for n0 in range(below, last_tok + 1, BLOCK_N):
        key_tok = n0 + offs_n
        n_mask = key_tok < q_len
        nd_mask = n_mask[:, None] & d_mask[None, :]
        kv_rows = (q_start + key_tok).to(tl.int64)
        k = tl.load(k_ptr + kv_rows[:, None] * stride_kt + h * stride_kh + offs_d[None, :] * stride_kd,
                    mask=nd_mask, other=0.0)
        v = tl.load(v_ptr + kv_rows[:, None] * stride_vt + h * stride_vh + offs_d[None, :] * stride_vd,
                    mask=nd_mask, other=0.0)
        k, v = as_stored(k, k_scale, k_cache_ptr.dtype.element_ty, FP8), as_stored(v, v_scale, k_cache_ptr.dtype.element_ty, FP8)
        causal = (key_tok[None, :] <= tok[:, None]) & n_mask[None, :]
        m_i, l_i, acc = _online_softmax_step(q, k, v, causal, m_i, l_i, acc, qk_scale, DOT_PRECISION)

    result = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    dst = out_ptr + q_rows[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :] * stride_od
    tl.store(dst, result.to(out_ptr.dtype.element_ty), mask=md_mask)


def _tile_sizes(head_dim: int, group_size: int, max_query_len: int, elem_bytes: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps): 128 x 64 tiles with 8 warps for long prompts, smaller for short
    rows; halved for fp32 or D > 128 so that Q plus two stages of K/V fit in shared memory."""
    rows = max_query_len * group_size
    small = head_dim > 128 or elem_bytes > 2
    block_n = 32 if small else 64
    if rows <= 16:
        return 16, block_n, 4
    if rows <= 64 or small:
        return 64, block_n, 4
    return 128, block_n, 8


def paged_prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                            cu_seqlens_q: torch.Tensor, context_lens: torch.Tensor, block_tables: torch.Tensor,
                            max_query_len: int, scale: float, out: torch.Tensor | None = None,
                            k_scale: float = 1.0, v_scale: float = 1.0) -> torch.Tensor:
    """Causal attention of each request's new tokens over its cached context and themselves.

    The context (prefix hit or earlier chunks) is read from the cache through the block table;
    the new tokens' keys and values are read from ``k``/``v``, so this does not depend on the
    store kernel having run (the engine still stores them, for later steps). Decode rows are
    requests with one new token, so a mixed prefill + decode batch goes through in one launch.

    Args:
        q: ``[T, Hq, D]`` fp16/bf16/fp32, any strides; k, v: ``[T, Hk, D]``, same dtype, ``Hq % Hk == 0``.
        kv_cache: ``[2, num_blocks, block_size, Hk, D]``, same dtype, or float8 e4m3 with the layer's
            ``k_scale``, ``v_scale`` (:mod:`.kv_quant`): the context read back as ``stored * scale``, the new
            tokens' ``k``/``v`` rounded as the cache stores them, as the reference does.
        cu_seqlens_q: ``[B + 1]`` int32, request ``i`` owns rows ``[cu[i], cu[i+1])``.
        context_lens: ``[B]`` int32, tokens already cached before this step for each request.
        block_tables: ``[B, max_blocks]`` int32 physical block ids covering at least the context.
        max_query_len: the largest ``cu[i+1] - cu[i]`` in tokens (sizes the grid; host int).
        scale: softmax scale, usually ``D ** -0.5``.
        out: optional ``[T, Hq, D]`` output buffer, dtype of ``q``.
    Returns:
        ``[T, Hq, D]``, dtype of ``q``; softmax and accumulation in float32. Rows not covered by
        ``cu_seqlens_q`` are left untouched.
    Raises:
        ValueError: on mismatched shapes or dtypes.
    """
    num_tokens, num_heads, head_dim = q.shape
    _, _, block_size, num_kv_heads, cache_dim = kv_cache.shape
    if k.shape != (num_tokens, num_kv_heads, head_dim) or v.shape != k.shape or cache_dim != head_dim:
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} do not fit "
                         f"kv_cache {tuple(kv_cache.shape)}")
    if num_heads % num_kv_heads or not (q.dtype == k.dtype == v.dtype) or kv_cache.dtype not in (q.dtype, FP8_DTYPE):
        raise ValueError(f"need Hq % Hk == 0 and one dtype, got Hq={num_heads}, Hk={num_kv_heads}, "
                         f"{q.dtype}/{k.dtype}/{v.dtype}/{kv_cache.dtype}")
    batch_size = context_lens.shape[0]
    if cu_seqlens_q.shape != (batch_size + 1,) or block_tables.shape[0] != batch_size:
        raise ValueError(f"cu_seqlens_q {tuple(cu_seqlens_q.shape)}, block_tables {tuple(block_tables.shape)} "
                         f"do not match {batch_size} requests")
    if not (cu_seqlens_q.dtype == context_lens.dtype == block_tables.dtype == torch.int32):
        raise ValueError("cu_seqlens_q, context_lens and block_tables must be int32")
    if out is None:
        out = torch.empty_like(q)
    if batch_size == 0 or max_query_len <= 0:
        return out
    group_size = num_heads // num_kv_heads
    block_m, block_n, num_warps = _tile_sizes(head_dim, group_size, max_query_len, q.element_size())
    grid = (triton.cdiv(max_query_len * group_size, block_m), batch_size, num_kv_heads)
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    _prefill_kernel[grid](
        q, k, v, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, out, scale * _LOG2E, k_scale, v_scale,
        *q.stride(), *k.stride(), *v.stride(), *k_cache.stride(), block_tables.stride(0), *out.stride(),
        group_size, head_dim, block_size,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=triton.next_power_of_2(head_dim),
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32", FP8=kv_cache.dtype == FP8_DTYPE,
        num_warps=num_warps, num_stages=3 if q.element_size() == 2 else 2,
    )
    return out
