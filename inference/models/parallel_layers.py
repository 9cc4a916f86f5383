"""Tensor-parallel layers (Megatron-LM's column/row split, Shoeybi et al., 2019).

* :class:`ColumnParallelLinear` holds a slice of the output rows; its output stays split.
* :class:`MergedColumnParallelLinear` fuses several HF projections (gate/up) into one matmul,
  each split the same way; :class:`QKVParallelLinear` fuses Q/K/V, split by heads.
* :class:`RowParallelLinear` holds a slice of the input columns and all-reduces its output:
  one all-reduce after attention (``o_proj``) and one after the MLP (``down_proj``).
* :class:`VocabParallelEmbedding` / :class:`ParallelLMHead` split the vocabulary (padded to a
  multiple of ``tp``); the embedding all-reduces, the LM head gathers the logits on rank 0.

Every layer loads its part of a full Hugging Face tensor (``load_weight`` / ``load_shard``),
so the same checkpoint (or the same dummy weights) serves any ``tensor_parallel_size``. With a
single rank the layers are plain linear layers and embeddings.
"""
from __future__ import annotations

import torch
from torch import nn

from ..distributed.partition import LinearPartition, head_partition, split_range
from ..distributed.process_group import TensorParallelGroup
from .blas_choice import lt_linear

SINGLE_RANK = TensorParallelGroup()

# On a CPU, a float32 GEMM of 2 up to this many rows runs as ``W @ x^T`` (the weight as the left operand), which
# MKL multiplied up to 2.2x faster than ``x @ W^T`` on the SmolLM2 shapes on two AVX2 cores (a decode step's 121
# GEMMs at 4 rows: 27 against 58 ms; at 64 rows 153 against 164; at 128 even; cpu-gemm-order_cpu_2026-12-06.json).
# One row is a GEMV either way, and from about 256 rows (prompt chunks) ``x @ W^T`` is faster.
CPU_WEIGHT_LEFT_MAX_ROWS = 128


# The CPU's LM head (``W @ x^T`` too) is multiplied in blocks of this many vocabulary rows, each block's
# ``[rows, T]`` product transposed into place while it is still in the core's cache: SmolLM2's 49,152 x 576 head at
# 64 rows took 32 ms against 40 ms for one product and one transposing copy of the 12.5 MB of logits (two cores);
# each block's entries are the same sums, bit for bit.
CPU_LM_HEAD_BLOCK_ROWS = 2048

NO_ROWS: frozenset[int] = frozenset()


def _weight_left_cpu(x: torch.Tensor) -> bool:
    return (x.device.type == "cpu" and x.dtype == torch.float32 and x.dim() == 2
            and 2 <= x.shape[0] <= CPU_WEIGHT_LEFT_MAX_ROWS)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           lt_rows: frozenset[int] = NO_ROWS) -> torch.Tensor:
    """``x [T, in] @ weight[out, in]^T + bias [out]`` -> contiguous ``[T, out]``, in the operands' dtype (the
    product of :func:`torch.nn.functional.linear`, on a CPU in the faster operand order for few rows).

    Args:
        lt_rows: row counts ``T`` at which a CUDA graph being captured takes cuBLASLt instead of cuBLAS (the
            layer's choice, timed at start-up by :func:`.blas_choice.choose`); empty on CPU and for eager engines.
    """
    if _weight_left_cpu(x):
        out = torch.mm(weight, x.t()) if bias is None else torch.addmm(bias[:, None], weight, x.t())
        return out.t().contiguous()
    if lt_rows and x.shape[0] in lt_rows and torch.cuda.is_current_stream_capturing():
        return lt_linear(x, weight, bias)
    return nn.functional.linear(x, weight, bias)


def _copy(target: torch.Tensor, source: torch.Tensor, what: str) -> None:
    if target.shape != source.shape:
        raise ValueError(f"{what}: expected shape {tuple(target.shape)}, got {tuple(source.shape)}")
    with torch.no_grad():
        target.copy_(source)


class ColumnParallelLinear(nn.Linear):
    """``y = x W^T + b`` with ``W`` split by output rows: ``forward(x [T, in]) -> [T, out_local]``.

    Args:
        out_ranges: per rank, ``[start, end)`` row ranges of the full weight this rank holds (their
            concatenation, in order, is the local weight); None splits ``out_features`` evenly.
    """

    takes_fp8_activations = False  # see QuantizedLinear.takes_fp8_activations
    lt_rows = NO_ROWS  # row counts whose captured GEMM takes cuBLASLt (blas_choice.choose)

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TensorParallelGroup = SINGLE_RANK,
                 out_ranges: list[tuple[int, int]] | None = None) -> None:
        self.tp = tp
        self.out_ranges = out_ranges or [split_range(out_features, tp.world_size, tp.rank)]
        super().__init__(in_features, sum(end - start for start, end in self.out_ranges), bias=bias)
        self.full_out_features = out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.lt_rows)

    def full_shape(self, param_name: str) -> tuple[int, ...]:
        """Shape of the unsplit parameter (what ``load_weight`` takes)."""
        return (self.full_out_features, self.in_features) if param_name == "weight" else (self.full_out_features,)

    def linear_partition(self) -> LinearPartition:
        """Where this rank's rows lie in the full layer (what a quantized replacement loads)."""
        sizes = getattr(self, "shard_sizes", {})
        return LinearPartition(self.in_features, self.full_out_features, (0, self.in_features),
                               tuple(self.out_ranges), dict(getattr(self, "shard_ranges", {})), False, self.tp,
                               dict(sizes))

    def load_weight(self, param_name: str, full: torch.Tensor) -> None:
        """Copy this rank's rows of the full (unsplit) ``weight [out, in]`` or ``bias [out]``."""
        _copy(getattr(self, param_name), torch.cat([full[s:e] for s, e in self.out_ranges]),
              f"{param_name} rows {self.out_ranges}")


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several HF projections fused into one column-parallel matmul.

    ``shard_sizes`` maps each HF projection name (``"gate_proj"``) to its full number of output rows;
    each is split over the ranks, and the local weight is the concatenation of this rank's slices
    (so ``output.split(local_sizes)`` gives each projection's part).
    """

    def __init__(self, in_features: int, shard_sizes: dict[str, int], bias: bool,
                 tp: TensorParallelGroup = SINGLE_RANK,
                 shard_ranges: dict[str, tuple[int, int]] | None = None) -> None:
        ranges = shard_ranges or {name: split_range(size, tp.world_size, tp.rank) for name, size in shard_sizes.items()}
        self.shard_sizes = dict(shard_sizes)
        self.shard_ranges = ranges  # name -> this rank's [start, end) within that projection
        self.offsets: dict[str, tuple[int, int]] = {}  # name -> its rows in the local weight
        full_offsets, start, full_start = [], 0, 0
        for name, size in shard_sizes.items():
            lo, hi = ranges[name]
            self.offsets[name] = (start, start + hi - lo)
            full_offsets.append((full_start + lo, full_start + hi))
            start += hi - lo
            full_start += size
        super().__init__(in_features, full_start, bias, tp, out_ranges=full_offsets)

    @property
    def local_sizes(self) -> list[int]:
        return [end - start for start, end in self.offsets.values()]

    def load_shard(self, shard: str, param_name: str, tensor: torch.Tensor) -> None:
        """Copy this rank's rows of one HF projection (``tensor`` is that projection's full weight or bias).

        Raises:
            ValueError: ``tensor`` does not have the projection's full shape.
        """
        target = getattr(self, param_name)
        if tensor.shape[0] != self.shard_sizes[shard] or tensor.shape[1:] != target.shape[1:]:
            raise ValueError(f"{shard}.{param_name}: expected rows {self.shard_sizes[shard]}, got "
                             f"{tuple(tensor.shape)}")
        lo, hi = self.shard_ranges[shard]
        start, end = self.offsets[shard]
        with torch.no_grad():
            target[start:end].copy_(tensor[lo:hi])


class QKVParallelLinear(MergedColumnParallelLinear):
    """Q, K and V projections fused and split by heads (see ``partition.head_partition``:
    KV heads are replicated when there are fewer than ranks).

    ``forward(x [T, hidden]) -> [T, (Hq_local + 2 * Hk_local) * head_dim]``.
    """

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool,
                 tp: TensorParallelGroup = SINGLE_RANK) -> None:
        part = head_partition(num_heads, num_kv_heads, tp.world_size, tp.rank)
        self.partition = part
        q = (part.q_start * head_dim, (part.q_start + part.num_heads) * head_dim)
        kv = (part.kv_start * head_dim, (part.kv_start + part.num_kv_heads) * head_dim)
        super().__init__(hidden_size, {"q_proj": num_heads * head_dim, "k_proj": num_kv_heads * head_dim,
                                       "v_proj": num_kv_heads * head_dim}, bias, tp,
                         shard_ranges={"q_proj": q, "k_proj": kv, "v_proj": kv})


class RowParallelLinear(nn.Linear):
    """``y = all_reduce(x_local W_local^T) + b`` with ``W`` split by input columns.

    ``forward(x [T, in_local]) -> [T, out]`` (the same on every rank). The bias is added once, after
    the sum.
    """

    takes_fp8_activations = False  # see QuantizedLinear.takes_fp8_activations
    lt_rows = NO_ROWS  # row counts whose captured GEMM takes cuBLASLt (blas_choice.choose)

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TensorParallelGroup = SINGLE_RANK,
                 in_range: tuple[int, int] | None = None) -> None:
        self.tp = tp
        self.in_range = in_range or split_range(in_features, tp.world_size, tp.rank)
        super().__init__(self.in_range[1] - self.in_range[0], out_features, bias=bias)
        self.full_in_features = in_features

    def full_shape(self, param_name: str) -> tuple[int, ...]:
        return (self.out_features, self.full_in_features) if param_name == "weight" else (self.out_features,)

    def linear_partition(self) -> LinearPartition:
        """Where this rank's columns lie in the full layer (what a quantized replacement loads)."""
        return LinearPartition(self.full_in_features, self.out_features, self.in_range, ((0, self.out_features),),
                               {}, self.tp.world_size > 1, self.tp, {})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp.world_size == 1:
            return linear(x, self.weight, self.bias, self.lt_rows)
        out = self.tp.all_reduce(linear(x, self.weight, None, self.lt_rows))
        return out if self.bias is None else out + self.bias

    def load_weight(self, param_name: str, full: torch.Tensor) -> None:
        """Copy this rank's columns of the full ``weight [out, in]`` (the bias whole)."""
        if param_name == "weight":
            full = full[:, self.in_range[0]:self.in_range[1]]
        _copy(getattr(self, param_name), full, f"{param_name} columns {self.in_range}")


def _vocab_range(vocab_size: int, tp: TensorParallelGroup) -> tuple[int, int]:
    per_rank = -(-vocab_size // tp.world_size)
    return tp.rank * per_rank, (tp.rank + 1) * per_rank


class VocabParallelEmbedding(nn.Module):
    """Token embedding with the vocabulary split over ranks (padded to a multiple of ``tp``).

    ``forward(input_ids [T] int64) -> [T, H]``: each rank looks up the ids in its range, zeros the
    others, and the ranks all-reduce (a sum of one row and zeros: exact).
    """

    def __init__(self, vocab_size: int, hidden_size: int, tp: TensorParallelGroup = SINGLE_RANK) -> None:
        super().__init__()
        self.tp = tp
        self.vocab_size = vocab_size
        self.vocab_start, self.vocab_end = _vocab_range(vocab_size, tp)
        self.weight = nn.Parameter(torch.empty(self.vocab_end - self.vocab_start, hidden_size))

    def full_shape(self, param_name: str) -> tuple[int, ...]:
        return (self.vocab_size, self.weight.shape[1])

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.world_size == 1:
            return nn.functional.embedding(input_ids, self.weight)
        outside = (input_ids < self.vocab_start) | (input_ids >= self.vocab_end)
        local = torch.where(outside, 0, input_ids - self.vocab_start)
        hidden = nn.functional.embedding(local, self.weight).masked_fill_(outside.unsqueeze(-1), 0)
        return self.tp.all_reduce(hidden)

    def load_weight(self, param_name: str, full: torch.Tensor) -> None:
        """Copy this rank's rows of the full ``[vocab, H]`` table (padding rows are zero)."""
        rows = full[self.vocab_start:min(self.vocab_end, self.vocab_size)]
        if full.shape[0] != self.vocab_size or full.shape[1:] != self.weight.shape[1:]:
            raise ValueError(f"{param_name}: expected shape ({self.vocab_size}, {self.weight.shape[1]}), "
                             f"got {tuple(full.shape)}")
        with torch.no_grad():
            self.weight.zero_()
            self.weight[:rows.shape[0]].copy_(rows)


class ParallelLMHead(VocabParallelEmbedding):
    """The output projection, split by vocabulary like the embedding (see :func:`parallel_logits`)."""


def parallel_logits(hidden: torch.Tensor, weight: torch.Tensor, vocab_size: int,
                    tp: TensorParallelGroup, lt_rows: frozenset[int] = NO_ROWS) -> torch.Tensor | None:
    """Logits of a vocabulary-parallel LM head (an untied ``ParallelLMHead``'s weight, or the
    ``VocabParallelEmbedding``'s when the model ties them).

    Args:
        hidden: ``[N, H]`` in the model dtype; weight: this rank's ``[vocab_padded / tp, H]``.
        lt_rows: see :func:`linear`.
    Returns:
        ``[N, vocab_size]`` in the model dtype on rank 0 (each rank computes its part, rank 0 gathers
        them); None on the other ranks. The sampler takes float32 where it computes on the values
        (a greedy argmax does not need the copy: 0.1 ms a step for 256 rows of a 152k vocabulary).
    """
    gathered = tp.gather_last_dim(_lm_head_cpu(hidden, weight) if _weight_left_cpu(hidden)
                                  else linear(hidden, weight, None, lt_rows))
    if gathered is None:
        return None
    return gathered[:, :vocab_size]


def _lm_head_cpu(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """:func:`linear`'s ``W @ x^T`` for an LM head, ``CPU_LM_HEAD_BLOCK_ROWS`` vocabulary rows at a time:
    ``hidden [T, H]``, ``weight [V, H]`` -> contiguous ``[T, V]``."""
    out = hidden.new_empty(hidden.shape[0], weight.shape[0])
    for start in range(0, weight.shape[0], CPU_LM_HEAD_BLOCK_ROWS):
        block = weight[start:start + CPU_LM_HEAD_BLOCK_ROWS]
        out[:, start:start + block.shape[0]].copy_(torch.mm(block, hidden.t()).t())
    return out
