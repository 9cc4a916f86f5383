"""Whole-block copies inside the KV cache (copy on write), one batched copy per layer and step."""
from __future__ import annotations

import torch


def copy_blocks(kv_caches: list[torch.Tensor], pairs: list[tuple[int, int]], device: str) -> None:
    """Copy blocks ``source -> destination`` in every layer's cache.

    Args:
        kv_caches: per layer ``[2, num_blocks, block_size, Hk, D]``.
        pairs: ``(source, destination)`` block ids; every source is read before any destination
            is written, so a block may be both.
    """
    src = torch.tensor([s for s, _ in pairs], dtype=torch.long).to(device, non_blocking=True)
    dst = torch.tensor([d for _, d in pairs], dtype=torch.long).to(device, non_blocking=True)
    for cache in kv_caches:
        cache.index_copy_(1, dst, cache.index_select(1, src))
