"""Whether the fused Triton kernels can run: shared by the model layers and the quantized linear
methods, which import it one way (``models`` imports ``quantization``, never the reverse)."""
from __future__ import annotations

import importlib.util

import torch

HAS_TRITON = importlib.util.find_spec("triton") is not None


def use_triton_layers(x: torch.Tensor) -> bool:
    """The fused Triton layers run on CUDA tensors when Triton is installed; the CPU path is PyTorch."""
    return x.is_cuda and HAS_TRITON
