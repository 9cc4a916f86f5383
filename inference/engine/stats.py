"""``EngineStats``: a snapshot of the engine's load, read by the serving worker's metrics and logs."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class EngineStats:
    """A snapshot of the engine's load (counts of requests, blocks and tokens)."""

    num_running: int
    num_waiting: int
    num_free_blocks: int
    num_total_blocks: int
    kv_cache_usage: float
    num_preemptions_total: int
    prompt_tokens_total: int
    generation_tokens_total: int
    num_live_tokens: int = 0  # tokens whose K/V are cached, over running requests
    num_allocated_slots: int = 0  # blocks held by running requests x block_size
    prefix_cache_queries_total: int = 0  # tokens looked up in the prefix cache by admitted requests
    prefix_cache_hits_total: int = 0  # of those, tokens found cached (not computed)
    prompt_tokens_computed_total: int = 0  # prompt positions whose K/V were computed (recomputes included)
    num_swapped: int = 0  # requests whose KV is in the CPU swap space now
    num_swapped_out_total: int = 0  # preemptions that swapped out (the others recomputed)
    num_cpu_blocks: int = 0  # blocks of the CPU swap space
    num_free_cpu_blocks: int = 0
    cpu_kv_cache_usage: float = 0.0  # fraction of the CPU swap space in use
    # steps by tokens (generated + prompts whose prefill finished; non-cumulative counts over
    # ITERATION_TOKEN_BUCKETS, then +Inf) and their sum
    iteration_tokens_counts: tuple[int, ...] = ()
    iteration_tokens_sum: int = 0
    # vLLM's vllm:lora_requests_info: the adapters (names, sorted) of running and of waiting requests, and
    # max_loras (0 when LoRA is off)
    lora_running_adapters: tuple[str, ...] = ()
    lora_waiting_adapters: tuple[str, ...] = ()
    max_lora: int = 0
