"""Per-step attention metadata for a flattened, variable-length batch (no padding)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .torch_decode import DecodePlan


@dataclass
class PrefillSegment:
    """A request in the batch that computes more than one token (a prompt or a prompt chunk).

    Attributes:
        start, end: its token rows in the flattened batch, ``[start, end)``.
        context_len: tokens already in the KV cache before this step (prefix hit or earlier chunks).
        block_table: ``[ceil((context_len + end - start) / block_size)]`` int64 physical block ids.
    """

    start: int
    end: int
    context_len: int
    block_table: torch.Tensor


@dataclass
class AttentionMetadata:
    """Everything the attention backend needs for one forward pass.

    Attributes:
        slot_mapping: ``[T]`` int64, the cache slot (``block_id * block_size + offset``) of each token's K/V.
        decode_indices: ``[Bd]`` int64, rows of the batch that are single-token decodes.
        decode_block_tables: ``[Bd, max_blocks]`` int64, zero-padded block tables of those requests.
        decode_seq_lens: ``[Bd]`` int64, context length including the new token.
        decode_max_seq_len: the largest of ``decode_seq_lens`` as a host int (tokens), where the step's
            builder knows it without reading the device; None otherwise.
        decode_plan: the PyTorch backend's order and groups of the decodes (``torch_decode.DecodePlan``),
            planned by the step's first layer and reused by the others; not an argument, and
            ``dataclasses.replace`` (the next step of a decode window) starts it afresh.
        prefills: the multi-token requests.
        block_size: tokens per block.
        backend: ``"torch"`` (reference, CPU) or ``"triton"`` (GPU kernels).

    The Triton backend reads the whole batch as tensors instead (None for the torch backend):
        block_tables: ``[B, max_blocks]`` int32 for every request, zero-padded.
        seq_lens: ``[B]`` int32 context length after this step; 0 marks a CUDA-graph padding row.
        context_lens: ``[B]`` int32 tokens cached before this step.
        cu_seqlens_q: ``[B + 1]`` int32 row offsets of each request.
        max_query_len, max_seq_len: host ints bounding the above (tokens).
        decode_only: every request computes one token (the decode kernel, and CUDA graphs, apply).
        num_splits: KV splits of the decode kernel, fixed when a CUDA graph is captured.
        num_leading_decodes: in a batch that also prefills, how many requests at its head compute one
            token each (the running decodes, scheduled first): they take the decode kernel.
        prefill_cu_seqlens_q: ``[B - num_leading_decodes + 1]`` int32 row offsets of the other requests
            within their rows (``cu_seqlens_q[d:] - d``), when ``num_leading_decodes`` is not 0.
    """

    slot_mapping: torch.Tensor
    decode_indices: torch.Tensor
    decode_block_tables: torch.Tensor
    decode_seq_lens: torch.Tensor
    prefills: list[PrefillSegment]
    block_size: int
    backend: str = "torch"
    block_tables: torch.Tensor | None = None
    seq_lens: torch.Tensor | None = None
    context_lens: torch.Tensor | None = None
    cu_seqlens_q: torch.Tensor | None = None
    max_query_len: int = 0
    max_seq_len: int = 0
    decode_only: bool = False
    num_splits: int | None = None
    num_leading_decodes: int = 0
    prefill_cu_seqlens_q: torch.Tensor | None = None
    decode_max_seq_len: int | None = None
    decode_plan: DecodePlan | None = field(default=None, init=False, repr=False, compare=False)

    @property
    def num_decodes(self) -> int:
        return int(self.decode_indices.shape[0])
