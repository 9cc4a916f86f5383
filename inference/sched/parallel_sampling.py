"""Parallel sampling (``n > 1``): one prefill for the prompt, then ``n`` samples sharing its blocks.

The first sample (the *leader*) computes the prompt; the others (*followers*) wait here. In the
step where the leader samples its first token, each follower that gets one of the ``max_num_seqs``
seats samples its own first token from the same logits row, and after the step it takes the leader's
block table by reference (the KV manager adds a holder to each block); the others compute their
prompt when admitted. The partly filled last block is copied on write by the
first sample that appends to it while others still hold it. So the prompt's KV is held once,
whatever ``n`` is (vLLM v0's sequence-group fork).
"""
from __future__ import annotations

from ..request import Request


class ParallelSampling:
    """Followers waiting for their leader's prefill, keyed by the leader's request id."""

    def __init__(self) -> None:
        self._followers: dict[str, list[Request]] = {}

    def hold(self, leader: Request, followers: list[Request]) -> None:
        if followers:
            self._followers[leader.request_id] = list(followers)

    def forks_of(self, request: Request, samples: bool, seats: int) -> list[Request]:
        """The followers that sample with ``request`` in this step: when this step gives the leader its
        first token, its waiting followers up to ``seats`` (the ``max_num_seqs`` seats not taken or
        promised, so that a step samples at most ``max_num_seqs`` rows: n=128 on each of 128 prompts
        sampled 16,384 rows of full-vocabulary logits in one step), else none. The others compute their
        prompt (a prefix-cache hit for its full blocks) and sample when admitted (``StepUpdater._fork``),
        as vLLM V1's separate child requests do."""
        if not samples or request.num_output_tokens:
            return []
        return self._followers.get(request.request_id, [])[:max(seats, 0)]

    def holds(self, leader: Request) -> bool:
        """Whether followers of ``leader`` wait for its first token."""
        return leader.request_id in self._followers

    def release(self, leader: Request) -> list[Request]:
        """Take the followers of a leader that just forked."""
        return self._followers.pop(leader.request_id, [])

    def discard(self, request: Request) -> bool:
        """Forget a request that finished (aborted) while waiting here; True if it was here."""
        if self._followers.pop(request.request_id, None) is not None:
            return False  # a leader: its followers are finished by the caller too
        for followers in self._followers.values():
            if request in followers:
                followers.remove(request)
                return True
        return False

    def __len__(self) -> int:
        return sum(len(f) for f in self._followers.values())
