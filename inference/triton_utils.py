"""Whether the fused Triton kernels can run: shared by the model layers and the quantized linear
methods, which import it one way (``models`` imports ``quantization``, never the reverse)."""
from __future__ import annotations

import importlib.util

import torch

HAS_TRITON = importlib.util.find_spec("triton") is not None


def use_triton_layers(x: torch.Tensor) -> bool:
    """The fused Triton layers run on CUDA tensors when Triton is installed; the CPU path is PyTorch."""
    return x.is_cuda and HAS_TRITON


_NUM_SMS: dict[int, int] = {}


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA ``device`` (cached); 8 elsewhere (the Triton interpreter: a small
    number that still exercises the kernels' split paths)."""
    if device.type != "cuda":
        return 8
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _NUM_SMS:
        _NUM_SMS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _NUM_SMS[index]
