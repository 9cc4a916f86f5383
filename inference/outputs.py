"""Outputs returned to callers, shaped like vLLM's ``RequestOutput``."""
from __future__ import annotations

from dataclasses import dataclass, field

# One position's log-probabilities: token id -> Logprob.
LogprobsDict = dict[int, "Logprob"]


@dataclass
class Logprob:
    """Log-probability (natural log, after temperature-free log_softmax) of one token."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None
    # The token's own UTF-8 bytes where ``decoded_token`` is not them: a part of a character, decoded alone to U+FFFD
    token_bytes: list[int] | None = None


@dataclass(slots=True)  # slots: one is made per request and step
class CompletionOutput:
    """One sample of a request.

    ``text`` and ``token_ids`` are cumulative; in streaming deltas (``RequestOutput``
    from ``LLMEngine.step`` with ``delta=True``) they hold only what is new in that step.
    """

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    cumulative_logprob: float | None = None
    logprobs: list[LogprobsDict] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestOutput:
    """What a request produced so far.

    Attributes:
        request_id: the caller's id.
        prompt: the prompt text, when it was given as text.
        prompt_token_ids: prompt token ids, list of int.
        prompt_logprobs: per prompt position (first is None), when asked for.
        outputs: one ``CompletionOutput`` per sample (``n``).
        finished: every sample has finished.
        num_cached_tokens: prompt tokens served from the prefix cache.
        metrics: timestamps (seconds, ``time.monotonic``): arrival, first_scheduled, first_token, finished.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    prompt_logprobs: list[LogprobsDict | None] | None = None
    num_cached_tokens: int = 0
    metrics: dict[str, float] = field(default_factory=dict)
