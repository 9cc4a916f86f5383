"""Flattening a scheduled step into the model's input tensors and attention metadata.

Host-side arrays are built with numpy in one pass over the scheduled requests (slot mappings
and padded block tables are vectorised), then copied to the device once each: at a batch of
256 decodes this keeps the host work of a step well under a millisecond of array building.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import torch

from ..attention import AttentionMetadata, PrefillSegment
from ..sched.scheduler_output import SchedulerOutput
from ..host_to_device import to_device


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


@dataclass
class HostBatch:
    """The step's host arrays (numpy), before they go to the device: all a tensor-parallel rank
    needs to run the step (rank 0 sends it to the other ranks)."""

    input_ids: np.ndarray      # [T] int64
    positions: np.ndarray      # [T] int64
    slots: np.ndarray          # [T] int64
    starts: np.ndarray         # [B + 1] int32 row offsets (cu_seqlens_q)
    contexts: np.ndarray       # [B] int32 tokens cached before the step
    tables: list[list[int]]    # B block tables (unpadded)
    logits_rows: np.ndarray    # [N] int64
    prompt_rows: dict[str, tuple[int, list[int]]]
    token_slots: np.ndarray | None = None  # [T] int32 LoRA slot of each token (-1: none); None: no adapter runs


def padded_block_tables(tables: list[list[int]], dtype=np.int32) -> np.ndarray:
    """``[B, max_blocks]`` block tables, zero-padded (padding entries are never read)."""
    lengths = np.fromiter((len(t) for t in tables), dtype=np.int64, count=len(tables))
    width = int(lengths.max()) if lengths.size else 0
    out = np.zeros((len(tables), width), dtype=dtype)
    flat = np.fromiter(itertools.chain.from_iterable(tables), dtype=dtype, count=int(lengths.sum()))
    out[np.arange(width) < lengths[:, None]] = flat  # row-major fill matches the concatenation order
    return out


def host_batch(out: SchedulerOutput, block_size: int, ahead: bool = False) -> HostBatch:
    """Flatten the scheduled requests into host arrays (one pass, vectorised where it counts).
    ``ahead``: a decode step scheduled before the previous step's tokens are known (their input
    ids are placeholders, filled in on the device)."""
    if ahead:
        return _decode_ahead_batch(out, block_size)
    num_reqs = len(out.scheduled)
    counts = np.fromiter((s.num_scheduled_tokens for s in out.scheduled), dtype=np.int64, count=num_reqs)
    contexts = np.fromiter((s.request.num_computed_tokens for s in out.scheduled), dtype=np.int64, count=num_reqs)
    starts = np.zeros(num_reqs + 1, dtype=np.int64)
    np.cumsum(counts, out=starts[1:])
    total = int(starts[-1])
    # positions: ctx, ctx+1, ... per request, from one arange shifted per segment
    seg_offsets = np.repeat(contexts - starts[:-1], counts)
    positions = np.arange(total, dtype=np.int64) + seg_offsets
    input_ids: list[int] = []
    tables: list[list[int]] = []
    block_of_token = np.empty(total, dtype=np.int64)
    logits_rows: list[int] = []
    prompt_rows: dict[str, tuple[int, list[int]]] = {}
    for i, item in enumerate(out.scheduled):
        req, n, ctx, start = item.request, item.num_scheduled_tokens, int(contexts[i]), int(starts[i])
        tables.append(req.block_ids)
        if n == 1:
            input_ids.append(0 if ahead else req.all_token_ids[ctx])  # ahead: the device fills it in
            block_of_token[start] = req.block_ids[ctx // block_size]
        else:
            input_ids.extend(req.all_token_ids[ctx:ctx + n])
            blocks = np.asarray(req.block_ids, dtype=np.int64)
            block_of_token[start:start + n] = blocks[positions[start:start + n] // block_size]
        if item.samples:
            logits_rows.append(start + n - 1)
            if item.forks:
                logits_rows.extend([start + n - 1] * len(item.forks))
        if req.sampling_params.prompt_logprobs is not None and req.num_output_tokens == 0:
            scored = [p + 1 for p in range(ctx, ctx + n) if p + 1 < req.num_prompt_tokens]
            if scored:
                prompt_rows[req.request_id] = (start, scored)
    slots = block_of_token * block_size + positions % block_size
    return HostBatch(np.asarray(input_ids, dtype=np.int64), positions, slots, starts.astype(np.int32),
                      contexts.astype(np.int32), tables, np.asarray(logits_rows, dtype=np.int64), prompt_rows,
                      _token_slots(out, counts))


def _token_slots(out: SchedulerOutput, counts: np.ndarray) -> np.ndarray | None:
    """``[T]`` int32 LoRA slot of each token row (-1 for requests without an adapter), from each
    request's slot (``out.lora_slots``) repeated over its ``counts`` tokens; None when no adapter runs."""
    if not out.lora_slots:
        return None
    slot_of = out.lora_slots
    per_request = np.fromiter((slot_of.get(item.request.lora_key, -1) for item in out.scheduled), dtype=np.int32,
                              count=len(out.scheduled))
    return np.repeat(per_request, counts)


def _decode_ahead_batch(out: SchedulerOutput, block_size: int) -> HostBatch:
    """``host_batch`` of a decode step scheduled ahead (``Scheduler.schedule_ahead``): one token
    per request, each sampled, no forks, no prompt logprobs (every request has sampled already),
    so every array but the block tables and the contexts is an ``arange``."""
    num_reqs = len(out.scheduled)
    requests = [item.request for item in out.scheduled]  # list comprehensions: cheaper than fromiter(generator)
    tables = [request.block_ids for request in requests]
    context_list = [request.num_computed_tokens for request in requests]
    contexts = np.array(context_list, dtype=np.int64)
    block_of_token = np.array([table[ctx // block_size] for table, ctx in zip(tables, context_list)], dtype=np.int64)
    slots = block_of_token * block_size + contexts % block_size
    rows = np.arange(num_reqs, dtype=np.int64)
    return HostBatch(np.zeros(num_reqs, dtype=np.int64), contexts, slots, np.arange(num_reqs + 1, dtype=np.int32),
                     contexts.astype(np.int32), tables, rows, {}, _token_slots(out, np.ones(num_reqs, np.int64)))


def device_inputs(host: HostBatch, block_size: int, device: str, backend: str = "torch",
                  input_ids: torch.Tensor | None = None) -> ModelInput:
    """The inputs of a step on the device: tokens of every scheduled request back to back, no padding.

    All host arrays of the step reach the device in one asynchronous copy from pinned memory
    (``to_device``), so preparing step N+1 never waits for step N to finish on the device.

    Args:
        input_ids: for a decode step scheduled ahead, the ``[B]`` int64 tokens the previous step
            samples on the device (one per request, in batch order), used as this step's inputs.
    """
    common = [host.input_ids, host.positions, host.slots, host.logits_rows]
    if backend == "torch":
        extra, build = _torch_metadata_arrays(host)
    else:
        extra, build = _triton_metadata_arrays(host)
    host_ids, positions, slots, logits_rows, *rest = to_device(common + extra, device)
    input_ids = host_ids if input_ids is None else input_ids
    meta = build(rest, block_size)
    meta.slot_mapping = slots
    return ModelInput(input_ids, positions, meta, logits_rows, host.prompt_rows)


def _torch_metadata_arrays(host: HostBatch):
    prefill_spans, prefill_tables = [], []
    starts = host.starts.tolist()
    if starts[-1] == len(host.tables):  # one token per request: every row decodes (the hot path), no loop
        decode_rows, decode_tables = list(range(len(host.tables))), host.tables
        decode_lens = (host.contexts.astype(np.int64) + 1).tolist()
    else:
        decode_rows, decode_tables, decode_lens = [], [], []
        for i, (table, ctx) in enumerate(zip(host.tables, host.contexts.tolist())):
            start, end = starts[i], starts[i + 1]
            if end - start == 1:
                decode_rows.append(start)
                decode_tables.append(table)
                decode_lens.append(ctx + 1)
            else:
                prefill_spans.append((start, end, ctx))
                prefill_tables.append(np.asarray(table, dtype=np.int64))
    arrays = [np.asarray(decode_rows, dtype=np.int64), padded_block_tables(decode_tables, np.int64),
              np.asarray(decode_lens, dtype=np.int64), *prefill_tables]

    def build(tensors: list[torch.Tensor], block_size: int) -> AttentionMetadata:
        rows, tables, lens, *prefill = tensors
        return AttentionMetadata(
            slot_mapping=None, decode_indices=rows, decode_block_tables=tables, decode_seq_lens=lens,
            prefills=[PrefillSegment(*span, table) for span, table in zip(prefill_spans, prefill)],
            block_size=block_size, decode_max_seq_len=max(decode_lens, default=None))
    return arrays, build


def _triton_metadata_arrays(host: HostBatch):
    tables = padded_block_tables(host.tables)
    query_lens = np.diff(host.starts)
    seq_lens = host.contexts + query_lens
    max_query_len = int(query_lens.max()) if query_lens.size else 0
    arrays = [tables, seq_lens.astype(np.int32), host.contexts, host.starts]
    # A batch that prefills too: its leading single-token requests (the running decodes) take the
    # decode kernel, the rest the prefill kernel, whose row tiles then hold no decode rows.
    leading = int(np.argmax(query_lens != 1)) if max_query_len > 1 else 0
    if leading:
        arrays.append((host.starts[leading:] - leading).astype(np.int32))

    def build(tensors: list[torch.Tensor], block_size: int) -> AttentionMetadata:
        block_tables, seq_lens_t, context_lens, cu_seqlens_q, *prefill_cu = tensors
        empty = block_tables.new_empty(0, dtype=torch.long)
        return AttentionMetadata(
            slot_mapping=None, decode_indices=empty, decode_block_tables=empty, decode_seq_lens=empty,
            prefills=[], block_size=block_size, backend="triton", block_tables=block_tables,
            seq_lens=seq_lens_t, context_lens=context_lens, cu_seqlens_q=cu_seqlens_q,
            max_query_len=max_query_len, max_seq_len=tables.shape[1] * block_size,
            decode_only=max_query_len == 1, num_leading_decodes=leading,
            prefill_cu_seqlens_q=prefill_cu[0] if prefill_cu else None)
    return arrays, build
