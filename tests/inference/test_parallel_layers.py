"""The tensor-parallel layers' parts add up to the whole layer, for every rank of a split: uneven
MLP splits (SmolLM2's 1536 intermediate rows over 9 ranks), replicated KV heads, a padded
vocabulary. The ranks' sums are done here by hand, in one process (the end-to-end runs over
real process groups are in test_tensor_parallel.py)."""
from __future__ import annotations

import pytest
import torch

from inference.distributed.partition import head_partition, split_range
from inference.distributed.process_group import TensorParallelGroup
from inference.models.layers import silu_and_mul
from inference.models.parallel_layers import (CPU_LM_HEAD_BLOCK_ROWS, CPU_WEIGHT_LEFT_MAX_ROWS,
                                              MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear,
                                              VocabParallelEmbedding, linear, parallel_logits)


class PartialSums(TensorParallelGroup):
    """One rank of a split whose collectives are left to the test: all-reduce returns this rank's
    part, the logits gather returns this rank's columns."""

    def all_reduce(self, x):
        return x

    def gather_last_dim(self, x):
        return x


def test_uneven_mlp_split_adds_up_to_the_full_mlp():
    torch.manual_seed(0)
    hidden, inter, tp = 12, 20, 3  # 20 rows over 3 ranks: 6, 7, 7
    gate, up, down = torch.randn(inter, hidden), torch.randn(inter, hidden), torch.randn(hidden, inter)
    x = torch.randn(5, hidden)
    expected = (torch.nn.functional.silu(x @ gate.t()) * (x @ up.t())) @ down.t()
    total, sizes = torch.zeros_like(expected), []
    for rank in range(tp):
        group = PartialSums(rank, tp)
        gate_up = MergedColumnParallelLinear(hidden, {"gate_proj": inter, "up_proj": inter}, False, group)
        gate_up.load_shard("gate_proj", "weight", gate)
        gate_up.load_shard("up_proj", "weight", up)
        down_proj = RowParallelLinear(inter, hidden, False, group, in_range=gate_up.shard_ranges["gate_proj"])
        down_proj.load_weight("weight", down)
        sizes.append(gate_up.local_sizes[0])
        total += down_proj(silu_and_mul(gate_up(x)))
    assert sizes == [6, 7, 7] and split_range(1536, 9, 8) == (1365, 1536)
    torch.testing.assert_close(total, expected)


def test_qkv_split_replicates_kv_heads_when_there_are_fewer_than_ranks():
    torch.manual_seed(0)
    hidden, head_dim, heads, kv_heads, tp = 8, 2, 9, 3, 9  # SmolLM2's heads over 9 ranks
    q, k, v = (torch.randn(n * head_dim, hidden) for n in (heads, kv_heads, kv_heads))
    bias = torch.randn(heads * head_dim)
    x = torch.randn(4, hidden)
    for rank in range(tp):
        layer = QKVParallelLinear(hidden, head_dim, heads, kv_heads, True, PartialSums(rank, tp))
        for name, weight in (("q_proj", q), ("k_proj", k), ("v_proj", v)):
            layer.load_shard(name, "weight", weight)
            layer.load_shard(name, "bias", bias[:weight.shape[0]])
        part = head_partition(heads, kv_heads, tp, rank)
        assert (part.num_heads, part.num_kv_heads, part.kv_start) == (1, 1, rank // 3)
        got_q, got_k, got_v = layer(x).split([head_dim, head_dim, head_dim], dim=-1)
        rows_q = slice(rank * head_dim, (rank + 1) * head_dim)
        rows_kv = slice(rank // 3 * head_dim, (rank // 3 + 1) * head_dim)
        torch.testing.assert_close(got_q, x @ q[rows_q].t() + bias[rows_q])
        torch.testing.assert_close(got_k, x @ k[rows_kv].t() + bias[rows_kv])
        torch.testing.assert_close(got_v, x @ v[rows_kv].t() + bias[rows_kv])


def test_vocab_split_with_padding_gives_the_full_embedding_and_logits():
    torch.manual_seed(0)
    vocab, hidden, tp = 10, 4, 3  # 4 rows per rank, the last rank holds 2 and 2 of padding
    table = torch.randn(vocab, hidden)
    ids = torch.tensor([0, 3, 4, 9, 7])
    hidden_states = torch.randn(2, hidden)
    embedded, logits = torch.zeros(len(ids), hidden), []
    for rank in range(tp):
        layer = VocabParallelEmbedding(vocab, hidden, PartialSums(rank, tp))
        layer.load_weight("weight", table)
        embedded += layer(ids)
        logits.append(torch.matmul(hidden_states, layer.weight.t()))
    torch.testing.assert_close(embedded, table[ids])
    gathered = torch.cat(logits, dim=-1)
    assert gathered.shape == (2, 12)
    single = parallel_logits(hidden_states, table, vocab, TensorParallelGroup())
    torch.testing.assert_close(gathered[:, :vocab], single)
    assert torch.all(gathered[:, vocab:] == 0)


@pytest.mark.parametrize("rows", [1, 2, 7, CPU_WEIGHT_LEFT_MAX_ROWS, CPU_WEIGHT_LEFT_MAX_ROWS + 1])
@pytest.mark.parametrize("with_bias", [False, True])
def test_cpu_linear_gives_f_linear_at_every_row_count(rows, with_bias):
    # 2-128 rows run as W @ x^T on a CPU, the others as F.linear: the same [rows, out] result either way, also for
    # an x that is a strided slice of a wider activation (a fused projection's part)
    torch.manual_seed(0)
    wide, weight = torch.randn(rows, 200), torch.randn(40, 96)
    bias = torch.randn(40) if with_bias else None
    for x in (wide[:, :96].contiguous(), wide[:, 50:146]):
        out = linear(x, weight, bias)
        assert out.shape == (rows, 40) and out.is_contiguous()
        torch.testing.assert_close(out, torch.nn.functional.linear(x, weight, bias), rtol=1e-5, atol=1e-5)
    layer = RowParallelLinear(96, 40, bias=with_bias)
    torch.testing.assert_close(layer(x), torch.nn.functional.linear(x, layer.weight, layer.bias), rtol=1e-5,
                               atol=1e-5)


@pytest.mark.parametrize("rows", [2, 7, 64, CPU_WEIGHT_LEFT_MAX_ROWS])
def test_cpu_lm_head_in_vocabulary_blocks_gives_the_same_logits_bit_for_bit(rows):
    # the CPU's LM head multiplies its vocabulary in blocks (the last one short): every logit is the same sum as in
    # one W @ x^T product, so greedy tokens cannot change
    torch.manual_seed(0)
    vocab = 2 * CPU_LM_HEAD_BLOCK_ROWS + 37
    table, hidden_states = torch.randn(vocab + 3, 64), torch.randn(rows, 64)
    logits = parallel_logits(hidden_states, table, vocab, TensorParallelGroup())
    assert logits.shape == (rows, vocab)
    assert torch.equal(logits, torch.mm(table, hidden_states.t()).t()[:, :vocab])
