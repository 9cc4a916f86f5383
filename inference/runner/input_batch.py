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
        logits_indices: ``[N]`` int64 rows whose hidden states are sampled (one per sampling request;
            parallel samples forking from one prompt repeat its row).
        prompt_logprob_rows: request_id -> (first row, prompt positions ``[k]`` scored from rows first..first+k-1).
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    logits_indices: torch.Tensor
    prompt_logprob_rows: dict[str, tuple[int, list[int]]]


def _long(values, device: str, shape=None) -> torch.Tensor:
    t = torch.tensor(values, dtype=torch.long)
    if shape is not None:
        t = t.reshape(shape)
    return t.to(device, non_blocking=True)


def _int32(values, device: str, shape=None) -> torch.Tensor:
    t = torch.tensor(values, dtype=torch.int32)
    if shape is not None:
        t = t.reshape(shape)
    return t.to(device, non_blocking=True)


def _padded(tables: list[list[int]]) -> tuple[list[list[int]], int]:
    width = max((len(t) for t in tables), default=0)
    return [t + [0] * (width - len(t)) for t in tables], width


def prepare_inputs(out: SchedulerOutput, block_size: int, device: str, backend: str = "torch") -> ModelInput:
    """Build the inputs of a step: tokens of every scheduled request back to back, no padding."""
    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    logits_rows: list[int] = []
    prompt_rows: dict[str, tuple[int, list[int]]] = {}
    tables: list[list[int]] = []
    starts: list[int] = []
    contexts: list[int] = []
    for item in out.scheduled:
        req, n = item.request, item.num_scheduled_tokens
        start, ctx = len(input_ids), req.num_computed_tokens
        blocks = req.block_ids
        input_ids.extend(req.all_token_ids[ctx:ctx + n])
        positions.extend(range(ctx, ctx + n))
        slots.extend(blocks[p // block_size] * block_size + p % block_size for p in range(ctx, ctx + n))
        tables.append(blocks)
        starts.append(start)
        contexts.append(ctx)
        logits_rows.extend([start + n - 1] * len(item.sampling_requests))
        if req.sampling_params.prompt_logprobs is not None and req.num_output_tokens == 0:
            scored = [p + 1 for p in range(ctx, ctx + n) if p + 1 < req.num_prompt_tokens]
            if scored:
                prompt_rows[req.request_id] = (start, scored)
    starts.append(len(input_ids))
    if backend == "torch":
        meta = _torch_metadata(tables, starts, contexts, block_size, device)
    else:
        meta = _triton_metadata(tables, starts, contexts, block_size, device)
    meta.slot_mapping = _long(slots, device)
    return ModelInput(_long(input_ids, device), _long(positions, device), meta, _long(logits_rows, device), prompt_rows)


def _torch_metadata(tables, starts, contexts, block_size: int, device: str) -> AttentionMetadata:
    decode_rows, decode_tables, decode_lens, prefills = [], [], [], []
    for i, (table, ctx) in enumerate(zip(tables, contexts)):
        start, end = starts[i], starts[i + 1]
        if end - start == 1:
            decode_rows.append(start)
            decode_tables.append(table)
            decode_lens.append(ctx + 1)
        else:
            prefills.append(PrefillSegment(start, end, ctx, _long(table, device)))
    padded, width = _padded(decode_tables)
    return AttentionMetadata(
        slot_mapping=None, decode_indices=_long(decode_rows, device),
        decode_block_tables=_long(padded, device, (len(padded), width)),
        decode_seq_lens=_long(decode_lens, device), prefills=prefills, block_size=block_size)


def _triton_metadata(tables, starts, contexts, block_size: int, device: str) -> AttentionMetadata:
    padded, width = _padded(tables)
    query_lens = [starts[i + 1] - starts[i] for i in range(len(tables))]
    seq_lens = [c + q for c, q in zip(contexts, query_lens)]
    empty = torch.empty(0, dtype=torch.long, device=device)
    return AttentionMetadata(
        slot_mapping=None, decode_indices=empty, decode_block_tables=empty, decode_seq_lens=empty, prefills=[],
        block_size=block_size, backend="triton",
        block_tables=_int32(padded, device, (len(padded), width)), seq_lens=_int32(seq_lens, device),
        context_lens=_int32(contexts, device), cu_seqlens_q=_int32(starts, device),
        max_query_len=max(query_lens, default=0), max_seq_len=width * block_size,
        decode_only=all(q == 1 for q in query_lens))
