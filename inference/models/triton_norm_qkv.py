"""One Triton kernel for the head of a decode step's attention block: residual add, RMSNorm, the fused
Q/K/V projection (with its bias), rotary embedding of Q and K, and the store of K and V in the paged cache.

Unfused, a layer launches three kernels here (``fused_add_rms_norm``, the cuBLAS GEMM, ``rotary_embedding``
with its cache write); at decode batch sizes each costs a few microseconds whatever its bytes. Each program
owns one head (``D`` output columns, as two ``D/2`` halves, the rotate-half pairs) for ``BLOCK_M`` rows, so
the rotation happens on the GEMM's accumulators. RMSNorm's per-row scale commutes with the matmul:
``(x * rstd * g) @ W^T = rstd * ((x * g) @ W^T)``, so the sum of squares is gathered in the same K loop.
This rounds once less than the unfused layers (which round ``x * rstd`` to the model dtype before ``g``);
results agree to the model dtype's rounding.

Importing this module imports Triton; the model imports it lazily, for CUDA tensors only.
References: ``layers.RMSNorm``, ``torch.nn.functional.linear``, ``layers.RotaryEmbedding`` and
``attention.torch_ref.store_kv`` one after the other.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_ROWS = 256  # the decode batches (CUDA-graph buckets) it is used for; prefill chunks keep cuBLAS
ENABLED = True  # a benchmark knob (benchmarks/throughput.py --no-fused-norm-qkv), read when a step is traced


@triton.jit
def _norm_qkv_rope_kernel(
    x_ptr, residual_ptr,     # [T, H] model dtype, row strides stride_x / stride_r, unit column stride
    new_residual_ptr,        # [T, H] contiguous: x + residual (written by the head-0 programs when HAS_RESIDUAL)
    norm_w_ptr,              # [H] RMSNorm weight
    w_ptr,                   # [(Hq + 2 Hk) * D, H] Q/K/V weight, row stride stride_w, unit column stride
    bias_ptr,                # [(Hq + 2 Hk) * D] (read when HAS_BIAS)
    positions_ptr,           # [T] int64
    cos_ptr, sin_ptr,        # [max_position, D] float32, row strides stride_cos / stride_sin
    q_ptr,                   # [T, Hq, D] contiguous output: rotated queries
    k_cache_ptr, v_cache_ptr,  # [num_blocks, block_size, Hk, D]: kv_cache[0], kv_cache[1]
    slot_ptr,                # [T] int64 flat cache slots; < 0: not stored (padding row)
    num_tokens, hidden_size, eps,
    stride_x, stride_r, stride_w, stride_cos, stride_sin,
    stride_cb, stride_cs, stride_ch, stride_cd,
    num_q_heads, num_kv_heads, block_size,
    HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr, HAS_BIAS: tl.constexpr,
):
    # Program (row tile m, head j, column tile c): head j < Hq a query head, then Hk key heads, then Hk
    # value heads; of its D columns the BLOCK_H at c * BLOCK_H of the first half and their rotate-half
    # partners, HALF further on.
    pid_m = tl.program_id(0)
    head = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < num_tokens
    rows64 = rows.to(tl.int64)
    cols = tl.program_id(2) * BLOCK_H + tl.arange(0, BLOCK_H)  # within the half
    n1 = head * 2 * HALF + cols  # columns of the weight; n1 + HALF their partners
    offs_k = tl.arange(0, BLOCK_K)
    acc1 = tl.zeros([BLOCK_M, BLOCK_H], tl.float32)
    acc2 = tl.zeros([BLOCK_M, BLOCK_H], tl.float32)
    sum_sq = tl.zeros([BLOCK_M], tl.float32)
    for k0 in range(0, hidden_size, BLOCK_K):
        ks = k0 + offs_k
        k_mask = ks < hidden_size
        xm = row_mask[:, None] & k_mask[None, :]
        x = tl.load(x_ptr + rows64[:, None] * stride_x + ks[None, :], mask=xm, other=0.0)
        if HAS_RESIDUAL:
            r = tl.load(residual_ptr + rows64[:, None] * stride_r + ks[None, :], mask=xm, other=0.0)
            x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
            if head == 0 and tl.program_id(2) == 0:
                tl.store(new_residual_ptr + rows64[:, None] * hidden_size + ks[None, :], x, mask=xm)
        xf = x.to(tl.float32)
        sum_sq += tl.sum(xf * xf, 1)
        g = tl.load(norm_w_ptr + ks, mask=k_mask, other=0.0).to(tl.float32)
        xg = (xf * g[None, :]).to(x.dtype)
        w1 = tl.load(w_ptr + n1[None, :].to(tl.int64) * stride_w + ks[:, None], mask=k_mask[:, None], other=0.0)
        w2 = tl.load(w_ptr + (n1 + HALF)[None, :].to(tl.int64) * stride_w + ks[:, None], mask=k_mask[:, None],
                     other=0.0)
        acc1 = tl.dot(xg, w1, acc1)
        acc2 = tl.dot(xg, w2, acc2)

    dtype = x_ptr.dtype.element_ty
    rstd = tl.rsqrt(sum_sq / hidden_size + eps)
    y1 = acc1 * rstd[:, None]
    y2 = acc2 * rstd[:, None]
    if HAS_BIAS:
        y1 += tl.load(bias_ptr + n1).to(tl.float32)[None, :]
        y2 += tl.load(bias_ptr + n1 + HALF).to(tl.float32)[None, :]
    y1 = y1.to(dtype).to(tl.float32)  # the projection's output in the model dtype, as F.linear returns it
    y2 = y2.to(dtype).to(tl.float32)
    tile_mask = row_mask[:, None] & (cols[None, :] < HALF)  # (always true in the columns: HALF % BLOCK_H == 0)
    if head < num_q_heads + num_kv_heads:  # rotate-half: [y1, y2] -> [y1 c1 - y2 s1, y2 c2 + y1 s2]
        pos = tl.load(positions_ptr + rows, mask=row_mask, other=0).to(tl.int64)
        # As RotaryEmbedding: the float32 table is cast to the model dtype before use.
        c1 = tl.load(cos_ptr + pos[:, None] * stride_cos + cols[None, :], mask=tile_mask, other=0.0)
        c2 = tl.load(cos_ptr + pos[:, None] * stride_cos + HALF + cols[None, :], mask=tile_mask, other=0.0)
        s1 = tl.load(sin_ptr + pos[:, None] * stride_sin + cols[None, :], mask=tile_mask, other=0.0)
        s2 = tl.load(sin_ptr + pos[:, None] * stride_sin + HALF + cols[None, :], mask=tile_mask, other=0.0)
        c1 = c1.to(dtype).to(tl.float32)
        c2 = c2.to(dtype).to(tl.float32)
        s1 = s1.to(dtype).to(tl.float32)
        s2 = s2.to(dtype).to(tl.float32)
        y1, y2 = y1 * c1 - y2 * s1, y2 * c2 + y1 * s2
    if head < num_q_heads:
        q_dst = q_ptr + (rows64[:, None] * num_q_heads + head) * (2 * HALF) + cols[None, :]
        tl.store(q_dst, y1.to(dtype), mask=tile_mask)
        tl.store(q_dst + HALF, y2.to(dtype), mask=tile_mask)
    else:
        slot = tl.load(slot_ptr + rows, mask=row_mask, other=-1)
        store_mask = tile_mask & (slot >= 0)[:, None]
        kv_head = (head - num_q_heads) % num_kv_heads
        off = ((slot // block_size)[:, None] * stride_cb + (slot % block_size)[:, None] * stride_cs
               + kv_head * stride_ch + cols[None, :] * stride_cd)
        if head < num_q_heads + num_kv_heads:
            tl.store(k_cache_ptr + off, y1.to(dtype), mask=store_mask)
            tl.store(k_cache_ptr + off + HALF * stride_cd, y2.to(dtype), mask=store_mask)
        else:
            tl.store(v_cache_ptr + off, y1.to(dtype), mask=store_mask)
            tl.store(v_cache_ptr + off + HALF * stride_cd, y2.to(dtype), mask=store_mask)


def default_launch(num_tokens: int) -> dict:
    """``block_m``, ``block_h``, ``block_k``, ``num_warps`` and ``num_stages`` for ``num_tokens`` rows."""
    return {"block_m": 16 if num_tokens <= 16 else 32 if num_tokens <= 64 else 64, "block_h": 16,
            "block_k": 128, "num_warps": 4, "num_stages": 3}


def norm_qkv_rope(hidden: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                  qkv_weight: torch.Tensor, qkv_bias: torch.Tensor | None, positions: torch.Tensor,
                  cos: torch.Tensor, sin: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
                  num_q_heads: int, num_kv_heads: int,
                  launch: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``RMSNorm(hidden (+ residual))`` projected to Q/K/V, Q and K rotated (rotate-half layout), K and V
    written to their paged-cache slots: what ``input_layernorm``, ``qkv_proj``, ``rotary`` (with its cache
    write) compute one after the other, in one kernel.

    Args:
        hidden: ``[T, H]`` fp16/bf16, unit column stride.
        residual: ``[T, H]`` same dtype, or None (the first layer: ``hidden`` is the residual stream).
        norm_weight: ``[H]``; eps: added to the mean square.
        qkv_weight: ``[(Hq + 2 Hk) * D, H]``, the dtype of ``hidden``, unit column stride; qkv_bias: its
            ``[(Hq + 2 Hk) * D]`` bias or None.
        positions: ``[T]`` int64, each below the tables' length.
        cos, sin: ``[max_position, D]`` float32 (``RotaryEmbedding.cos`` / ``.sin``), unit column stride.
        kv_cache: ``[2, num_blocks, block_size, Hk, D]``, the dtype of ``hidden``.
        slot_mapping: ``[T]`` int64 flat slots; a negative slot stores nothing (padding rows).
        num_q_heads, num_kv_heads: ``Hq`` and ``Hk`` (this rank's).
        launch: ``block_m``, ``block_h`` (columns of each half per program), ``block_k``, ``num_warps``,
            ``num_stages`` overrides (a benchmark knob).
    Returns:
        ``(q [T, Hq, D] contiguous, new_residual [T, H])``; ``new_residual`` is ``hidden + residual`` (a new
        contiguous tensor), or ``hidden`` itself when ``residual`` is None.
    Raises:
        ValueError: on mismatched shapes or dtypes, or ``D`` not a power of two of at least 32.
    """
    num_tokens, hidden_size = hidden.shape
    head_dim = kv_cache.shape[-1]
    width = (num_q_heads + 2 * num_kv_heads) * head_dim
    if hidden.dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"hidden must be float16 or bfloat16, got {hidden.dtype}")
    if head_dim < 32 or head_dim & (head_dim - 1):
        raise ValueError(f"head_dim {head_dim} must be a power of two >= 32")
    if qkv_weight.shape != (width, hidden_size) or qkv_weight.dtype != hidden.dtype or kv_cache.dtype != hidden.dtype:
        raise ValueError(f"qkv_weight {tuple(qkv_weight.shape)} {qkv_weight.dtype} / kv_cache {kv_cache.dtype} do "
                         f"not fit hidden {tuple(hidden.shape)} {hidden.dtype} with {num_q_heads}+2x{num_kv_heads} "
                         f"heads of {head_dim}")
    if kv_cache.shape[3] != num_kv_heads or norm_weight.shape != (hidden_size,):
        raise ValueError(f"kv_cache {tuple(kv_cache.shape)} or norm weight {tuple(norm_weight.shape)} does not fit")
    if residual is not None and (residual.shape != hidden.shape or residual.dtype != hidden.dtype):
        raise ValueError(f"residual {tuple(residual.shape)} {residual.dtype} differs from hidden")
    if positions.shape != (num_tokens,) or slot_mapping.shape != (num_tokens,) or slot_mapping.dtype != torch.int64:
        raise ValueError("positions and slot_mapping must be [T], slot_mapping int64")
    if hidden.stride(1) != 1 or qkv_weight.stride(1) != 1 or cos.stride(1) != 1 or sin.stride(1) != 1:
        raise ValueError("hidden, qkv_weight and the cos/sin tables need a unit column stride")
    q = torch.empty(num_tokens, num_q_heads, head_dim, dtype=hidden.dtype, device=hidden.device)
    new_residual = torch.empty_like(hidden, memory_format=torch.contiguous_format) if residual is not None else hidden
    if num_tokens == 0:
        return q, new_residual
    launch = {**default_launch(num_tokens), **(launch or {})}
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    block_m, block_h = launch["block_m"], min(launch["block_h"], head_dim // 2)
    _norm_qkv_rope_kernel[(triton.cdiv(num_tokens, block_m), num_q_heads + 2 * num_kv_heads, head_dim // 2 // block_h)](
        hidden, residual if residual is not None else hidden, new_residual, norm_weight, qkv_weight,
        qkv_bias if qkv_bias is not None else norm_weight, positions, cos, sin, q, k_cache, v_cache, slot_mapping,
        num_tokens, hidden_size, eps,
        hidden.stride(0), residual.stride(0) if residual is not None else 0, qkv_weight.stride(0),
        cos.stride(0), sin.stride(0), *k_cache.stride(), num_q_heads, num_kv_heads, kv_cache.shape[2],
        HALF=head_dim // 2, BLOCK_H=block_h, BLOCK_M=block_m, BLOCK_K=launch["block_k"],
        HAS_RESIDUAL=residual is not None, HAS_BIAS=qkv_bias is not None,
        num_warps=launch["num_warps"], num_stages=launch["num_stages"],
    )
    return q, new_residual
