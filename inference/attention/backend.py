"""Chooses the attention implementation for a step: the PyTorch reference or the Triton kernels."""
from __future__ import annotations

import importlib.util

import torch

from .metadata import AttentionMetadata
from .torch_ref import paged_attention as torch_paged_attention

BACKENDS = ("auto", "torch", "triton")


def resolve_backend(requested: str, device: str) -> str:
    """``"auto"`` takes Triton on CUDA when it is installed, else the PyTorch reference.

    Raises:
        ValueError: an unknown backend, or ``"triton"`` without Triton installed.
    """
    if requested not in BACKENDS:
        raise ValueError(f"attention_backend must be one of {', '.join(BACKENDS)}, got {requested!r}")
    has_triton = importlib.util.find_spec("triton") is not None
    if requested == "auto":
        return "triton" if device.startswith("cuda") and has_triton else "torch"
    if requested == "triton" and not has_triton:
        raise ValueError("attention_backend='triton' needs the triton package")
    return requested


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float, kv_stored: bool = False, k_scale: float = 1.0,
                    v_scale: float = 1.0, out: torch.Tensor | None = None) -> torch.Tensor:
    """Store the step's K/V in the paged cache and attend (shapes as in ``torch_ref.paged_attention``).

    ``kv_stored``: the caller already wrote ``k`` and ``v`` to the cache (the model's rotary kernel does on
    the Triton backend); the Triton path then skips its store kernel. ``k_scale``, ``v_scale``: the
    layer's scales of an FP8 cache (:mod:`.kv_quant`). ``out``: a ``[T, Hq, D]`` buffer of ``q``'s dtype to
    write into (returned).
    """
    if meta.backend == "torch":
        result = torch_paged_attention(q, k, v, kv_cache, meta, scale, k_scale, v_scale)
        return result if out is None else out.copy_(result)
    from . import triton_ops  # imported only when the Triton backend is in use

    scales = dict(k_scale=k_scale, v_scale=v_scale)
    if not kv_stored:
        triton_ops.store_kv_cache(k, v, kv_cache, meta.slot_mapping, **scales)
    if meta.decode_only:
        return triton_ops.paged_decode_attention(q, kv_cache, meta.block_tables, meta.seq_lens, scale, out=out,
                                                 max_seq_len=meta.max_seq_len, num_splits=meta.num_splits, **scales)
    d = meta.num_leading_decodes
    if d == 0:
        return triton_ops.paged_prefill_attention(q, k, v, kv_cache, meta.cu_seqlens_q, meta.context_lens,
                                                  meta.block_tables, meta.max_query_len, scale, out=out, **scales)
    # The leading decodes through the decode kernel (one row each), the prefills after them through
    # the prefill kernel, both into one output.
    out = torch.empty_like(q) if out is None else out
    triton_ops.paged_decode_attention(q[:d], kv_cache, meta.block_tables[:d], meta.seq_lens[:d], scale,
                                      out=out[:d], max_seq_len=meta.max_seq_len, **scales)
    triton_ops.paged_prefill_attention(q[d:], k[d:], v[d:], kv_cache, meta.prefill_cu_seqlens_q,
                                       meta.context_lens[d:], meta.block_tables[d:], meta.max_query_len, scale,
                                       out=out[d:], **scales)
    return out
