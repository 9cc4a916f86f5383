"""The device loop of multi-step scheduling: ``N`` decode steps back to back, one copy to the host.

Step ``k + 1`` of a window (:mod:`inference.sched.decode_windows`) decodes the tokens step ``k``
sampled, still on the device: its positions and sequence lengths are step ``k``'s plus one and
its slot mapping is read from the block tables already on the device (the scheduler reserved
the window's blocks), with a few small tensor ops and no host synchronisation. Decode steps
replay their CUDA graph as single steps do. The ``[B, N]`` sampled tokens go to host memory in
one asynchronous copy behind the last step. After vLLM v0's multi-step model runner.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import torch

from ..sched.scheduler_output import ModelRunnerOutput
from ..sampling import SamplingMetadata
from .input_batch import ModelInput
from .step_handle import DeviceTimed


def next_decode_inputs(inputs: ModelInput, token_ids: torch.Tensor, block_size: int) -> ModelInput:
    """The inputs of the decode step after ``inputs`` (a decode-only batch of ``B`` requests).

    Args:
        inputs: the previous step's inputs (not modified).
        token_ids: ``[B]`` int64 tokens the previous step sampled, one per request in batch order.
        block_size: tokens per KV block.
    Returns:
        Inputs whose positions, sequence lengths and slots are one further; the block tables
        must already hold the new positions' blocks.
    """
    meta = inputs.meta
    positions = inputs.positions + 1
    if meta.backend == "triton":
        tables = meta.block_tables
        lengths = {"seq_lens": meta.seq_lens + 1, "context_lens": meta.context_lens + 1}
    else:
        tables = meta.decode_block_tables
        lengths = {"decode_seq_lens": meta.decode_seq_lens + 1,
                   "decode_max_seq_len": None if meta.decode_max_seq_len is None else meta.decode_max_seq_len + 1}
    blocks = tables.gather(1, (positions // block_size)[:, None]).squeeze(1).long()
    slots = blocks * block_size + positions % block_size
    return ModelInput(token_ids, positions, dataclasses.replace(meta, slot_mapping=slots, **lengths),
                      inputs.logits_indices, {})


def run_decode_window(forward_and_sample: Callable[[ModelInput, SamplingMetadata], torch.Tensor],
                      inputs: ModelInput, sampling: SamplingMetadata, num_steps: int,
                      block_size: int) -> "MultiStepHandle":
    """Launch ``num_steps`` decode steps, each fed the tokens of the one before (no waiting).

    Args:
        forward_and_sample: the runner's one step: inputs -> ``[B]`` int64 sampled tokens.
        inputs: the first step's inputs (decode-only, one sampled row per request).
        sampling: the batch's sampling metadata, the same for every step (the scheduler only
            makes windows of requests whose sampling does not depend on earlier tokens).
    """
    tokens = [forward_and_sample(inputs, sampling)]
    for _ in range(num_steps - 1):
        inputs = next_decode_inputs(inputs, tokens[-1], block_size)
        tokens.append(forward_and_sample(inputs, sampling))
    return MultiStepHandle(torch.stack(tokens, dim=1))


class MultiStepHandle(DeviceTimed):
    """A launched window: its ``[B, N]`` int64 tokens are on their way to host memory.

    ``result()`` waits for them (the window's only host synchronisation).
    """

    def __init__(self, token_ids: torch.Tensor) -> None:
        self._token_ids = token_ids
        self._host_tokens = token_ids
        self._event = None
        if token_ids.is_cuda:
            self._host_tokens = torch.empty(token_ids.shape, dtype=token_ids.dtype, pin_memory=True)
            self._host_tokens.copy_(token_ids, non_blocking=True)
            self._event = self._done_event()

    @property
    def device_token_ids(self) -> torch.Tensor:
        """The last step's tokens ``[B]`` int64 where they were computed (no wait)."""
        return self._token_ids[:, -1]

    def result(self) -> ModelRunnerOutput:
        if self._event is not None:
            self._event.synchronize()
        rows = self._host_tokens.tolist()
        return ModelRunnerOutput([row[0] for row in rows], [None] * len(rows), multi_step_token_ids=rows)
