"""Fused Triton versions of the element-wise layers in ``layers.py``: RMSNorm, rotary, SwiGLU.

Each kernel reads its inputs once and writes its outputs once (the PyTorch versions launch
several kernels with float32 temporaries). References, CPU path and test oracles:
``layers.RMSNorm``, ``layers.RotaryEmbedding`` and ``layers.silu_and_mul``.

Importing this module imports Triton; the CPU engine never imports it (the model imports it
lazily, only when it selects the Triton backend).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..attention.kv_quant import FP8_DTYPE
from ..attention.triton_cache import check_cache_write, to_cache
from ..quantization.fp8 import _MIN_SCALE, FP8_DTYPE, FP8_MAX, Fp8Activation
from ..quantization.triton_fp8 import fp8_codes, fp8_row_scale

_TL_DTYPES = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}


@triton.jit
def _rms_norm_kernel(
    x_ptr,          # [N, H] input dtype, row stride stride_x, unit column stride
    residual_ptr,   # [N, H] input dtype, row stride stride_r (read only when HAS_RESIDUAL)
    weight_ptr,     # [H] weight dtype, contiguous
    out_ptr,        # [N, H] result dtype of (weight, x), contiguous
    new_residual_ptr,  # [N, H] input dtype, contiguous (written only when HAS_RESIDUAL)
    scales_ptr,     # [N] float32 per-row FP8 scales (written only when FP8_OUT; out_ptr then holds e4m3 codes)
    stride_x, stride_r, hidden_size, eps,
    HAS_RESIDUAL: tl.constexpr, FP8_OUT: tl.constexpr, ROUND_DTYPE: tl.constexpr, FP8_MAX: tl.constexpr,
    MIN_SCALE: tl.constexpr, BLOCK: tl.constexpr,
):
    # One program per row: s = x (+ residual, rounded to the input dtype); out = w * (s * rsqrt(mean(s^2) + eps)).
    # FP8_OUT: out rounded to the result dtype, then quantized per row (as per_token_fp8 of the 16-bit output).
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden_size
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_r + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        tl.store(new_residual_ptr + row * hidden_size + cols, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(xf * xf, 0) / hidden_size + eps)
    normed = (xf * rstd).to(x.dtype).to(tl.float32)  # as RMSNorm: back to the input dtype, then * weight
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if FP8_OUT:
        y = (w * normed).to(ROUND_DTYPE).to(tl.float32)
        scale = fp8_row_scale(tl.max(tl.abs(y), 0), FP8_MAX, MIN_SCALE)
        tl.store(scales_ptr + row, scale)
        tl.store(out_ptr + row * hidden_size + cols, fp8_codes(y, scale, FP8_MAX), mask=mask)
    else:
        tl.store(out_ptr + row * hidden_size + cols, (w * normed).to(out_ptr.dtype.element_ty), mask=mask)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """``[..., H] -> [N, H]`` with a unit column stride (a view when possible)."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def _launch_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
                     fp8_out: bool = False) -> tuple[torch.Tensor | Fp8Activation, torch.Tensor | None]:
    hidden = x.shape[-1]
    if weight.shape != (hidden,):
        raise ValueError(f"weight {tuple(weight.shape)} does not match hidden size {hidden}")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError(f"residual {tuple(residual.shape)} {residual.dtype} differs from x {tuple(x.shape)} {x.dtype}")
    x2 = _rows(x)
    r2 = _rows(residual) if residual is not None else x2
    result_dtype = torch.result_type(weight, x)
    out = torch.empty(x.shape, dtype=FP8_DTYPE if fp8_out else result_dtype, device=x.device)
    scales = torch.empty((x2.shape[0], 1), dtype=torch.float32, device=x.device) if fp8_out else None
    new_residual = torch.empty_like(x, memory_format=torch.contiguous_format) if residual is not None else None
    if x2.shape[0]:
        block = triton.next_power_of_2(hidden)
        _rms_norm_kernel[(x2.shape[0],)](
            x2, r2, weight.contiguous(), out, new_residual if new_residual is not None else out,
            scales if fp8_out else out, x2.stride(0), r2.stride(0), hidden, eps,
            HAS_RESIDUAL=residual is not None, FP8_OUT=fp8_out, ROUND_DTYPE=_TL_DTYPES[result_dtype],
            FP8_MAX=FP8_MAX, MIN_SCALE=_MIN_SCALE, BLOCK=block, num_warps=min(max(block // 256, 1), 16))
    if fp8_out:
        return Fp8Activation(out.reshape(-1, hidden), scales, result_dtype), new_residual
    return out, new_residual


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             fp8_out: bool = False) -> torch.Tensor | Fp8Activation:
    """Fused RMSNorm (Zhang & Sennrich, 2019), same semantics as ``layers.RMSNorm`` without residual.

    Args:
        x: ``[..., H]`` fp16/bf16/fp32 (any leading shape; copied only if rows cannot be viewed).
        weight: ``[H]``.
        eps: added to the mean square.
        fp8_out: return the result quantized per row for an FP8 linear layer, in the same kernel:
            ``Fp8Activation(codes [N, H] float8_e4m3fn, scales [N, 1] float32)``, equal to
            ``per_token_fp8`` of the 16-bit result (``N``: the rows of ``x``).
    Returns:
        ``[..., H]`` contiguous, dtype ``torch.result_type(weight, x)``; math in float32, the
        normalised value rounded to ``x.dtype`` before the weight multiplies it.
    Raises:
        ValueError: if ``weight`` does not match ``H``.
    """
    return _launch_rms_norm(x, None, weight, eps, fp8_out)[0]


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                       fp8_out: bool = False) -> tuple[torch.Tensor | Fp8Activation, torch.Tensor]:
    """``RMSNorm(x, residual)``: the residual add and the norm in one pass.

    Args:
        x, residual: ``[..., H]``, same shape and dtype.
        weight: ``[H]``; eps: added to the mean square; fp8_out: as in ``rms_norm``.
    Returns:
        ``(normed, new_residual)`` with ``new_residual = x + residual`` (in ``x.dtype``) and
        ``normed = rms_norm(new_residual)``; new contiguous tensors, inputs untouched.
    Raises:
        ValueError: on mismatched shapes or dtypes.
    """
    return _launch_rms_norm(x, residual, weight, eps, fp8_out)


@triton.jit
def _rotary_kernel(
    positions_ptr,   # [T] int64 token positions
    q_ptr,           # [T, Hq, D] any strides, rotated in place
    k_ptr,           # [T, Hk, D] any strides, rotated in place
    cos_ptr, sin_ptr,  # [max_position, D] float32, row stride stride_cos / stride_sin, unit column stride
    v_ptr,           # STORE_KV: [T, Hk, D] any strides
    k_cache_ptr, v_cache_ptr,  # STORE_KV: [num_blocks, block_size, Hk, D]: kv_cache[0], kv_cache[1]
    slot_ptr,        # STORE_KV: [T] int64 flat cache slot of each token; < 0: not stored (padding row)
    k_scale, v_scale,  # STORE_KV with an FP8 cache: the layer's scales
    stride_qt, stride_qh, stride_qd, stride_kt, stride_kh, stride_kd, stride_cos, stride_sin,
    stride_vt, stride_vh, stride_vd, stride_cb, stride_cs, stride_ch, stride_cd,
    num_q_heads, num_k_heads, half_dim, block_size,
    BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_HALF: tl.constexpr, STORE_KV: tl.constexpr,
    FP8: tl.constexpr,
):
    # One program per token: x = [x1, x2] -> [x1*c1 - x2*s1, x2*c2 + x1*s2] (rotate-half layout).
    # STORE_KV: the rotated keys and the values also go to the token's paged-cache slot (store_kv_cache's
    # job, without its launch).
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + token).to(tl.int64)
    cols = tl.arange(0, BLOCK_HALF)
    c_mask = cols < half_dim
    dtype = q_ptr.dtype.element_ty
    # As RotaryEmbedding: the float32 table is cast to the model dtype before use.
    c1 = tl.load(cos_ptr + pos * stride_cos + cols, mask=c_mask, other=0.0).to(dtype).to(tl.float32)
    c2 = tl.load(cos_ptr + pos * stride_cos + half_dim + cols, mask=c_mask, other=0.0).to(dtype).to(tl.float32)
    s1 = tl.load(sin_ptr + pos * stride_sin + cols, mask=c_mask, other=0.0).to(dtype).to(tl.float32)
    s2 = tl.load(sin_ptr + pos * stride_sin + half_dim + cols, mask=c_mask, other=0.0).to(dtype).to(tl.float32)

    hq = tl.arange(0, BLOCK_HQ)
    mask = (hq[:, None] < num_q_heads) & c_mask[None, :]
    base = q_ptr + token * stride_qt + hq[:, None] * stride_qh + cols[None, :] * stride_qd
    x1 = tl.load(base, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(base + half_dim * stride_qd, mask=mask, other=0.0).to(tl.float32)
    tl.store(base, (x1 * c1[None, :] - x2 * s1[None, :]).to(dtype), mask=mask)
    tl.store(base + half_dim * stride_qd, (x2 * c2[None, :] + x1 * s2[None, :]).to(dtype), mask=mask)

    hk = tl.arange(0, BLOCK_HK)
    mask = (hk[:, None] < num_k_heads) & c_mask[None, :]
    base = k_ptr + token * stride_kt + hk[:, None] * stride_kh + cols[None, :] * stride_kd
    x1 = tl.load(base, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(base + half_dim * stride_kd, mask=mask, other=0.0).to(tl.float32)
    k1 = (x1 * c1[None, :] - x2 * s1[None, :]).to(dtype)
    k2 = (x2 * c2[None, :] + x1 * s2[None, :]).to(dtype)
    tl.store(base, k1, mask=mask)
    tl.store(base + half_dim * stride_kd, k2, mask=mask)
    if STORE_KV:
        slot = tl.load(slot_ptr + token)
        if slot >= 0:
            dst = ((slot // block_size) * stride_cb + (slot % block_size) * stride_cs + hk[:, None] * stride_ch
                   + cols[None, :] * stride_cd)
            cache_dtype = k_cache_ptr.dtype.element_ty
            tl.store(k_cache_ptr + dst, to_cache(k1, k_scale, cache_dtype, FP8), mask=mask)
            tl.store(k_cache_ptr + dst + half_dim * stride_cd, to_cache(k2, k_scale, cache_dtype, FP8), mask=mask)
            src = v_ptr + token * stride_vt + hk[:, None] * stride_vh + cols[None, :] * stride_vd
            tl.store(v_cache_ptr + dst, to_cache(tl.load(src, mask=mask), v_scale, cache_dtype, FP8), mask=mask)
            tl.store(v_cache_ptr + dst + half_dim * stride_cd,
                     to_cache(tl.load(src + half_dim * stride_vd, mask=mask), v_scale, cache_dtype, FP8), mask=mask)


def rotary_embedding(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                     sin: torch.Tensor, cache_write: tuple | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary position embedding (Su et al., RoFormer, 2021), rotate-half / GPT-NeoX layout, in place.

    Same result as ``layers.RotaryEmbedding.forward`` up to rounding: the products are summed in
    float32 and rounded once, where the reference rounds each product to the model dtype.

    Args:
        positions: ``[T]`` int64 token positions, each ``< max_position``.
        q: ``[T, Hq, D]``, k: ``[T, Hk, D]``, same dtype, any strides (views of a fused QKV output
            are fine); both are overwritten.
        cos, sin: ``[max_position, D]`` float32 tables (``RotaryEmbedding.cos`` / ``.sin``).
        cache_write: ``(v [T, Hk, D], kv_cache [2, num_blocks, block_size, Hk, D], slot_mapping [T] int64[,
            k_scale, v_scale])``: also write the rotated keys and ``v`` into the paged cache in the same kernel,
            as ``attention.triton_ops.store_kv_cache`` would (negative slots skipped; an FP8 cache's scales).
    Returns:
        ``(q, k)``, the same tensors, rotated.
    Raises:
        ValueError: on mismatched shapes or dtypes, or an odd ``D``.
    """
    num_tokens, num_q_heads, head_dim = q.shape
    if k.shape[0] != num_tokens or k.shape[2] != head_dim or k.dtype != q.dtype or head_dim % 2:
        raise ValueError(f"q {tuple(q.shape)} {q.dtype} and k {tuple(k.shape)} {k.dtype} do not match")
    if cos.shape != sin.shape or cos.shape[1] != head_dim or cos.stride(1) != 1 or sin.stride(1) != 1:
        raise ValueError(f"cos/sin tables {tuple(cos.shape)}/{tuple(sin.shape)} must be [max_position, {head_dim}]")
    if positions.shape != (num_tokens,):
        raise ValueError(f"positions {tuple(positions.shape)} must be [{num_tokens}]")
    if cache_write is not None:
        v, kv_cache, slot_mapping, *scales = cache_write
        k_scale, v_scale = scales or (1.0, 1.0)
        check_cache_write(k, v, kv_cache, slot_mapping)
        k_cache, v_cache = kv_cache[0], kv_cache[1]
        cache_args = (v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
        fp8 = kv_cache.dtype == FP8_DTYPE
        cache_strides = (*v.stride(), *k_cache.stride())
        block_size = kv_cache.shape[2]
    else:
        cache_args, cache_strides, block_size, fp8 = (q, q, q, positions, 1.0, 1.0), (0,) * 7, 1, False
    if num_tokens:
        _rotary_kernel[(num_tokens,)](
            positions, q, k, cos, sin, *cache_args, *q.stride(), *k.stride(), cos.stride(0), sin.stride(0),
            *cache_strides, num_q_heads, k.shape[1], head_dim // 2, block_size,
            BLOCK_HQ=triton.next_power_of_2(num_q_heads), BLOCK_HK=triton.next_power_of_2(k.shape[1]),
            BLOCK_HALF=triton.next_power_of_2(head_dim // 2), STORE_KV=cache_write is not None, FP8=fp8, num_warps=4)
    return q, k


@triton.jit
def _silu_mul_tile(x_ptr, token, stride_x, inter_size, cols, mask):
    # silu(gate) * up over one column tile: float32 math, silu rounded to the input dtype as F.silu does,
    # the product returned in the input dtype.
    gate = tl.load(x_ptr + token * stride_x + cols, mask=mask, other=0.0)
    up = tl.load(x_ptr + token * stride_x + inter_size + cols, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(gate.dtype).to(tl.float32)
    return (act * up.to(tl.float32)).to(gate.dtype)


@triton.jit
def _silu_and_mul_kernel(
    x_ptr,      # [T, 2I] input dtype, row stride stride_x, unit column stride: [gate | up]
    out_ptr,    # [T, I] input dtype, contiguous
    stride_x, inter_size,
    BLOCK: tl.constexpr,
):
    # Program (token, column tile): out = silu(gate) * up.
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter_size
    tl.store(out_ptr + token * inter_size + cols, _silu_mul_tile(x_ptr, token, stride_x, inter_size, cols, mask),
             mask=mask)


@triton.jit
def _silu_and_mul_fp8_kernel(
    x_ptr,       # [T, 2I] input dtype, row stride stride_x, unit column stride: [gate | up]
    codes_ptr,   # [T, I] float8_e4m3fn, contiguous
    scales_ptr,  # [T] float32
    stride_x, inter_size,
    FP8_MAX: tl.constexpr, MIN_SCALE: tl.constexpr, BLOCK: tl.constexpr, BLOCK_TAIL: tl.constexpr,
    ROW_IN_REGISTERS: tl.constexpr,
):
    # One program per token. ROW_IN_REGISTERS: the row is read once and held as a BLOCK-wide head tile and
    # a BLOCK_TAIL-wide tail (BLOCK + BLOCK_TAIL >= I); otherwise two passes over BLOCK-wide tiles, the
    # largest |silu(gate) * up| (rounded to the input dtype) first, then the codes, the row read twice.
    token = tl.program_id(0).to(tl.int64)
    if ROW_IN_REGISTERS:
        cols = tl.arange(0, BLOCK)
        head = _silu_mul_tile(x_ptr, token, stride_x, inter_size, cols, cols < inter_size).to(tl.float32)
        tail_cols = BLOCK + tl.arange(0, BLOCK_TAIL)
        tail_mask = tail_cols < inter_size
        tail = _silu_mul_tile(x_ptr, token, stride_x, inter_size, tail_cols, tail_mask).to(tl.float32)
        scale = fp8_row_scale(tl.maximum(tl.max(tl.abs(head), 0), tl.max(tl.abs(tail), 0)), FP8_MAX, MIN_SCALE)
        tl.store(scales_ptr + token, scale)
        tl.store(codes_ptr + token * inter_size + cols, fp8_codes(head, scale, FP8_MAX), mask=cols < inter_size)
        tl.store(codes_ptr + token * inter_size + tail_cols, fp8_codes(tail, scale, FP8_MAX), mask=tail_mask)
    else:
        amax = tl.zeros((BLOCK,), dtype=tl.float32)
        for c0 in range(0, inter_size, BLOCK):
            cols = c0 + tl.arange(0, BLOCK)
            y = _silu_mul_tile(x_ptr, token, stride_x, inter_size, cols, cols < inter_size).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(y))
        scale = fp8_row_scale(tl.max(amax, 0), FP8_MAX, MIN_SCALE)
        tl.store(scales_ptr + token, scale)
        for c0 in range(0, inter_size, BLOCK):
            cols = c0 + tl.arange(0, BLOCK)
            mask = cols < inter_size
            y = _silu_mul_tile(x_ptr, token, stride_x, inter_size, cols, mask).to(tl.float32)
            tl.store(codes_ptr + token * inter_size + cols, fp8_codes(y, scale, FP8_MAX), mask=mask)


# The widest SwiGLU row the FP8 kernel holds in registers (16 warps, at most 64 float32 values per thread);
# wider rows, none of the registered shapes' (Qwen2.5-72B's I is 29,568), are read twice.
_FP8_ROW_IN_REGISTERS_MAX = 32768


def _silu_and_mul_fp8_launch(x2: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, inter: int) -> None:
    if inter <= _FP8_ROW_IN_REGISTERS_MAX:
        # Read once. With the two-pass loop, W1's decode (256 rows, I = 18,944) took 22 us per call on
        # the H200 (w1-bf16-fp8-kernel-profile_h200_2026-11-30.json), several times its bytes' worth.
        head = 1 << (inter.bit_length() - 1)  # the largest power of two <= I
        tail = max(triton.next_power_of_2(inter - head), 16)
        num_warps = 16 if inter > 8192 else 8 if inter > 2048 else 4
        _silu_and_mul_fp8_kernel[(x2.shape[0],)](x2, codes, scales, x2.stride(0), inter, FP8_MAX=FP8_MAX,
                                                 MIN_SCALE=_MIN_SCALE, BLOCK=head, BLOCK_TAIL=tail,
                                                 ROW_IN_REGISTERS=True, num_warps=num_warps)
    else:
        _silu_and_mul_fp8_kernel[(x2.shape[0],)](x2, codes, scales, x2.stride(0), inter, FP8_MAX=FP8_MAX,
                                                 MIN_SCALE=_MIN_SCALE, BLOCK=2048, BLOCK_TAIL=16,
                                                 ROW_IN_REGISTERS=False, num_warps=8)


def silu_and_mul(x: torch.Tensor, fp8_out: bool = False) -> torch.Tensor | Fp8Activation:
    """Fused SwiGLU activation (Shazeer, 2020), as ``layers.silu_and_mul``: ``[T, 2I] -> [T, I]``.

    Args:
        x: ``[T, 2I]`` fp16/bf16/fp32, ``[gate | up]`` along the last dimension, unit column stride.
        fp8_out: return the result quantized per row for an FP8 linear layer, in the same kernel:
            ``Fp8Activation(codes [T, I] float8_e4m3fn, scales [T, 1] float32)``, equal to
            ``per_token_fp8`` of the 16-bit result.
    Returns:
        ``silu(gate) * up``, ``[T, I]`` contiguous, dtype of ``x``; math in float32.
    Raises:
        ValueError: if the last dimension is odd.
    """
    if x.shape[-1] % 2:
        raise ValueError(f"last dimension {x.shape[-1]} is not even")
    x2 = _rows(x)
    inter = x.shape[-1] // 2
    if fp8_out:
        codes = torch.empty((x2.shape[0], inter), dtype=FP8_DTYPE, device=x.device)
        scales = torch.empty((x2.shape[0], 1), dtype=torch.float32, device=x.device)
        if x2.shape[0]:
            _silu_and_mul_fp8_launch(x2, codes, scales, inter)
        return Fp8Activation(codes, scales, x.dtype)
    out = torch.empty(*x.shape[:-1], inter, dtype=x.dtype, device=x.device)
    if x2.shape[0]:
        block = min(triton.next_power_of_2(inter), 1024)
        _silu_and_mul_kernel[(x2.shape[0], triton.cdiv(inter, block))](x2, out, x2.stride(0), inter, BLOCK=block,
                                                                        num_warps=4)
    return out
