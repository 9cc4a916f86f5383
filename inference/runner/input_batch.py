"""Flattening a scheduled step into the model's input tensors and attention metadata."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..attention import AttentionMetadata, PrefillSegment
from ..core.scheduler_output import SchedulerOutput


@dataclass
class ModelInput:
    """Tensors of one forward pass over ``T`` tokens.

    Attributes:
        input_ids, positions: ``[T]`` int64.
        meta: attention metadata.
        logits_indices: ``[N]`` int64 rows whose hidden states are sampled (one per sampling request).
        prompt_logprob_rows: request_id -> (first row, prompt positions ``[k]`` scored from rows first..first+k-1).
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    logits_indices: torch.Tensor
    prompt_logprob_rows: dict[str, tuple[int, list[int]]]


def prepare_inputs(out: SchedulerOutput, block_size: int, device: str) -> ModelInput:
    """Build the inputs of a step: tokens of every scheduled request back to back, no padding."""
    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    decode_rows: list[int] = []
    decode_tables: list[list[int]] = []
    decode_lens: list[int] = []
    prefills: list[PrefillSegment] = []
    logits_rows: list[int] = []
    prompt_rows: dict[str, tuple[int, list[int]]] = {}
    for item in out.scheduled:
        req, n = item.request, item.num_scheduled_tokens
        start, ctx = len(input_ids), req.num_computed_tokens
        blocks = req.block_ids
        input_ids.extend(req.all_token_ids[ctx:ctx + n])
        positions.extend(range(ctx, ctx + n))
        if n == 1:
            slots.append(blocks[ctx // block_size] * block_size + ctx % block_size)
            decode_rows.append(start)
            decode_tables.append(blocks)
            decode_lens.append(ctx + 1)
        else:
            pos = torch.arange(ctx, ctx + n)
            table = torch.tensor(blocks, dtype=torch.long)
            slots.extend((table[pos // block_size] * block_size + pos % block_size).tolist())
            prefills.append(PrefillSegment(start, start + n, ctx, table.to(device)))
        if item.samples:
            logits_rows.append(start + n - 1)
        params = req.sampling_params
        if params.prompt_logprobs is not None and req.num_output_tokens == 0:
            scored = [p + 1 for p in range(ctx, ctx + n) if p + 1 < req.num_prompt_tokens]
            if scored:
                prompt_rows[req.request_id] = (start, scored)
    width = max((len(t) for t in decode_tables), default=0)
    padded = [t + [0] * (width - len(t)) for t in decode_tables]

    def as_tensor(values, shape=None):
        t = torch.tensor(values, dtype=torch.long)
        if shape is not None:
            t = t.reshape(shape)
        return t.to(device, non_blocking=True)

    meta = AttentionMetadata(
        slot_mapping=as_tensor(slots),
        decode_indices=as_tensor(decode_rows),
        decode_block_tables=as_tensor(padded, (len(padded), width)),
        decode_seq_lens=as_tensor(decode_lens),
        prefills=prefills,
        block_size=block_size,
    )
    return ModelInput(as_tensor(input_ids), as_tensor(positions), meta, as_tensor(logits_rows), prompt_rows)
