"""Weight quantization: AWQ and GPTQ 4-bit checkpoints (W4A16), FP8 W8A8 quantized at load, and the
algorithms that produce AWQ/GPTQ checkpoints (``inference.quantization.quantize``).

Modules: ``config`` (which quantization, from the argument and config.json), ``packing`` (the on-disk
layouts and the dequantization reference), ``linear`` (``QuantizedLinear`` and its method interface),
``int4`` (AWQ/GPTQ), ``triton_w4a16`` (the GPU kernel), ``fp8``, ``awq`` and ``gptq`` (the
algorithms), ``quantize`` (checkpoint writer), ``perplexity``.
"""
from __future__ import annotations

from .config import QUANTIZATION_METHODS, QuantizationConfig, resolve_quantization
from .linear import (LinearMethodBase, QuantizedLinear, WeightMemory, held_dequantized_bytes, log_weight_memory,
                     process_quantized_weights, quantize_linear_layers, weight_memory)

__all__ = [
    "QUANTIZATION_METHODS", "LinearMethodBase", "QuantizationConfig", "QuantizedLinear", "WeightMemory",
    "held_dequantized_bytes",
    "log_weight_memory", "process_quantized_weights", "quantize_linear_layers", "resolve_quantization",
    "weight_memory",
]
