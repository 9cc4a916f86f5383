"""Tokens per engine step, as a histogram (vLLM's ``vllm:iteration_tokens_total``).

As in vLLM v1, a step's tokens are the tokens it generated plus the full prompt length of each
request whose prefill finished in it (a prompt sampled ``n`` times counts once), so that over a
run the histogram's sum equals ``prompt_tokens_total + generation_tokens_total``; it is not the
number of tokens computed (a prefill chunk that samples nothing counts 0, a prefix-cache hit
counts in full). A multi-step window counts as its decode steps, step ``j`` with the requests
that kept a ``j``-th token; steps after every request of the window finished are not counted.
Approximation: tokens of a window sampled after a stop string ends the text (found after the
window is counted) stay in the histogram, while ``generation_tokens_total`` drops them.
The bucket bounds are vLLM's (powers of two from 8 up to 16,384, with 1), so dashboards built
for vLLM read the series as is.
"""
from __future__ import annotations

import bisect
from collections import Counter
from collections.abc import Sequence

ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


class IterationTokens:
    """Non-cumulative bucket counts (``counts[i]``: steps with ``bounds[i-1] < tokens <= bounds[i]``,
    the last one ``+Inf``) and the sum of tokens over the engine's steps."""

    def __init__(self) -> None:
        self.counts = [0] * (len(ITERATION_TOKEN_BUCKETS) + 1)
        self.sum = 0

    def observe(self, num_tokens: int) -> None:
        """Count one step of ``num_tokens`` tokens (prompt tokens of finished prefills + generated)."""
        self.counts[bisect.bisect_left(ITERATION_TOKEN_BUCKETS, num_tokens)] += 1
        self.sum += num_tokens

    def observe_window(self, num_kept_tokens: Sequence[int]) -> None:
        """Count the steps of a multi-step window from the tokens each request kept (``[num_requests]``
        ints): step ``j`` generated one token per request that kept more than ``j``."""
        ending = Counter(num_kept_tokens)  # tokens kept -> requests
        running = len(num_kept_tokens) - ending[0]
        for step in range(1, max(num_kept_tokens, default=0) + 1):
            self.observe(running)
            running -= ending[step]
