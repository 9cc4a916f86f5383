"""The PyTorch paged attention (the CPU path) against attention written out row by row."""
from __future__ import annotations

import threading

import pytest
import torch

from inference.attention.kv_quant import FP8_DTYPE
from inference.attention.metadata import AttentionMetadata
from inference.attention.torch_decode import DECODE_GROUP_ROWS, decode

BLOCK = 16


def naive_decode(q, keys, values, lens, scale):
    """``q [B, Hq, D]``; ``keys/values`` lists of ``[len, Hk, D]`` -> ``[B, Hq, D]``."""
    out = []
    for i, n in enumerate(lens):
        group = q.shape[1] // keys[i].shape[1]
        k = keys[i][:n].repeat_interleave(group, dim=1)  # [n, Hq, D]
        v = values[i][:n].repeat_interleave(group, dim=1)
        p = torch.softmax(torch.einsum("hd,nhd->hn", q[i], k) * scale, dim=-1)
        out.append(torch.einsum("hn,nhd->hd", p, v))
    return torch.stack(out)


def decode_case(lens, hq=6, hk=2, d=32, kv_dtype=torch.float32, seed=0):
    """A cache of shuffled blocks, each request's tokens in its own blocks; returns the reference output too."""
    g = torch.Generator().manual_seed(seed)
    nb = [-(-n // BLOCK) for n in lens]
    num_blocks = sum(nb) + 3
    perm = torch.randperm(num_blocks, generator=g)
    cache = torch.randn(2, num_blocks, BLOCK, hk, d, generator=g)
    if kv_dtype != torch.float32:
        cache = cache.to(kv_dtype)
    tables = torch.zeros(len(lens), max(nb), dtype=torch.long)
    used = 0
    for i, n in enumerate(nb):
        tables[i, :n] = perm[used:used + n]
        used += n
    q = torch.randn(len(lens), hq, d, generator=g)
    as_float = cache.float()
    keys = [as_float[0, tables[i, :nb[i]]].flatten(0, 1) for i in range(len(lens))]
    values = [as_float[1, tables[i, :nb[i]]].flatten(0, 1) for i in range(len(lens))]
    meta = AttentionMetadata(slot_mapping=torch.empty(0, dtype=torch.long),
                             decode_indices=torch.arange(len(lens)), decode_block_tables=tables,
                             decode_seq_lens=torch.tensor(lens), prefills=[], block_size=BLOCK)
    return q, cache, meta, naive_decode(q, keys, values, lens, d ** -0.5)


@pytest.mark.parametrize("lens", [[37], [1, 200, 17, 64, 5, 129, 33, 16, 90, 91, 2], [48] * 9,
                                  list(range(1, 4 * DECODE_GROUP_ROWS + 2))])
def test_decode_equals_row_by_row_attention(lens):
    """Rows of many lengths, out of order, more than one group: each row sees exactly its own tokens."""
    q, cache, meta, expected = decode_case(lens)
    torch.testing.assert_close(decode(q, cache, meta, q.shape[-1] ** -0.5), expected, rtol=1e-5, atol=1e-5)


def test_decode_in_bfloat16_masks_in_the_query_dtype():
    """A bfloat16 model on the CPU: the padded rows of a group are masked with an additive mask of the queries'
    dtype (SDPA rejects a float mask of another dtype), and each row still sees exactly its own tokens."""
    lens = [3, 70, 41, 41, 12, 100, 7]
    q, cache, meta, _ = decode_case(lens, kv_dtype=torch.bfloat16)
    q = q.to(torch.bfloat16)
    as_float = cache.float()
    keys = [as_float[0, meta.decode_block_tables[i]].flatten(0, 1) for i in range(len(lens))]
    values = [as_float[1, meta.decode_block_tables[i]].flatten(0, 1) for i in range(len(lens))]
    expected = naive_decode(q.float(), keys, values, lens, q.shape[-1] ** -0.5)
    out = decode(q, cache, meta, q.shape[-1] ** -0.5)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), expected, rtol=2e-2, atol=2e-2)


def test_decode_fp8_cache_reads_the_stored_values():
    lens = [3, 70, 41, 41, 12, 100]
    q, cache, meta, expected = decode_case(lens, kv_dtype=FP8_DTYPE)
    torch.testing.assert_close(decode(q, cache, meta, q.shape[-1] ** -0.5), expected, rtol=1e-5, atol=1e-5)


def test_a_smaller_step_after_a_larger_one_reads_only_its_own_blocks():
    """The gather buffer is kept between calls: a later, smaller batch must not see the earlier one's rows."""
    big_q, big_cache, big_meta, _ = decode_case([300] * 8, seed=1)
    decode(big_q, big_cache, big_meta, big_q.shape[-1] ** -0.5)
    q, cache, meta, expected = decode_case([5, 40, 9], seed=2)
    torch.testing.assert_close(decode(q, cache, meta, q.shape[-1] ** -0.5), expected, rtol=1e-5, atol=1e-5)


def test_decode_outside_inference_mode_after_a_call_inside_it():
    """The engine attends under ``torch.inference_mode``; a later call outside it in the same thread (a user's own
    forward, a test) must not write into the buffer kept from then. A fresh thread starts with no buffer."""
    q, cache, meta, expected = decode_case([30, 70, 5, 64, 9], seed=3)
    results = []

    def run() -> None:
        with torch.inference_mode():
            decode(q, cache, meta, q.shape[-1] ** -0.5)
        meta.decode_plan = None
        results.append(decode(q, cache, meta, q.shape[-1] ** -0.5))

    worker = threading.Thread(target=run)
    worker.start()
    worker.join()
    assert results, "the call outside inference mode raised (see the thread's traceback)"
    torch.testing.assert_close(results[0], expected, rtol=1e-5, atol=1e-5)
