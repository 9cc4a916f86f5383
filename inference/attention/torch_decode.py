"""Decode attention of the PyTorch backend (the CPU path): one new token per request over its paged K/V.

On the CPU the step's decodes are attended in groups of ``DECODE_GROUP_ROWS`` requests of similar length.
A group's keys and values come from the cache in one gather of whole blocks into a buffer kept per thread, small
enough to stay in the core's cache for the attention that reads it back. The plan (:class:`DecodePlan`: the order,
the groups, their block indices and masks) is made by the step's first layer and reused by the others, so that a
layer costs one permutation of the queries, one gather and one SDPA per group, and one permutation of the outputs.
Grouped-query heads (Ainslie et al., 2023) are not repeated: a KV head's query heads are its SDPA query rows.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .kv_quant import dequantize, is_fp8
from .metadata import AttentionMetadata

DECODE_GROUP_ROWS = 4  # decodes attended together on the CPU

# A fresh allocation of a gather's size is a fresh mapping on Linux, and faulting its pages in cost more than the
# copy itself (SmolLM2 at 64 requests of up to 384 tokens: 25 ms a layer against 2.4 ms into a kept buffer).
_workspace = threading.local()
WORKSPACE_MAX_BYTES = 512 * 2**20  # larger gathers are allocated for the call and freed


@dataclass
class DecodeGroup:
    """Decode rows attended together.

    Attributes:
        start, end: the group's rows ``[start, end)`` among the decodes in plan order.
        index: ``[2 * r * nb]`` int64 rows of the cache seen as ``[2 * num_blocks, block_size * Hk * D]``: the
            first ``nb`` blocks of each row's table, row after row, keys and then values.
        mask: ``[r, 1, 1, nb * block_size]`` the keys within each row's length: additive (0 or -inf, the query's
            dtype) on the CPU, bool elsewhere; None for one row, whose keys are cut to ``length`` instead.
        length: the group's longest sequence (tokens).
    """

    start: int
    end: int
    index: torch.Tensor
    mask: torch.Tensor | None
    length: int


@dataclass
class DecodePlan:
    """How a step's decodes are attended, the same for every layer.

    Attributes:
        order: ``[Bd]`` int64 the decodes sorted by length (plan order); None when the plan keeps batch order.
        inverse: ``[Bd]`` int64 the plan position of each decode (``order``'s inverse); None with ``order``.
        groups: consecutive runs of plan order that cover every decode.
    """

    order: torch.Tensor | None
    inverse: torch.Tensor | None
    groups: list[DecodeGroup]


def _kv_index(blocks: torch.Tensor, num_blocks: int) -> torch.Tensor:
    return torch.cat([blocks, blocks + num_blocks])


def plan_decode(meta: AttentionMetadata, num_blocks: int, dtype: torch.dtype) -> DecodePlan:
    """The plan of ``meta``'s decodes over a cache of ``num_blocks`` blocks, for queries of ``dtype``.

    On the CPU: groups of ``DECODE_GROUP_ROWS`` rows of similar length, each reading only its own longest row's
    blocks (SmolLM2 at 64 decodes of 32-384 tokens: 4.8-5.2 ms a layer in groups of 4 against 7.5-8.0 ms for one
    gather of the whole batch padded to its longest row). Elsewhere one group of every row, in batch order."""
    tables, lens = meta.decode_block_tables, meta.decode_seq_lens
    bs = meta.block_size
    if tables.device.type != "cpu" or tables.shape[0] <= 1:
        longest = meta.decode_max_seq_len  # a host int where the builder knew it: no read of the device
        if tables.shape[0] == 1 and longest is not None:
            blocks = tables[0, :-(-longest // bs)]
            return DecodePlan(None, None, [DecodeGroup(0, 1, _kv_index(blocks, num_blocks), None, longest)])
        mask = (torch.arange(tables.shape[1] * bs, device=lens.device)[None, :] < lens[:, None])[:, None, None, :]
        group = DecodeGroup(0, tables.shape[0], _kv_index(tables.flatten(), num_blocks), mask, tables.shape[1] * bs)
        return DecodePlan(None, None, [group])
    order = torch.argsort(lens)
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel())
    sorted_lens = lens[order]
    groups = []
    for start in range(0, order.numel(), DECODE_GROUP_ROWS):
        end = min(start + DECODE_GROUP_ROWS, order.numel())
        group_lens = sorted_lens[start:end]
        longest = int(group_lens[-1])
        nb = -(-longest // bs)
        mask = None
        if end - start > 1:  # additive: SDPA would convert a bool mask in every layer
            outside = torch.arange(nb * bs)[None, :] >= group_lens[:, None]
            mask = torch.zeros(end - start, 1, 1, nb * bs, dtype=dtype).masked_fill_(outside[:, None, None, :],
                                                                                     float("-inf"))
        index = _kv_index(tables[order[start:end], :nb].flatten(), num_blocks)
        groups.append(DecodeGroup(start, end, index, mask, longest))
    return DecodePlan(order, inverse, groups)


def gather_blocks(kv_cache: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Rows ``index [n]`` of ``kv_cache [2, num_blocks, bs, Hk, D]`` seen as ``[2 * num_blocks, bs * Hk * D]``
    (``n`` even: keys, then values) -> ``[2, n / 2, bs, Hk, D]``.

    The result lives in a per-thread buffer (up to ``WORKSPACE_MAX_BYTES``) that the next call overwrites; it is
    one ``index_select`` of whole blocks (on CPU 5-25x faster than advanced indexing of the same blocks)."""
    fp8 = is_fp8(kv_cache)
    src = kv_cache.view(torch.uint8) if fp8 else kv_cache  # no float8 index_select on CPU
    flat = src.view(2 * src.shape[1], -1)
    need = index.numel() * flat.shape[1]
    key = (src.device, src.dtype, torch.is_inference_mode_enabled())  # an inference tensor is not writable outside
    buffers = getattr(_workspace, "buffers", None)
    if buffers is None:
        buffers = _workspace.buffers = {}
    buf = buffers.get(key)
    if buf is None or buf.numel() < need:
        buf = torch.empty(need, dtype=src.dtype, device=src.device)
        if need * buf.element_size() <= WORKSPACE_MAX_BYTES:
            buffers[key] = buf
    out = buf[:need].view(index.numel(), flat.shape[1])
    torch.index_select(flat, 0, index, out=out)
    out = out.view(2, index.numel() // 2, *src.shape[2:])
    return out.view(kv_cache.dtype) if fp8 else out


def decode(q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
           k_scale: float = 1.0, v_scale: float = 1.0) -> torch.Tensor:
    """Single-token attention for ``Bd`` requests at once: ``q [Bd, Hq, D] -> [Bd, Hq, D]``, ``q``'s dtype.

    ``kv_cache [2, num_blocks, bs, Hk, D]`` in ``q``'s dtype or float8 e4m3 (read back with ``k_scale``,
    ``v_scale``). The plan is ``meta.decode_plan``, made here by the step's first layer (:func:`plan_decode`)."""
    bd, hq, d = q.shape
    hk = kv_cache.shape[3]
    if meta.decode_plan is None:
        meta.decode_plan = plan_decode(meta, kv_cache.shape[1], q.dtype)
    plan = meta.decode_plan
    qg = q.view(bd, hk, hq // hk, d)
    if plan.order is not None:
        qg = qg.index_select(0, plan.order)
    outs = []
    for group in plan.groups:
        rows = group.end - group.start
        kv = gather_blocks(kv_cache, group.index).view(2, rows, -1, hk, d)  # [2, r, L, Hk, D]
        if group.mask is None:
            kv = kv[:, :, :group.length]
        keys, values = dequantize(kv[0], k_scale, q.dtype), dequantize(kv[1], v_scale, q.dtype)
        outs.append(F.scaled_dot_product_attention(qg[group.start:group.end], keys.transpose(1, 2),
                                                   values.transpose(1, 2), attn_mask=group.mask,
                                                   scale=scale))  # [r, Hk, Hq / Hk, D]
    out = outs[0] if len(outs) == 1 else torch.cat(outs)
    if plan.inverse is not None:
        out = out.index_select(0, plan.inverse)
    return out.reshape(bd, hq, d)
