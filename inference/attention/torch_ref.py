"""Pure-PyTorch paged attention: the CPU path and the reference for the GPU kernels.

Paged KV cache after Kwon et al., "Efficient Memory Management for Large Language Model
Serving with PagedAttention", SOSP 2023. Grouped-query heads (Ainslie et al., 2023) never repeat K/V:
prefill passes SDPA ``enable_gqa``, decode gives it each KV head's query heads as query rows.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .kv_quant import dequantize, is_fp8, quantize
from .metadata import AttentionMetadata


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


# Keys and values of a decode batch are gathered into a buffer kept per thread and reused by every layer and
# step: a fresh allocation of that size is a fresh mapping on Linux, and faulting its pages in cost more than the
# copy itself (SmolLM2 at 64 requests of up to 384 tokens: 25 ms a layer against 2.4 ms into a kept buffer).
_workspace = threading.local()
WORKSPACE_MAX_BYTES = 512 * 2**20  # larger gathers are allocated for the call and freed


def _gather_blocks(kv_cache: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Blocks ``index [n]`` of keys and values: ``kv_cache [2, num_blocks, bs, Hk, D]`` -> ``[2, n, bs, Hk, D]``.

    The result lives in a per-thread buffer (up to ``WORKSPACE_MAX_BYTES``) that the next call overwrites; each half
    is one ``index_select`` along the blocks (whole blocks, copied row by row: on CPU 5-25x faster than advanced
    indexing of the same blocks)."""
    fp8 = is_fp8(kv_cache)
    src = kv_cache.view(torch.uint8) if fp8 else kv_cache  # no float8 index_select on CPU
    num_blocks = src.shape[1]
    block_numel = src[0].numel() // num_blocks
    need = 2 * index.numel() * block_numel
    key = (src.device, src.dtype, torch.is_inference_mode_enabled())  # an inference tensor is not writable outside
    buffers = getattr(_workspace, "buffers", None)
    if buffers is None:
        buffers = _workspace.buffers = {}
    buf = buffers.get(key)
    if buf is None or buf.numel() < need:
        buf = torch.empty(need, dtype=src.dtype, device=src.device)
        if need * buf.element_size() <= WORKSPACE_MAX_BYTES:
            buffers[key] = buf
    out = buf[:need].view(2, index.numel(), block_numel)
    for half in range(2):
        torch.index_select(src[half].view(num_blocks, block_numel), 0, index, out=out[half])
    out = out.view(2, index.numel(), *src.shape[2:])
    return out.view(kv_cache.dtype) if fp8 else out


DECODE_GROUP_ROWS = 4  # decodes attended together on the CPU (see _decode_groups)


@dataclass
class DecodeGroup:
    """Decode rows attended together by :func:`_decode`.

    Attributes:
        rows: ``[r]`` int64 positions among the step's decodes; None for all of them, in order.
        blocks: ``[r * nb]`` int64 the first ``nb`` blocks of each row's table, row after row.
        mask: ``[r, 1, 1, nb * block_size]`` bool, the keys within each row's length; None for one row, whose
            keys are cut to ``length`` instead.
        length: the group's longest sequence (tokens).
    """

    rows: torch.Tensor | None
    blocks: torch.Tensor
    mask: torch.Tensor | None
    length: int


def _decode_groups(meta: AttentionMetadata) -> list[DecodeGroup]:
    """The step's decodes in groups of ``DECODE_GROUP_ROWS`` of similar length, on the CPU; one group elsewhere.

    Each group reads only its own longest row's blocks, and its gathered keys and values (a few MB) stay in the
    CPU's cache for the attention that reads them again. SmolLM2 at 64 decodes of 32-384 tokens: 4.8-5.2 ms a
    layer in groups of 4 against 7.5-8.0 ms for one gather of the whole batch padded to its longest row."""
    tables, lens = meta.decode_block_tables, meta.decode_seq_lens
    bs = meta.block_size
    if tables.device.type != "cpu" or tables.shape[0] <= 1:
        longest = meta.decode_max_seq_len  # a host int where the builder knew it: no read of the device
        if tables.shape[0] == 1 and longest is not None:
            return [DecodeGroup(None, tables[0, :-(-longest // bs)], None, longest)]
        mask = (torch.arange(tables.shape[1] * bs, device=lens.device)[None, :] < lens[:, None])[:, None, None, :]
        return [DecodeGroup(None, tables.flatten(), mask, tables.shape[1] * bs)]
    order = torch.argsort(lens)
    sorted_lens = lens[order]
    groups = []
    for start in range(0, order.numel(), DECODE_GROUP_ROWS):
        rows, group_lens = order[start:start + DECODE_GROUP_ROWS], sorted_lens[start:start + DECODE_GROUP_ROWS]
        longest = int(group_lens[-1])
        num_blocks = -(-longest // bs)
        mask = None
        if rows.numel() > 1:
            mask = (torch.arange(num_blocks * bs)[None, :] < group_lens[:, None])[:, None, None, :]
        groups.append(DecodeGroup(rows, tables[rows, :num_blocks].flatten(), mask, longest))
    return groups


def _decode(q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
            k_scale: float = 1.0, v_scale: float = 1.0) -> torch.Tensor:
    """Single-token attention for ``Bd`` requests at once: ``q [Bd, Hq, D] -> [Bd, Hq, D]``.

    Group by group (:func:`_decode_groups`), keys and values come from the cache in one gather of whole blocks
    (:func:`_gather_blocks`). The ``Hq / Hk`` query heads that share a KV head go to SDPA as that head's query
    rows, so no key or value is repeated. A group of one row attends over exactly its tokens, without a mask;
    a larger group masks each row's tokens past its length."""
    bd, hq, d = q.shape
    hk = kv_cache.shape[3]
    if meta.decode_groups is None:
        meta.decode_groups = _decode_groups(meta)
    qg = q.view(bd, hk, hq // hk, d)
    out = None
    for group in meta.decode_groups:
        rows = bd if group.rows is None else group.rows.numel()
        kv = _gather_blocks(kv_cache, group.blocks).view(2, rows, -1, hk, d)  # [2, r, L, Hk, D]
        if group.mask is None:
            kv = kv[:, :, :group.length]
        keys, values = dequantize(kv[0], k_scale, q.dtype), dequantize(kv[1], v_scale, q.dtype)
        group_q = qg if group.rows is None else qg.index_select(0, group.rows)
        res = F.scaled_dot_product_attention(group_q, keys.transpose(1, 2), values.transpose(1, 2),
                                             attn_mask=group.mask, scale=scale)  # [r, Hk, Hq / Hk, D]
        if group.rows is None:
            return res.reshape(bd, hq, d)
        if out is None:
            out = q.new_empty(bd, hk, hq // hk, d)
        out.index_copy_(0, group.rows, res)
    return out.reshape(bd, hq, d)


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
        return _decode(q, kv_cache, meta, scale, k_scale, v_scale)
    out = torch.empty_like(q)
    if meta.num_decodes:
        out[meta.decode_indices] = _decode(q[meta.decode_indices], kv_cache, meta, scale, k_scale, v_scale)
    for seg in meta.prefills:
        s, e = seg.start, seg.end
        out[s:e] = _prefill(q[s:e], k[s:e], v[s:e], kv_cache, seg.context_len, seg.block_table, scale,
                            k_scale, v_scale)
    return out
