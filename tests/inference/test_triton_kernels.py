"""Triton kernels against their pure-PyTorch references.

Without a CUDA device the kernels run in Triton's interpreter (``TRITON_INTERPRET=1``, set here
before Triton is imported) on small CPU shapes; with one they run compiled on the GPU, on the
same shapes plus GPU-sized ones. Skipped when Triton is not installed.
"""
from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch

from .triton_interpreter import HAS_CUDA  # noqa: E402  (sets TRITON_INTERPRET=1 without a GPU)

triton = pytest.importorskip("triton")

from inference.attention.triton_ops import (  # noqa: E402
    paged_decode_attention, paged_decode_attention_ref, paged_prefill_attention, paged_prefill_attention_ref,
    store_kv_cache, store_kv_cache_ref)
from inference.models import triton_layers  # noqa: E402
from inference.models.layers import RMSNorm, RotaryEmbedding, silu_and_mul  # noqa: E402

DEVICE = "cuda" if HAS_CUDA else "cpu"
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# Attention tolerances: probabilities are rounded to the model dtype before P @ V (as FlashAttention does).
ATTN_TOL = {torch.float32: dict(atol=2e-5, rtol=1e-4), torch.float16: dict(atol=3e-3, rtol=3e-3),
            torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}
gpu_only = pytest.mark.skipif(not HAS_CUDA, reason="GPU-sized shape, too slow for the interpreter")




@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def _paged_cache(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, dtype) -> torch.Tensor:
    return torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype, device=DEVICE)


def _block_tables(lengths: list[int], block_size: int, num_blocks: int) -> torch.Tensor:
    """Disjoint, shuffled block ids per request; padding entries point at block 0 (valid, never used)."""
    needed = [triton.cdiv(n, block_size) for n in lengths]
    ids = torch.randperm(num_blocks)[:sum(needed)].tolist()
    table = torch.zeros(len(lengths), max(max(needed), 1), dtype=torch.int32)
    start = 0
    for i, n in enumerate(needed):
        table[i, :n] = torch.tensor(ids[start:start + n], dtype=torch.int32)
        start += n
    return table.to(DEVICE)


def _slots(table: torch.Tensor, start: int, end: int, block_size: int) -> torch.Tensor:
    """Flat cache slots of a request's token positions ``[start, end)``."""
    pos = torch.arange(start, end, device=DEVICE)
    return table[pos // block_size].long() * block_size + pos % block_size


# --- KV-cache store -----------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("num_kv_heads,head_dim,block_size", [(2, 64, 16), (4, 128, 32), (3, 80, 16)])
def test_store_kv_cache_matches_reference_and_skips_padding(dtype, num_kv_heads, head_dim, block_size):
    num_tokens, num_blocks = 23, 8
    # k, v as views of a fused QKV projection output (non-contiguous rows), as the model produces them.
    qkv = torch.randn(num_tokens, 3 * num_kv_heads * head_dim, dtype=dtype, device=DEVICE)
    k = qkv[:, num_kv_heads * head_dim:2 * num_kv_heads * head_dim].view(num_tokens, num_kv_heads, head_dim)
    v = qkv[:, 2 * num_kv_heads * head_dim:].view(num_tokens, num_kv_heads, head_dim)
    slots = torch.randperm(num_blocks * block_size, device=DEVICE)[:num_tokens]
    slots[[3, 11]] = -1  # CUDA-graph padding rows
    cache = _paged_cache(num_blocks, block_size, num_kv_heads, head_dim, dtype)
    before, expected = cache.clone(), cache.clone()
    store_kv_cache(k, v, cache, slots)
    store_kv_cache_ref(k, v, expected, slots)
    assert torch.equal(cache, expected)
    written = (cache != before).flatten(3).any(-1).any(0).flatten().nonzero().flatten()
    assert sorted(written.tolist()) == sorted(slots[slots >= 0].tolist())  # exactly the non-padding slots


# --- Decode -------------------------------------------------------------------------------------

DECODE_CASES = [
    # Hq, Hk, D, block_size, seq_lens (0 = CUDA-graph padding row), num_splits (None = heuristic)
    (9, 3, 64, 16, [1, 17, 50, 0], None),
    (14, 2, 64, 32, [33, 95, 64], 1),
    (8, 8, 128, 16, [40, 0, 130], 3),
    (28, 4, 128, 16, [300, 7], None),
    (4, 2, 96, 32, [65, 3], 4),
    pytest.param(28, 4, 128, 16, torch.randint(1, 4096, (64,), generator=torch.Generator().manual_seed(1)).tolist(),
                 None, marks=gpu_only, id="qwen7b-64x4096"),
    pytest.param(32, 8, 128, 16, [2048] * 7 + [0], 1, marks=gpu_only, id="llama8b-unsplit"),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim,block_size,seq_lens,num_splits", DECODE_CASES)
def test_paged_decode_matches_reference(dtype, num_heads, num_kv_heads, head_dim, block_size, seq_lens, num_splits):
    table = _block_tables(seq_lens, block_size, num_blocks=sum(triton.cdiv(n, block_size) for n in seq_lens) + 3)
    cache = _paged_cache(int(table.max()) + 4, block_size, num_kv_heads, head_dim, dtype)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    q = torch.randn(len(seq_lens), num_heads, head_dim, dtype=dtype, device=DEVICE)
    scale = head_dim ** -0.5
    out = torch.full_like(q, float("nan"))
    result = paged_decode_attention(q, cache, table, lens, scale, out=out, num_splits=num_splits)
    assert result is out
    expected = paged_decode_attention_ref(q, cache, table, lens, scale)
    torch.testing.assert_close(out.float(), expected.float(), **ATTN_TOL[dtype])
    padded = lens == 0
    assert torch.equal(out[padded], torch.zeros_like(out[padded]))


def _decode_inputs(seq_lens: list[int], num_heads: int, num_kv_heads: int, block_size: int = 16):
    """float32 ``(q, cache, block_tables, seq_lens)`` for a decode batch, head size 64."""
    table = _block_tables(seq_lens, block_size, num_blocks=64)
    cache = _paged_cache(64, block_size, num_kv_heads, 64, torch.float32)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    return torch.randn(len(seq_lens), num_heads, 64, device=DEVICE), cache, table, lens


def test_paged_decode_splits_agree():
    """The split count changes only rounding: one slice and many slices give the same answer."""
    q, cache, table, lens = _decode_inputs([700, 129, 0, 1], 4, 2)
    one = paged_decode_attention(q, cache, table, lens, 0.125, num_splits=1)
    many = paged_decode_attention(q, cache, table, lens, 0.125, num_splits=5)
    torch.testing.assert_close(one, many, atol=1e-5, rtol=1e-5)
    assert not torch.isnan(many).any()


def test_paged_decode_merge_heads_per_program_agree():
    """The merge kernel's query heads per program (9 heads: partial groups masked; 3 rounds up to 4) change
    nothing, with each head's scores on its own scale (its slices' log-sum-exps far from the others')."""
    q, cache, table, lens = _decode_inputs([300, 40, 0, 129], 9, 3)
    q = q * torch.tensor([0.01, 1.0, 30.0] * 3, device=DEVICE)[None, :, None]
    outs = [paged_decode_attention(q, cache, table, lens, 0.125, num_splits=4, launch={"reduce_heads": h})
            for h in (1, 3, 16)]
    torch.testing.assert_close(outs[0], paged_decode_attention_ref(q, cache, table, lens, 0.125), atol=1e-5, rtol=1e-5)
    for other in outs[1:]:  # the same sums (on a GPU, maybe in another order)
        torch.testing.assert_close(other, outs[0], atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("num_heads,num_splits,block_d,expected", [
    (14, 4, 64, 16),    # W2: every head of a request in one program
    (14, 8, 64, 16),
    (14, 64, 64, 2),
    (28, 2, 128, 16),   # the 7B shapes: two programs a request, 4,096 elements each
    (28, 8, 128, 4),
    (64, 64, 256, 1),   # one head's splits exceed 4,096 elements alone
])
def test_merge_kernel_heads_per_program(num_heads, num_splits, block_d, expected):
    from inference.attention.triton_decode import reduce_heads
    assert reduce_heads(num_heads, num_splits, block_d) == expected


# --- Prefill (mixed with decode rows) -----------------------------------------------------------

PREFILL_CASES = [
    # Hq, Hk, D, block_size
    (9, 3, 64, 16),
    (14, 2, 64, 32),
    (28, 4, 128, 16),
    (8, 8, 128, 32),
]
# (context_len, query_len): fresh prompts, chunks after a prefix hit / earlier chunks (context lengths
# not multiples of the block size), a one-token prompt, and decode rows; 150 and 130 tokens give row
# tiles with whole unmasked key tiles below them, 130 after 64 whole unmasked context tiles too.
MIXED_BATCH = [(0, 37), (45, 20), (31, 1), (0, 1), (64, 1), (17, 33), (0, 150), (128, 130)]
GPU_BATCH = [(0, 1024), (512, 512), (1000, 300)] + [
    (n, 1) for n in torch.randint(1, 3000, (40,), generator=torch.Generator().manual_seed(2)).tolist()]


def _run_prefill(dtype, num_heads, num_kv_heads, head_dim, block_size, batch, store_new_tokens: bool):
    totals = [c + n for c, n in batch]
    table = _block_tables(totals, block_size, num_blocks=sum(triton.cdiv(t, block_size) for t in totals) + 2)
    cache = _paged_cache(int(table.max()) + 2, block_size, num_kv_heads, head_dim, dtype)
    num_tokens = sum(n for _, n in batch)
    width = (num_heads + 2 * num_kv_heads) * head_dim
    qkv = torch.randn(num_tokens, width, dtype=dtype, device=DEVICE)  # fused projection output
    q = qkv[:, :num_heads * head_dim].view(num_tokens, num_heads, head_dim)
    k = qkv[:, num_heads * head_dim:(num_heads + num_kv_heads) * head_dim].view(num_tokens, num_kv_heads, head_dim)
    v = qkv[:, (num_heads + num_kv_heads) * head_dim:].view(num_tokens, num_kv_heads, head_dim)
    slots = torch.cat([_slots(table[i], c, c + n, block_size) for i, (c, n) in enumerate(batch)])
    cu = torch.tensor([0] + torch.tensor([n for _, n in batch]).cumsum(0).tolist(), dtype=torch.int32, device=DEVICE)
    contexts = torch.tensor([c for c, _ in batch], dtype=torch.int32, device=DEVICE)
    max_query_len, scale = max(n for _, n in batch), head_dim ** -0.5
    if store_new_tokens:
        store_kv_cache(k, v, cache, slots)
    out = paged_prefill_attention(q, k, v, cache, cu, contexts, table, max_query_len, scale)
    if not store_new_tokens:
        store_kv_cache(k, v, cache, slots)  # the reference reads them from the cache
    expected = paged_prefill_attention_ref(q, k, v, cache, cu, contexts, table, max_query_len, scale)
    return out, expected


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim,block_size", PREFILL_CASES)
def test_paged_prefill_mixed_batch_matches_reference(dtype, num_heads, num_kv_heads, head_dim, block_size):
    out, expected = _run_prefill(dtype, num_heads, num_kv_heads, head_dim, block_size, MIXED_BATCH, True)
    torch.testing.assert_close(out.float(), expected.float(), **ATTN_TOL[dtype])


def test_paged_prefill_reads_new_tokens_from_k_v_not_the_cache():
    out, expected = _run_prefill(torch.float32, 6, 2, 64, 16, MIXED_BATCH, store_new_tokens=False)
    torch.testing.assert_close(out, expected, **ATTN_TOL[torch.float32])


@gpu_only
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("num_heads,num_kv_heads", [(28, 4), (32, 8)])
def test_paged_prefill_gpu_shapes(dtype, num_heads, num_kv_heads):
    out, expected = _run_prefill(dtype, num_heads, num_kv_heads, 128, 16, GPU_BATCH, True)
    torch.testing.assert_close(out.float(), expected.float(), **ATTN_TOL[dtype])


def test_decode_rows_agree_between_prefill_and_decode_kernels():
    """A decode row gives the same output whichever kernel serves it (mixed batch or decode batch)."""
    batch, block_size, num_heads, num_kv_heads, head_dim = [(30, 1), (16, 1), (47, 1)], 16, 8, 2, 64
    totals = [c + 1 for c, _ in batch]
    table = _block_tables(totals, block_size, num_blocks=16)
    cache = _paged_cache(16, block_size, num_kv_heads, head_dim, torch.float32)
    q = torch.randn(3, num_heads, head_dim, device=DEVICE)
    k, v = torch.randn(2, 3, num_kv_heads, head_dim, device=DEVICE)
    slots = torch.cat([_slots(table[i], c, c + 1, block_size) for i, (c, _) in enumerate(batch)])
    store_kv_cache(k, v, cache, slots)
    cu = torch.arange(4, dtype=torch.int32, device=DEVICE)
    contexts = torch.tensor([c for c, _ in batch], dtype=torch.int32, device=DEVICE)
    via_prefill = paged_prefill_attention(q, k, v, cache, cu, contexts, table, 1, 0.125)
    via_decode = paged_decode_attention(q, cache, table, contexts + 1, 0.125, num_splits=2)
    torch.testing.assert_close(via_prefill, via_decode, atol=1e-5, rtol=1e-5)


# --- Layers -------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(7, 64), (3, 5, 32), (4, 960), pytest.param((512, 3584), marks=gpu_only)],
                         ids=str)
def test_rms_norm_and_fused_add_match_rmsnorm_module(dtype, shape):
    norm = RMSNorm(shape[-1], eps=1e-6).to(device=DEVICE, dtype=dtype)
    with torch.no_grad():
        norm.weight.normal_(1.0, 0.2)
    x = torch.randn(shape, dtype=dtype, device=DEVICE) * 3
    residual = torch.randn(shape, dtype=dtype, device=DEVICE)
    with torch.no_grad():
        expected = norm(x)
        expected_normed, expected_residual = norm(x, residual)
    # rsqrt differs in its last bits between implementations: allow one ulp of fp16 (bf16's default covers it).
    tol = dict(atol=1e-3, rtol=2e-3) if dtype == torch.float16 else {}
    got = triton_layers.rms_norm(x, norm.weight, norm.eps)
    assert got.dtype == expected.dtype and got.shape == expected.shape
    torch.testing.assert_close(got, expected, **tol)
    normed, new_residual = triton_layers.fused_add_rms_norm(x, residual, norm.weight, norm.eps)
    assert torch.equal(new_residual, expected_residual)  # the add rounds exactly as PyTorch's
    torch.testing.assert_close(normed, expected_normed, **tol)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(9, 3, 64), (4, 2, 32), (28, 4, 128)])
def test_rotary_embedding_matches_module(dtype, num_heads, num_kv_heads, head_dim):
    config = SimpleNamespace(rope_theta=10000.0)
    rotary = RotaryEmbedding(config, head_dim, max_position=256).to(DEVICE)
    rotary.reset_buffers()
    num_tokens = 11
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, dtype=dtype, device=DEVICE)
    q = qkv[:, :num_heads * head_dim].view(num_tokens, num_heads, head_dim)
    k = qkv[:, num_heads * head_dim:(num_heads + num_kv_heads) * head_dim].view(num_tokens, num_kv_heads, head_dim)
    positions = torch.randint(0, 256, (num_tokens,), device=DEVICE)
    expected_q, expected_k = rotary(positions, q, k)
    v_before = qkv[:, (num_heads + num_kv_heads) * head_dim:].clone()
    got_q, got_k = triton_layers.rotary_embedding(positions, q, k, rotary.cos, rotary.sin)
    assert got_q.data_ptr() == q.data_ptr()  # in place
    # The kernel rounds once where the module rounds each product: allow about one ulp of |x|.
    tol = {torch.float32: {}, torch.float16: dict(atol=3e-3, rtol=1e-3),
           torch.bfloat16: dict(atol=2e-2, rtol=1.6e-2)}[dtype]
    torch.testing.assert_close(got_q, expected_q, **tol)
    torch.testing.assert_close(got_k, expected_k, **tol)
    assert torch.equal(qkv[:, (num_heads + num_kv_heads) * head_dim:], v_before)  # v untouched


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_rotary_kernel_writes_the_rotated_keys_and_values_to_the_cache(dtype):
    """With ``cache_write`` the rotary kernel also does the store kernel's job: the cache afterwards is what
    rotary then ``store_kv_cache`` leave, padding rows (slot -1) not stored, q and k rotated as before."""
    num_heads, num_kv_heads, head_dim, block_size, num_tokens = 14, 2, 64, 16, 9
    rotary = RotaryEmbedding(SimpleNamespace(rope_theta=10000.0), head_dim, max_position=256).to(DEVICE)
    rotary.reset_buffers()
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, dtype=dtype, device=DEVICE)
    q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    q, k, v = (t.view(num_tokens, -1, head_dim) for t in (q, k, v))
    positions = torch.randint(0, 256, (num_tokens,), device=DEVICE)
    slots = torch.randperm(6 * block_size, device=DEVICE)[:num_tokens]
    slots[[2, 7]] = -1
    q0, k0 = q.clone(), k.clone()
    expected_cache = torch.zeros(2, 6, block_size, num_kv_heads, head_dim, dtype=dtype, device=DEVICE)
    expected_q, expected_k = triton_layers.rotary_embedding(positions, q0, k0, rotary.cos, rotary.sin)
    store_kv_cache(expected_k, v, expected_cache, slots)
    cache = torch.zeros_like(expected_cache)
    got_q, got_k = triton_layers.rotary_embedding(positions, q, k, rotary.cos, rotary.sin, (v, cache, slots))
    assert torch.equal(got_q, expected_q) and torch.equal(got_k, expected_k)
    assert torch.equal(cache, expected_cache)
    with pytest.raises(ValueError, match="slot_mapping"):
        triton_layers.rotary_embedding(positions, q, k, rotary.cos, rotary.sin, (v, cache, slots.int()))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(5, 200), (3, 3000), pytest.param((1024, 2 * 18944), marks=gpu_only)], ids=str)
def test_silu_and_mul_matches_reference(dtype, shape):
    x = torch.randn(shape, dtype=dtype, device=DEVICE) * 4
    tol = dict(atol=1e-3, rtol=2e-3) if dtype == torch.float16 else {}  # fp16: one ulp apart at most
    torch.testing.assert_close(triton_layers.silu_and_mul(x), silu_and_mul(x), **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_mixed_step_sends_its_leading_decodes_to_the_decode_kernel(dtype):
    """A step that decodes and prefills: the backend splits it (leading decodes to the decode kernel,
    the rest, a later decode included, to the prefill kernel) and gives the reference's output."""
    import numpy as np

    from inference.attention.backend import paged_attention
    from inference.runner.input_batch import HostBatch, device_inputs
    batch = [(30, 1), (16, 1), (47, 1), (0, 37), (45, 20), (64, 1)]  # (context_len, query_len)
    block_size, num_heads, num_kv_heads, head_dim = 16, 8, 2, 64
    totals = [c + n for c, n in batch]
    table = _block_tables(totals, block_size, num_blocks=40)
    tables = [table[i, :triton.cdiv(t, block_size)].tolist() for i, t in enumerate(totals)]
    positions = np.concatenate([np.arange(c, c + n) for c, n in batch])
    slots = torch.cat([_slots(table[i], c, c + n, block_size) for i, (c, n) in enumerate(batch)]).cpu().numpy()
    starts = np.concatenate([[0], np.cumsum([n for _, n in batch])]).astype(np.int32)
    host = HostBatch(np.zeros(len(positions), dtype=np.int64), positions.astype(np.int64), slots.astype(np.int64),
                     starts, np.asarray([c for c, _ in batch], dtype=np.int32), tables,
                     starts[1:].astype(np.int64) - 1, {})
    cache = _paged_cache(40, block_size, num_kv_heads, head_dim, dtype)
    tokens = int(starts[-1])
    q = torch.randn(tokens, num_heads, head_dim, device=DEVICE).to(dtype)
    k, v = (torch.randn(2, tokens, num_kv_heads, head_dim, device=DEVICE)).to(dtype)
    split = device_inputs(host, block_size, DEVICE, backend="triton").meta
    assert split.num_leading_decodes == 3
    reference = device_inputs(host, block_size, DEVICE, backend="torch").meta
    reference.slot_mapping = split.slot_mapping
    got = paged_attention(q, k, v, cache.clone(), split, head_dim ** -0.5)
    expected = paged_attention(q, k, v, cache.clone(), reference, head_dim ** -0.5)
    torch.testing.assert_close(got.float(), expected.float(), **ATTN_TOL[dtype])
