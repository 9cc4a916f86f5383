"""Typed seams between the scheduler, the model runner and the output processor."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..lora.checkpoint import LoRAAdapter
from ..request import Request, RequestStatus


@dataclass
class ScheduledRequest:
    """One request's share of a step.

    Attributes:
        request: the request (its ``num_computed_tokens`` is the count *before* this step).
        num_scheduled_tokens: tokens computed in this step (1 for a decode).
        samples: whether this step reaches the end of the known tokens, so a token is sampled.
        forks: parallel samples of the same prompt that sample their first token from this
            request's last row in this step and then share its blocks (see ``sched.parallel_sampling``).
    """

    request: Request
    num_scheduled_tokens: int
    samples: bool
    forks: list[Request] = field(default_factory=list)

    @property
    def sampling_requests(self) -> list[Request]:
        """The requests that sample a token from this item's last row, in batch order."""
        if not self.samples:
            return []
        return [self.request, *self.forks] if self.forks else [self.request]


@dataclass
class SchedulerOutput:
    """What one step computes: requests in batch order, ids preempted during scheduling, and the
    KV block copies the runner makes before the forward pass.

    Attributes:
        blocks_to_swap_out: ``(GPU block, CPU block)`` of requests swapped out in this step.
        blocks_to_copy: ``(source, destination)`` block ids within the KV cache (copy on write of
            a block that parallel samples share).
        blocks_to_swap_in: ``(CPU block, GPU block)`` of requests swapped back in.
        num_steps: decode steps run back to back (multi-step scheduling, :mod:`.decode_windows`):
            with ``num_steps > 1`` every item is a one-token decode whose blocks hold
            ``num_steps`` new tokens, and step ``k``'s inputs are step ``k - 1``'s tokens.
        input_rows: of a step scheduled ahead with multi-step scheduling, the rows of the
            previous step's last sampled tokens that are this step's inputs, when some of its
            requests have left the batch (None: every row, in order).
        lora_slots: LoRA adapter key -> the device slot it uses in this step (empty without adapters).
        lora_loads: ``(slot, adapter)`` pairs the runner copies into its slot weights before the step.
    The runner makes the block operations in that order, before the forward pass.
    """

    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted_ids: list[str] = field(default_factory=list)
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)
    num_steps: int = 1
    input_rows: list[int] | None = None
    lora_slots: dict[str, int] = field(default_factory=dict)
    lora_loads: list[tuple[int, LoRAAdapter]] = field(default_factory=list)

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(s.num_scheduled_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled

    @property
    def is_decode_only(self) -> bool:
        """Every request computes one token and samples it (no prefill chunk, no forking parallel
        samples); False when nothing is scheduled."""
        for item in self.scheduled:  # a loop, not all() over a generator: called per launch on the hot path
            if item.num_scheduled_tokens != 1 or not item.samples or item.forks:
                return False
        return bool(self.scheduled)


@dataclass
class ModelRunnerOutput:
    """What the model runner returns for one step.

    Attributes:
        sampled_token_ids: one token id per sampling request, in batch order of the sampling requests
            (the first step's with ``multi_step_token_ids``).
        logprobs: per sampling request, ``(token_ids [k+1] int64, logprobs [k+1] float32, rank of sampled)``
            with the sampled token first, or None when not requested.
        prompt_logprobs: request_id -> ``(token_ids [T, k+1], logprobs [T, k+1], ranks [T])`` for the
            prompt positions computed in this step (position i scores prompt token i+1).
        multi_step_token_ids: for a multi-step window, per request in batch order its
            ``num_steps`` tokens in order (step k's token at index k); None for a single step.
    """

    sampled_token_ids: list[int]
    logprobs: list[tuple[torch.Tensor, torch.Tensor, int] | None]
    prompt_logprobs: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    multi_step_token_ids: list[list[int]] | None = None


# ---- what the scheduler's update returns to the output processor -------------------------
# Slotted, not frozen: one SampledTokens per request per step on the hot path, and a frozen
# dataclass's __init__ costs several times a plain one. Treat them as read-only.
@dataclass(slots=True)
class SampledTokens:
    """The tokens one request appended in a step, as ``Scheduler.update_from_output`` decided.

    Attributes:
        request: the request (a parallel sample's own request, not its prompt's leader).
        token_ids: the tokens appended, in order: one for a single step; for a multi-step window,
            those up to the one that finished the request (the tokens sampled after it are dropped).
        logprobs: ``(token_ids [k+1] int64, logprobs [k+1] float32, rank of sampled)`` with the sampled
            token first, or None (always None for a window).
        status: the finish these token ids imply (EOS, a stop token id, a length limit, a grammar
            complete or refused), already applied in the scheduler; None while the request runs.
    """

    request: Request
    token_ids: list[int]
    logprobs: tuple[torch.Tensor, torch.Tensor, int] | None
    status: RequestStatus | None


@dataclass(slots=True)
class PromptLogprobs:
    """Prompt logprobs of the prompt positions one request computed in a step (position i scores
    prompt token i + 1).

    Attributes:
        request: the request whose prompt chunk ran.
        token_ids: ``[T, k+1]`` int64, the prompt token first in each row.
        logprobs: ``[T, k+1]`` float32.
        ranks: ``[T]`` int64, the prompt token's rank.
    """

    request: Request
    token_ids: torch.Tensor
    logprobs: torch.Tensor
    ranks: torch.Tensor


@dataclass(slots=True)
class SchedulerUpdate:
    """What a step appended (``Scheduler.update_from_output``), for the output processor and the
    engine's counters.

    Attributes:
        sampled: one record per request that appended tokens, in batch order.
        prompt_logprobs: the prompt-logprob chunks of the step, in batch order.
        num_prompt_tokens: prompt tokens of the requests whose prefill finished in the step (a
            prompt sampled ``n`` times counts once; 0 for a window).
        num_prompt_tokens_computed: prompt positions whose K/V the step computed (recomputes
            included; 0 for a window).
    """

    sampled: list[SampledTokens] = field(default_factory=list)
    prompt_logprobs: list[PromptLogprobs] = field(default_factory=list)
    num_prompt_tokens: int = 0
    num_prompt_tokens_computed: int = 0

    @property
    def is_empty(self) -> bool:
        return not self.sampled and not self.prompt_logprobs
