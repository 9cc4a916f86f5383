"""The Triton kernels with an FP8 KV cache (float8 e4m3, per-layer scales) against the PyTorch path:
the store and the rotary-and-store kernels write the same bytes as ``torch_ref.store_kv``; the decode
and prefill attention kernels read them back as the reference does. Small shapes under Triton's
interpreter without a GPU (see ``test_triton_kernels``)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from .triton_interpreter import HAS_CUDA  # noqa: E402  (sets TRITON_INTERPRET=1 without a GPU)

triton = pytest.importorskip("triton")

from inference.attention.kv_quant import FP8_DTYPE  # noqa: E402
from inference.attention.triton_ops import (  # noqa: E402
    paged_decode_attention, paged_decode_attention_ref, paged_prefill_attention, paged_prefill_attention_ref,
    store_kv_cache, store_kv_cache_ref)
from inference.models import triton_layers  # noqa: E402
from inference.models.layers import RotaryEmbedding  # noqa: E402

DEVICE = "cuda" if HAS_CUDA else "cpu"
SCALES = dict(k_scale=0.5, v_scale=2.0)
TOL = {torch.float32: dict(atol=1e-4, rtol=1e-3), torch.bfloat16: dict(atol=3e-2, rtol=3e-2)}


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def _fp8_cache(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int) -> torch.Tensor:
    return (torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, device=DEVICE) * 4).to(FP8_DTYPE)


def _bytes(cache: torch.Tensor) -> torch.Tensor:
    return cache.view(torch.uint8)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_store_kernel_writes_the_reference_bytes(dtype):
    k = torch.randn(9, 2, 64, dtype=dtype, device=DEVICE) * 300  # some beyond 448 * k_scale: saturated
    v = torch.randn(9, 2, 64, dtype=dtype, device=DEVICE)
    slots = torch.tensor([3, 17, -1, 40, 5, 63, 0, 22, -1], device=DEVICE)
    got, expected = _fp8_cache(4, 16, 2, 64), torch.zeros(2, 4, 16, 2, 64, device=DEVICE).to(FP8_DTYPE)
    expected.copy_(got)
    store_kv_cache(k, v, got, slots, **SCALES)
    store_kv_cache_ref(k, v, expected, slots, **SCALES)
    assert torch.equal(_bytes(got), _bytes(expected))
    assert not torch.isnan(got.float()).any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_kernel_reads_the_fp8_cache_as_the_reference(dtype, num_splits):
    seq_lens = torch.tensor([1, 17, 40, 0], dtype=torch.int32, device=DEVICE)
    cache = _fp8_cache(12, 16, 2, 64)
    table = torch.randperm(12, device=DEVICE)[:12].view(4, 3).to(torch.int32)
    q = torch.randn(4, 6, 64, dtype=dtype, device=DEVICE)
    out = paged_decode_attention(q, cache, table, seq_lens, 0.125, num_splits=num_splits, **SCALES)
    expected = paged_decode_attention_ref(q, cache, table, seq_lens, 0.125, **SCALES)
    torch.testing.assert_close(out, expected, **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_prefill_kernel_reads_the_context_and_rounds_the_new_tokens_as_stored(dtype):
    batch = [(0, 20), (35, 12), (16, 1)]  # (context, new tokens)
    block_size, hk, hq, d = 16, 2, 4, 64
    table = torch.arange(12, device=DEVICE, dtype=torch.int32).view(3, 4)
    cache = _fp8_cache(12, block_size, hk, d)
    num_tokens = sum(n for _, n in batch)
    q = torch.randn(num_tokens, hq, d, dtype=dtype, device=DEVICE)
    k = torch.randn(num_tokens, hk, d, dtype=dtype, device=DEVICE) * 3
    v = torch.randn(num_tokens, hk, d, dtype=dtype, device=DEVICE)
    slots = torch.cat([(table[i].long()[torch.arange(c, c + n, device=DEVICE) // block_size] * block_size
                        + torch.arange(c, c + n, device=DEVICE) % block_size) for i, (c, n) in enumerate(batch)])
    cu = torch.tensor([0, 20, 32, 33], dtype=torch.int32, device=DEVICE)
    contexts = torch.tensor([c for c, _ in batch], dtype=torch.int32, device=DEVICE)
    store_kv_cache(k, v, cache, slots, **SCALES)
    out = paged_prefill_attention(q, k, v, cache, cu, contexts, table, 20, d ** -0.5, **SCALES)
    expected = paged_prefill_attention_ref(q, k, v, cache, cu, contexts, table, 20, d ** -0.5, **SCALES)
    torch.testing.assert_close(out, expected, **TOL[dtype])


def test_rotary_kernel_stores_the_reference_bytes():
    rotary = RotaryEmbedding(SimpleNamespace(rope_theta=10000.0), 64, max_position=512).to(DEVICE)
    rotary.reset_buffers()
    positions = torch.tensor([0, 5, 9, 300], device=DEVICE)
    q, k, v = (torch.randn(4, h, 64, device=DEVICE) * 50 for h in (4, 2, 2))
    slots = torch.tensor([1, 2, -1, 30], device=DEVICE)
    got, expected = _fp8_cache(2, 16, 2, 64), torch.zeros(2, 2, 16, 2, 64, device=DEVICE).to(FP8_DTYPE)
    expected.copy_(got)
    q2, k2 = triton_layers.rotary_embedding(positions, q.clone(), k.clone(), rotary.cos, rotary.sin,
                                            (v, got, slots, 0.5, 2.0))
    store_kv_cache_ref(k2, v, expected, slots, **SCALES)
    assert torch.equal(_bytes(got), _bytes(expected))
