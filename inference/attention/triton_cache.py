"""Triton kernel that writes a step's new keys and values into the paged KV cache.

Importing this module imports Triton; the CPU engine never imports it (see ``triton_ops``).
Reference and CPU path: :func:`inference.attention.torch_ref.store_kv` (``store_kv_cache_ref``
in ``triton_ops`` adds the skipping of negative slots).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .kv_quant import FP8_DTYPE


@triton.jit
def to_cache(x, scale, cache_dtype: tl.constexpr, FP8: tl.constexpr):
    """Values as the cache stores them: with an FP8 cache ``clamp(x / scale, -448, 448)`` in e4m3
    (``kv_quant.quantize``), else ``x`` in the cache's dtype."""
    if FP8:  # a constexpr branch: one return, whose type is the branch's
        y = tl.minimum(tl.maximum(x.to(tl.float32) / scale, -448.0), 448.0).to(cache_dtype)
    else:
        y = x.to(cache_dtype)
    return y


@triton.jit
def from_cache(x, scale, dtype: tl.constexpr, FP8: tl.constexpr):
    """Cached values in the model's ``dtype``: ``x * scale`` for an FP8 cache (``kv_quant.dequantize``)."""
    if FP8:
        y = (x.to(tl.float32) * scale).to(dtype)
    else:
        y = x
    return y


@triton.jit
def as_stored(x, scale, cache_dtype: tl.constexpr, FP8: tl.constexpr):
    """``x`` rounded as the cache would store it, back in its own dtype (identity without FP8)."""
    if FP8:
        y = from_cache(to_cache(x, scale, cache_dtype, FP8), scale, x.dtype, FP8)
    else:
        y = x
    return y


@triton.jit
def _store_kv_cache_kernel(
    k_ptr, v_ptr,            # [T, Hk, D] model dtype, any strides (strides in elements below)
    k_cache_ptr, v_cache_ptr,  # [num_blocks, block_size, Hk, D] model dtype: kv_cache[0], kv_cache[1]
    slot_ptr,                # [T] int64, flat slot block_id * block_size + offset; < 0 means skip
    k_scale, v_scale,        # FP8: the layer's scales
    stride_kt, stride_kh, stride_kd,
    stride_vt, stride_vh, stride_vd,
    stride_cb, stride_cs, stride_ch, stride_cd,  # cache strides (shared by kv_cache[0] and [1])
    num_kv_heads, head_dim, block_size,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, FP8: tl.constexpr,
):
    # One program per token: copies its [Hk, D] keys and values into one cache slot.
    token = tl.program_id(0)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot < 0:  # padding row (CUDA graphs): nothing to store
        return
    block_id = slot // block_size
    offset = slot % block_size
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h[:, None] < num_kv_heads) & (offs_d[None, :] < head_dim)
    src_k = k_ptr + token.to(tl.int64) * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :] * stride_kd
    src_v = v_ptr + token.to(tl.int64) * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :] * stride_vd
    dst = block_id * stride_cb + offset * stride_cs + offs_h[:, None] * stride_ch + offs_d[None, :] * stride_cd
    cache_dtype = k_cache_ptr.dtype.element_ty
    tl.store(k_cache_ptr + dst, to_cache(tl.load(src_k, mask=mask), k_scale, cache_dtype, FP8), mask=mask)
    tl.store(v_cache_ptr + dst, to_cache(tl.load(src_v, mask=mask), v_scale, cache_dtype, FP8), mask=mask)


def check_cache_write(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Raise ValueError unless ``k``, ``v`` ``[T, Hk, D]`` and ``slot_mapping`` ``[T]`` int64 fit ``kv_cache``."""
    num_tokens, num_kv_heads, head_dim = k.shape
    if v.shape != k.shape or kv_cache.shape[3:] != (num_kv_heads, head_dim) or kv_cache.shape[0] != 2:
        raise ValueError(f"k {tuple(k.shape)}, v {tuple(v.shape)} do not fit kv_cache {tuple(kv_cache.shape)}")
    if k.dtype != v.dtype or (k.dtype != kv_cache.dtype and kv_cache.dtype != FP8_DTYPE):
        raise ValueError(f"k/v dtype {k.dtype}/{v.dtype} differs from the cache's {kv_cache.dtype}")
    if slot_mapping.shape != (num_tokens,) or slot_mapping.dtype != torch.int64:
        raise ValueError(f"slot_mapping must be [{num_tokens}] int64, got {tuple(slot_mapping.shape)} "
                         f"{slot_mapping.dtype}")


def store_kv_cache(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
                   k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """Write each token's keys and values into its cache slot, in place.

    Args:
        k, v: ``[T, Hk, D]``, the cache's dtype, any strides (views of a fused QKV output are fine).
        kv_cache: ``[2, num_blocks, block_size, Hk, D]`` (0 = keys, 1 = values), the dtype of ``k`` or
            float8 e4m3 (then stored as ``k / k_scale`` and ``v / v_scale``, saturated: :mod:`.kv_quant`).
        slot_mapping: ``[T]`` int64, flat slot ``block_id * block_size + offset`` of each token;
            a negative slot skips the token (padding rows of a CUDA-graph batch).
    Raises:
        ValueError: on mismatched shapes or dtypes.
    """
    check_cache_write(k, v, kv_cache, slot_mapping)
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    _store_kv_cache_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale,
        *k.stride(), *v.stride(), *k_cache.stride(),
        num_kv_heads, head_dim, kv_cache.shape[2],
        BLOCK_H=triton.next_power_of_2(num_kv_heads), BLOCK_D=triton.next_power_of_2(head_dim),
        FP8=kv_cache.dtype == FP8_DTYPE,
    )
