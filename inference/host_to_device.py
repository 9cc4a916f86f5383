"""Host-to-device copies that never wait for the device.

A copy from pageable host memory is synchronous: PyTorch stages it and then waits for the
stream, i.e. for every kernel already queued, which in a pipelined step is the whole previous
step. Copies from pinned memory with ``non_blocking=True`` are queued like kernels instead.
``to_device`` packs a step's small host arrays into one pinned staging buffer and sends them
with one asynchronous copy (one transfer instead of one per array); PyTorch's caching host
allocator keeps the staging buffer alive until that copy has run, so it is safe to drop it.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

_ALIGN = 16  # bytes: every array starts aligned for any dtype's view

_TORCH_DTYPES = {np.dtype(np.int64): torch.int64, np.dtype(np.int32): torch.int32,
                 np.dtype(np.float32): torch.float32, np.dtype(np.bool_): torch.bool}


def to_device(arrays: Sequence[np.ndarray], device: str | torch.device) -> list[torch.Tensor]:
    """Tensors on ``device`` with the contents, dtypes and shapes of ``arrays``.

    Args:
        arrays: numpy arrays of int64, int32, float32 or bool.
        device: target device; on CPU the arrays are wrapped without a copy (they must not be
            modified afterwards).
    Returns:
        One tensor per array, in order. On CUDA they are views into one device buffer whose copy
        is queued on the current stream (ordered before any kernel launched afterwards).
    """
    device = torch.device(device)
    arrays = [np.ascontiguousarray(a) for a in arrays]
    if device.type != "cuda":
        return [torch.from_numpy(a) for a in arrays]
    offsets, total = [], 0
    for a in arrays:
        offsets.append(total)
        total += -(-a.nbytes // _ALIGN) * _ALIGN
    staging = torch.empty(max(total, _ALIGN), dtype=torch.uint8, pin_memory=True)
    host = staging.numpy()
    for a, offset in zip(arrays, offsets):
        host[offset:offset + a.nbytes] = a.reshape(-1).view(np.uint8)
    on_device = staging.to(device, non_blocking=True)
    return [on_device[offset:offset + a.nbytes].view(_TORCH_DTYPES[a.dtype]).view(a.shape)
            for a, offset in zip(arrays, offsets)]


def tensor_to_device(tensor: torch.Tensor, device: str | torch.device) -> torch.Tensor:
    """``tensor`` (on the CPU) on ``device`` without waiting for the device's queued work."""
    if torch.device(device).type != "cuda":
        return tensor
    return tensor.pin_memory().to(device, non_blocking=True)
