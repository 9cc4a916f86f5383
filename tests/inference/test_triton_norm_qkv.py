"""The fused RMSNorm + Q/K/V projection + rotary + KV-store kernel against the unfused layers.

Without a CUDA device the kernel runs in Triton's interpreter on small shapes; with one, compiled,
on the same shapes plus Qwen2.5-0.5B's and Qwen2.5-7B's.
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from .triton_interpreter import HAS_CUDA

triton = pytest.importorskip("triton")

from inference.attention.torch_ref import store_kv  # noqa: E402
from inference.models.layers import RMSNorm, RotaryEmbedding  # noqa: E402
from inference.models.triton_norm_qkv import norm_qkv_rope  # noqa: E402

DEVICE = "cuda" if HAS_CUDA else "cpu"
BLOCK = 16
gpu_only = pytest.mark.skipif(not HAS_CUDA, reason="GPU-sized shape, too slow for the interpreter")
# (tokens, hidden, Hq, Hk, D, bias)
SHAPES = [(5, 96, 4, 2, 32, True), (19, 160, 3, 1, 64, False),
          pytest.param((256, 896, 14, 2, 64, True), marks=gpu_only),
          pytest.param((48, 3584, 28, 4, 128, True), marks=gpu_only)]


def _reference(hidden, residual, norm, weight, bias, positions, rotary, kv_cache, slots, hq, hk, d):
    """What the unfused layers compute: RMSNorm (with the residual add), F.linear, rotary, store."""
    if residual is None:
        normed, new_residual = norm(hidden), hidden
    else:
        normed, new_residual = norm(hidden, residual)
    qkv = torch.nn.functional.linear(normed, weight, bias)
    q, k, v = qkv.split([hq * d, hk * d, hk * d], dim=-1)
    q, k = rotary(positions, q.reshape(-1, hq, d), k.reshape(-1, hk, d))
    keep = slots >= 0
    store_kv(k[keep], v.reshape(-1, hk, d)[keep], kv_cache, slots[keep])
    return q, new_residual


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("with_residual", [True, False], ids=["residual", "first_layer"])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("block_h", [16, 32], ids=["block_h16", "block_h32"])
def test_fused_norm_qkv_rope_matches_the_unfused_layers(dtype, with_residual, shape, block_h):
    torch.manual_seed(0)
    tokens, hidden_size, hq, hk, d, with_bias = shape
    norm = RMSNorm(hidden_size, 1e-6).to(DEVICE)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.1 * torch.randn(hidden_size))
    norm = norm.to(dtype)
    rotary = RotaryEmbedding(SimpleNamespace(rope_theta=1e4), d, 4096).to(DEVICE)
    rotary.reset_buffers()
    width = (hq + 2 * hk) * d
    weight = (torch.randn(width, hidden_size, device=DEVICE) / hidden_size ** 0.5).to(dtype)
    bias = (0.1 * torch.randn(width, device=DEVICE)).to(dtype) if with_bias else None
    hidden = torch.randn(tokens, hidden_size, device=DEVICE).to(dtype)
    residual = torch.randn(tokens, hidden_size, device=DEVICE).to(dtype) if with_residual else None
    positions = torch.randint(0, 4096, (tokens,), device=DEVICE)
    num_blocks = tokens // BLOCK + 4
    slots = torch.randperm(num_blocks * BLOCK, device=DEVICE)[:tokens]
    slots[tokens // 2] = -1  # a padding row: nothing stored
    ref_cache = torch.zeros(2, num_blocks, BLOCK, hk, d, dtype=dtype, device=DEVICE)
    cache = torch.zeros_like(ref_cache)

    ref_q, ref_residual = _reference(hidden, residual, norm, weight, bias, positions, rotary, ref_cache, slots,
                                     hq, hk, d)
    q, new_residual = norm_qkv_rope(hidden, residual, norm.weight, norm.eps, weight, bias, positions, rotary.cos,
                                    rotary.sin, cache, slots, hq, hk, {"block_h": block_h})

    assert q.shape == (tokens, hq, d) and q.dtype == dtype
    torch.testing.assert_close(new_residual, ref_residual, atol=0, rtol=0)
    if residual is None:
        assert new_residual is hidden
    # One rounding less than the unfused layers (x * rstd is not rounded before the weight): a few ulps.
    tol = dict(atol=3e-2, rtol=3e-2) if dtype == torch.bfloat16 else dict(atol=4e-3, rtol=4e-3)
    torch.testing.assert_close(q, ref_q, **tol)
    torch.testing.assert_close(cache, ref_cache, **tol)
    # the whole cache against the reference's: the padding row (slot -1) wrote nothing anywhere
    assert ref_cache.abs().sum() > 0


def test_rejects_mismatched_shapes():
    hidden = torch.zeros(4, 64, dtype=torch.bfloat16, device=DEVICE)
    cache = torch.zeros(2, 2, BLOCK, 1, 32, dtype=torch.bfloat16, device=DEVICE)
    weight = torch.zeros(3 * 32, 64, dtype=torch.bfloat16, device=DEVICE)  # 1 + 2 heads, not 2 + 2
    with pytest.raises(ValueError, match="qkv_weight"):
        norm_qkv_rope(hidden, None, torch.ones(64, dtype=torch.bfloat16, device=DEVICE), 1e-6, weight, None,
                      torch.zeros(4, dtype=torch.int64, device=DEVICE), torch.zeros(8, 32, device=DEVICE),
                      torch.zeros(8, 32, device=DEVICE), cache, torch.zeros(4, dtype=torch.int64, device=DEVICE),
                      2, 1)


@pytest.mark.parametrize("half,block_h,block_m,has_residual,has_bias",
                         [(32, 16, 16, True, True), (64, 32, 64, False, False)])
def test_kernel_compiles_for_hopper(half, block_h, block_m, has_residual, has_bias):
    """The interpreter above runs the kernel's Python only; this runs Triton's compiler down to an sm_90
    cubin, which rejects what the interpreter lets through (it caught a branch-typed variable here)."""
    from .triton_compile import compile_for_hopper
    pointers = {name: "*bf16" for name in ("x_ptr", "residual_ptr", "new_residual_ptr", "norm_w_ptr", "w_ptr",
                                           "bias_ptr", "q_ptr", "k_cache_ptr", "v_cache_ptr")}
    pointers.update(positions_ptr="*i64", slot_ptr="*i64", cos_ptr="*fp32", sin_ptr="*fp32")
    compile_for_hopper("inference.models.triton_norm_qkv:_norm_qkv_rope_kernel", pointers,
                       dict(HALF=half, BLOCK_H=block_h, BLOCK_M=block_m, BLOCK_K=128, HAS_RESIDUAL=has_residual,
                            HAS_BIAS=has_bias),
                       float_args=("eps",))
