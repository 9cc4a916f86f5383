"""Pure-PyTorch paged attention: the CPU path and the reference for the GPU kernels.

Paged KV cache after Kwon et al., "Efficient Memory Management for Large Language Model
Serving with PagedAttention", SOSP 2023. Grouped-query heads (Ainslie et al., 2023) never repeat K/V:
prefill passes SDPA ``enable_gqa``, decode gives it each KV head's query heads as query rows.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .kv_quant import dequantize, is_fp8, quantize
from .metadata import AttentionMetadata
from .torch_decode import decode


def store_kv(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
             k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """Write new keys/values into the cache.

    Args:
        k, v: ``[T, Hk, D]``.
        kv_cache: ``[2, num_blocks, block_size, Hk, D]``, the same dtype, or float8 e4m3
            (``kv_cache_dtype="fp8"``): then stored as ``k / k_scale`` and ``v / v_scale`` (:mod:`.kv_quant`).
        slot_mapping: ``[T]`` int64 flat slot of each token.
    """
    num_slots = kv_cache.shape[1] * kv_cache.shape[2]
    if is_fp8(kv_cache):  # index_copy_ has no float8 kernel: copy the bytes
        keys, values = kv_cache.view(torch.uint8)
        k, v = quantize(k, k_scale).view(torch.uint8), quantize(v, v_scale).view(torch.uint8)
    else:
        keys, values = kv_cache
    keys.view(num_slots, *k.shape[1:]).index_copy_(0, slot_mapping, k)
    values.view(num_slots, *v.shape[1:]).index_copy_(0, slot_mapping, v)


def _select(cache: torch.Tensor, dim: int, index: torch.Tensor) -> torch.Tensor:
    """``cache.index_select(dim, index)``; for an FP8 cache through its bytes (no float8 CPU kernel)."""
    if is_fp8(cache):
        return cache.view(torch.uint8).index_select(dim, index).view(cache.dtype)
    return cache.index_select(dim, index)


def _gather(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """``cache [num_blocks, bs, Hk, D]``, ``block_table [nb]`` -> contiguous ``[length, Hk, D]``."""
    return _select(cache, 0, block_table).flatten(0, 1)[:length]


def _prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
             context_len: int, block_table: torch.Tensor, scale: float, k_scale: float = 1.0,
             v_scale: float = 1.0) -> torch.Tensor:
    """Causal attention of ``n`` new tokens over ``context_len`` cached ones plus themselves.

    The operands are 4-D ``[1, H, L, D]``: with 3-D ones PyTorch's CPU SDPA takes its unfused math
    kernel, which materialises the ``[Hq, n, L]`` scores (a 3,000-token SmolLM2 prefill took 16.6 s
    that way, against 4.1 s in transformers)."""
    n = q.shape[0]
    qh = q.transpose(0, 1)[None]
    if context_len == 0 and not is_fp8(kv_cache):
        return F.scaled_dot_product_attention(qh, k.transpose(0, 1)[None], v.transpose(0, 1)[None], is_causal=True,
                                              scale=scale, enable_gqa=True)[0].transpose(0, 1)
    # FP8: read back as stored, the chunk's own keys and values too, through the same gather and mask with a
    # prefix hit or without one: e4m3 rounding turns the last-bit differences of two code paths into whole steps
    total = context_len + n
    keys = dequantize(_gather(kv_cache[0], block_table, total), k_scale, q.dtype).transpose(0, 1)[None]
    values = dequantize(_gather(kv_cache[1], block_table, total), v_scale, q.dtype).transpose(0, 1)[None]
    q_pos = torch.arange(context_len, total, device=q.device)[:, None]
    allowed = torch.arange(total, device=q.device)[None, :] <= q_pos  # [n, total]
    return F.scaled_dot_product_attention(
        qh, keys, values, attn_mask=allowed, scale=scale, enable_gqa=True)[0].transpose(0, 1)


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float, k_scale: float = 1.0, v_scale: float = 1.0) -> torch.Tensor:
    """Store the step's K/V in the paged cache, then attend.

    With an FP8 cache every token attends to keys and values as stored (converted back), also those of
    its own chunk, so a prompt's output does not depend on how it was chunked or recomputed.

    Args:
        q: ``[T, Hq, D]``; k, v: ``[T, Hk, D]`` (rotary already applied), ``Hq % Hk == 0``.
        kv_cache: ``[2, num_blocks, block_size, Hk, D]``, the model's dtype or float8 e4m3.
        k_scale, v_scale: the layer's FP8 scales (:mod:`.kv_quant`; unused for a cache in the model's dtype).
        meta: the step's metadata; every row of the batch is either a decode or in a prefill segment.
        scale: softmax scale, usually ``D ** -0.5``.
    Returns:
        ``[T, Hq, D]``, dtype of ``q``.
    """
    store_kv(k, v, kv_cache, meta.slot_mapping, k_scale, v_scale)
    if not meta.prefills:
        return decode(q, kv_cache, meta, scale, k_scale, v_scale)
    out = torch.empty_like(q)
    if meta.num_decodes:
        out[meta.decode_indices] = decode(q[meta.decode_indices], kv_cache, meta, scale, k_scale, v_scale)
    for seg in meta.prefills:
        s, e = seg.start, seg.end
        out[s:e] = _prefill(q[s:e], k[s:e], v[s:e], kv_cache, seg.context_len, seg.block_table, scale,
                            k_scale, v_scale)
    return out
