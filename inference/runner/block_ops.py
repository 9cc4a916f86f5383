"""Whole-block copies, one batched copy per layer and step: inside the KV cache (copy on write)
and between the KV cache and the CPU swap space (swap preemption)."""
from __future__ import annotations

import numpy as np
import torch

from ..attention.kv_quant import FP8_DTYPE

from ..host_to_device import to_device


def copy_blocks(kv_caches: list[torch.Tensor], pairs: list[tuple[int, int]], device: str) -> None:
    """Copy blocks ``source -> destination`` in every layer's cache.

    Args:
        kv_caches: per layer ``[2, num_blocks, block_size, Hk, D]``.
        pairs: ``(source, destination)`` block ids; every source is read before any destination
            is written, so a block may be both.
    """
    src, dst = to_device([np.array([s for s, _ in pairs], np.int64), np.array([d for _, d in pairs], np.int64)],
                         device)
    for cache in kv_caches:
        cache = _indexable(cache)
        cache.index_copy_(1, dst, cache.index_select(1, src))


def swap_blocks(src_caches: list[torch.Tensor], dst_caches: list[torch.Tensor], pairs: list[tuple[int, int]]) -> None:
    """Copy blocks between the KV cache and the CPU swap space (either way), layer by layer.

    Args:
        src_caches, dst_caches: per layer ``[2, num_blocks, block_size, Hk, D]``, same dtype; one
            side on the device, the other on the CPU (both on the CPU for a CPU engine).
        pairs: ``(source block, destination block)``.
    The device-to-host direction waits for its copy (it is rare: a preemption); the host-to-device
    copy is queued on the current stream before the step's forward pass.
    """
    src_device, dst_device = src_caches[0].device, dst_caches[0].device
    src = torch.tensor([s for s, _ in pairs], dtype=torch.long).to(src_device)
    dst = torch.tensor([d for _, d in pairs], dtype=torch.long).to(dst_device)
    for src_cache, dst_cache in zip(src_caches, dst_caches):
        src_cache, dst_cache = _indexable(src_cache), _indexable(dst_cache)
        blocks = src_cache.index_select(1, src)
        dst_cache.index_copy_(1, dst, blocks.to(dst_device, non_blocking=dst_device.type != "cpu"))


def _indexable(cache: torch.Tensor) -> torch.Tensor:
    """``cache`` itself, or its bytes for an FP8 cache (``index_select``/``index_copy_`` have no float8 kernels)."""
    return cache.view(torch.uint8) if cache.dtype == FP8_DTYPE else cache
