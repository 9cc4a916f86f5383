"""Tokens per engine step, as a histogram (vLLM's ``vllm:iteration_tokens_total``).

A step's tokens are the prompt tokens of its prefill chunks plus one per decoding request; a
multi-step window counts as its ``num_steps`` decode steps. The bucket bounds are vLLM's (powers
of two from 8 up to 16,384, with 1), so dashboards built for vLLM read the series as is.
"""
from __future__ import annotations

import bisect

ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


class IterationTokens:
    """Non-cumulative bucket counts (``counts[i]``: steps with ``bounds[i-1] < tokens <= bounds[i]``,
    the last one ``+Inf``) and the sum of tokens over the engine's steps."""

    def __init__(self) -> None:
        self.counts = [0] * (len(ITERATION_TOKEN_BUCKETS) + 1)
        self.sum = 0

    def observe(self, num_tokens: int, num_steps: int = 1) -> None:
        """Count ``num_steps`` steps of ``num_tokens`` tokens each."""
        self.counts[bisect.bisect_left(ITERATION_TOKEN_BUCKETS, num_tokens)] += num_steps
        self.sum += num_tokens * num_steps
