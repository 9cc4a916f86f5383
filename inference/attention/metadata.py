"""Per-step attention metadata for a flattened, variable-length batch (no padding)."""
from __future__ import annotations

from dataclasses import dataclass

import torch


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
        prefills: the multi-token requests.
        block_size: tokens per block.
    """

    slot_mapping: torch.Tensor
    decode_indices: torch.Tensor
    decode_block_tables: torch.Tensor
    decode_seq_lens: torch.Tensor
    prefills: list[PrefillSegment]
    block_size: int

    @property
    def num_decodes(self) -> int:
        return int(self.decode_indices.shape[0])
