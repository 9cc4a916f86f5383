"""The engine's per-sequence state.

A user request with ``n`` samples becomes ``n`` engine ``Request`` objects (one per
sample) that share the parent's id; each has its own block table, whose blocks may be
shared with other requests (prefix hits, parallel samples of one prompt).
"""
from __future__ import annotations

import enum
import time

import torch

from .sampling_params import SamplingParams
from .lora.checkpoint import LoRAAdapter
from .structured_output.compiler import GrammarState


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self in FINISHED_STATUSES


# A tuple, not a set: ``in`` compares by identity first, where a set would call the enum's Python-level __hash__.
# Hot loops test ``request.status in FINISHED_STATUSES`` instead of the ``is_finished`` property.
FINISHED_STATUSES = (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_ABORTED)


class Request:
    """One sequence being generated.

    Attributes:
        request_id: unique engine id (``parent_id`` for n=1, ``f"{parent_id}#{index}"`` otherwise).
        parent_id: the caller's request id.
        index: sample index within the parent (0..n-1).
        prompt_token_ids: list[int] of prompt tokens.
        output_token_ids: list[int] of generated tokens.
        num_computed_tokens: tokens whose K/V are in the cache (tokens).
        block_ids: the block table, list of physical block ids.
        cpu_block_ids: the blocks of the CPU swap space holding its KV while swapped out (else empty).
        block_hashes: content hashes of the request's full blocks, computed as they fill
            (prefix caching).
        cache_salt: extra key of those hashes; requests with different salts never share blocks.
        num_cached_tokens: prompt tokens served from the prefix cache at first admission (None before).
        priority: scheduling priority, lower runs earlier (the "priority" policy).
        max_tokens: effective output limit (tokens).
        generator: per-request ``torch.Generator`` when ``sampling_params.seed`` is set.
        tenant_id: the tenant whose GPU share the request runs on (None: the engine's own).
        grammar: its place in the grammar its output must match (structured output), or None.
        lora_adapter: the LoRA adapter it runs with, or None (the base model); its ``key`` is one more key
            of the block hashes, so requests of different adapters never share blocks.
        sampling_step_invariant: its sampling settings read no earlier token (no logprobs, no penalties),
            one of the conditions of multi-step windows (:mod:`inference.sched.decode_windows`), computed
            once from ``sampling_params`` (not changed after the request is made).
    """

    def __init__(self, request_id: str, parent_id: str, index: int, prompt_token_ids: list[int],
                 sampling_params: SamplingParams, max_tokens: int, arrival_time: float | None = None,
                 priority: int = 0, cache_salt: str | None = None, tenant_id: str | None = None,
                 lora_adapter: LoRAAdapter | None = None) -> None:
        self.request_id = request_id
        self.parent_id = parent_id
        self.index = index
        self.prompt_token_ids = prompt_token_ids
        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.max_tokens = max_tokens
        self.arrival_time = arrival_time if arrival_time is not None else time.monotonic()
        self.priority = priority
        self.tenant_id = tenant_id
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.block_ids: list[int] = []
        self.cpu_block_ids: list[int] = []
        self.block_hashes: list[bytes] = []
        self.cache_salt = cache_salt
        self.num_cached_tokens: int | None = None
        self.num_preemptions = 0
        self.stop_reason: int | str | None = None
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.generator: torch.Generator | None = None
        self.grammar: GrammarState | None = None
        self.lora_adapter = lora_adapter
        self.sampling_step_invariant = (sampling_params.logprobs is None and not sampling_params.presence_penalty
                                        and not sampling_params.frequency_penalty
                                        and sampling_params.repetition_penalty == 1.0)
        if sampling_params.seed is not None:
            self.generator = torch.Generator()
            # One stream per sample, from the request's seed (any int in SamplingParams.SEED_RANGE).
            self.generator.manual_seed((sampling_params.seed * 1000003 + index) % (1 << 64))

    @property
    def lora_key(self) -> str | None:
        """The key of its LoRA adapter's weights (None: the base model)."""
        return None if self.lora_adapter is None else self.lora_adapter.key

    @property
    def lora_name(self) -> str | None:
        return None if self.lora_adapter is None else self.lora_adapter.lora_name

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_swapped(self) -> bool:
        return bool(self.cpu_block_ids)

    @property
    def is_finished(self) -> bool:
        return self.status in FINISHED_STATUSES  # not status.finished: one property less on the hot path

    @property
    def finish_reason(self) -> str | None:
        return self.status.value if self.status.finished else None

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, status={self.status.name}, prompt={self.num_prompt_tokens}, "
                f"output={self.num_output_tokens}, computed={self.num_computed_tokens}, blocks={len(self.block_ids)})")
