"""Triton attention ops for the GPU, and their pure-PyTorch references.

The kernels live one per module (``triton_cache``, ``triton_decode``, ``triton_prefill``); this
module gathers the public entry points. Importing it imports Triton, so the engine imports it
only when it selects the Triton backend (lazily, inside that branch): the CPU engine and the
``inference.attention`` package never require Triton.

The references adapt ``torch_ref``'s functions (the CPU path) to the kernels' signatures; they
are the test oracle and the baseline of ``benchmarks/kernel_bench.py``. They synchronise with the
host and allocate freely: they are not for the hot path.
"""
from __future__ import annotations

import torch

from .metadata import AttentionMetadata
from .torch_decode import decode
from .torch_ref import _prefill, store_kv
from .triton_cache import store_kv_cache
from .triton_decode import choose_num_splits, paged_decode_attention
from .triton_prefill import paged_prefill_attention

__all__ = [
    "choose_num_splits", "paged_decode_attention", "paged_decode_attention_ref", "paged_prefill_attention",
    "paged_prefill_attention_ref", "store_kv_cache", "store_kv_cache_ref",
]


def store_kv_cache_ref(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
                       k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """Reference of :func:`store_kv_cache`: ``torch_ref.store_kv`` on the rows whose slot is ``>= 0``."""
    keep = slot_mapping >= 0
    store_kv(k[keep], v[keep], kv_cache, slot_mapping[keep], k_scale, v_scale)


def paged_decode_attention_ref(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                               seq_lens: torch.Tensor, scale: float, k_scale: float = 1.0,
                               v_scale: float = 1.0) -> torch.Tensor:
    """Reference of :func:`paged_decode_attention`: ``torch_decode.decode``, zeros for ``seq_len == 0`` rows.

    Every entry of ``block_tables`` (padding included) must be a valid block id: it is gathered.
    """
    meta = AttentionMetadata(
        slot_mapping=torch.empty(0, dtype=torch.int64, device=q.device),
        decode_indices=torch.arange(q.shape[0], device=q.device),
        decode_block_tables=block_tables.long(), decode_seq_lens=seq_lens.long(), prefills=[],
        block_size=kv_cache.shape[2])
    out = decode(q, kv_cache, meta, scale, k_scale, v_scale)
    return out.masked_fill((seq_lens == 0)[:, None, None], 0.0)


def paged_prefill_attention_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                                cu_seqlens_q: torch.Tensor, context_lens: torch.Tensor,
                                block_tables: torch.Tensor, max_query_len: int, scale: float,
                                k_scale: float = 1.0, v_scale: float = 1.0) -> torch.Tensor:
    """Reference of :func:`paged_prefill_attention`: ``torch_ref._prefill`` per request.

    Unlike the kernel it reads the new tokens' K/V from the cache when ``context_len > 0``, so
    store them first (as the engine does). Rows not covered by ``cu_seqlens_q`` are zeros.
    """
    out = torch.zeros_like(q)
    bounds, contexts = cu_seqlens_q.tolist(), context_lens.tolist()
    for i, context_len in enumerate(contexts):
        s, e = bounds[i], bounds[i + 1]
        if e > s:
            out[s:e] = _prefill(q[s:e], k[s:e], v[s:e], kv_cache, context_len, block_tables[i].long(), scale,
                                k_scale, v_scale)
    return out
