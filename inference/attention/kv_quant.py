"""FP8 KV cache: the dtype that stores keys and values, and the conversions into and out of it.

``kv_cache_dtype`` takes vLLM's values: ``"auto"`` stores K and V in the model's dtype; ``"fp8"`` and
``"fp8_e4m3"`` store them as float8 e4m3 (``torch.float8_e4m3fn``), each layer's keys and values with
one scale each (``k_scale``, ``v_scale``; 1.0 unless the checkpoint gives them, as in vLLM). A value
is stored as ``clamp(x / scale, -448, 448)`` in e4m3 (saturating, as vLLM's ``scaled_fp8_conversion``)
and read back as ``stored * scale`` in the model's dtype. These functions are the CPU path and the
reference of the Triton kernels, which convert in registers.
"""
from __future__ import annotations

import torch

from ..errors import InvalidRequestError

KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")
FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # the largest finite e4m3 value


def kv_cache_torch_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The torch dtype of the KV cache for ``kv_cache_dtype`` (one of :data:`KV_CACHE_DTYPES`).

    Raises:
        InvalidRequestError: an unknown value (naming ``kv_cache_dtype`` and the accepted ones).
    """
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise InvalidRequestError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, "
                                  f"got {kv_cache_dtype!r}.", param="kv_cache_dtype")
    return model_dtype if kv_cache_dtype == "auto" else FP8_DTYPE


def is_fp8(cache: torch.Tensor) -> bool:
    return cache.dtype == FP8_DTYPE


def quantize(x: torch.Tensor, scale: float) -> torch.Tensor:
    """``x`` (any shape, float) as e4m3: ``clamp(x / scale, -448, 448)``."""
    y = x.float()
    if scale != 1.0:
        y = y / scale
    return y.clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def dequantize(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """Stored values ``x`` back in ``dtype``: ``x * scale`` (``x`` returned as is when it is not FP8)."""
    if not is_fp8(x):
        return x
    y = x.to(dtype)
    return y * scale if scale != 1.0 else y
