"""Sampling parameters of one request, with the same names and meanings as vLLM's."""
from __future__ import annotations

import enum
import math
import numbers
from dataclasses import dataclass, field

from .errors import InvalidRequestError
from .structured_output.params import StructuredOutputsParams

MAX_LOGPROBS = 20
MAX_N = 128  # samples per request; OpenAI's documented limit for ``n``
SEED_RANGE = (-(2**63), 2**64 - 1)
INTEGER_FIELDS = ("n", "top_k", "min_tokens")
OPTIONAL_INTEGER_FIELDS = ("best_of", "seed", "max_tokens", "logprobs", "prompt_logprobs")  # None: unset
BOOLEAN_FIELDS = ("include_stop_str_in_output", "ignore_eos", "skip_special_tokens", "spaces_between_special_tokens")
FLOAT32_MAX = 3.4028234663852886e38  # the sampler computes in float32: larger values would overflow
NUMBER_FIELDS = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty")


class RequestOutputKind(enum.IntEnum):
    """What ``LLMEngine.step()`` returns for a request, with vLLM's names and values.

    ``DELTA``: after each step that adds tokens, the tokens and text added since the last output
    (this engine's default: the server streams them). ``FINAL_ONLY``: one output when the request
    finishes, holding all its tokens and text (``LLM.generate`` asks for it); without stop
    strings the text is then decoded once, at the end, instead of at every step. vLLM's
    ``CUMULATIVE`` (0) is not offered: join the deltas.
    """

    DELTA = 1
    FINAL_ONLY = 2


def _is_integer(value: object) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def shown(value: object, limit: int = 60) -> str:
    """``repr(value)`` for an error message, briefly: an integer of more than 20 digits in scientific notation
    (``1.000e+308``), anything else cut to ``limit`` characters."""
    if _is_integer(value) and abs(value).bit_length() > 66:  # beyond 20 digits
        if abs(value).bit_length() > 10_000:  # str() refuses integers of more than 4,300 digits
            return f"an integer of about {int(abs(value).bit_length() * 0.30103)} digits"
        digits = str(abs(value))
        return f"{'-' if value < 0 else ''}{digits[0]}.{digits[1:4]}e+{len(digits) - 1}"
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


@dataclass
class SamplingParams:
    """How to sample the output tokens of one request.

    Args:
        n: number of independent samples, 1..``MAX_N`` (128, OpenAI's limit).
        best_of: vLLM's number of candidates to generate before returning the best ``n``; this
            engine generates no more candidates than it returns, so only None or ``n`` is accepted.
        temperature: softmax temperature (>= 0); 0 means greedy.
        top_p: nucleus probability mass, in (0, 1].
        top_k: keep the k most likely tokens; -1 or 0 keeps all.
        min_p: drop tokens whose probability is below ``min_p`` times the top one, in [0, 1].
        presence_penalty, frequency_penalty: OpenAI's additive penalties, in [-2, 2],
            over the tokens generated so far.
        repetition_penalty: CTRL's multiplicative penalty (> 0) over prompt and output tokens
            (Keskar et al., 2019).
        seed: per-request seed; the same seed gives the same output alone or in a batch.
        logit_bias: token id -> bias added to its logit, each in [-100, 100].
        stop: strings that end the output; never included unless ``include_stop_str_in_output``.
        stop_token_ids: token ids that end the output (kept in ``token_ids``).
        ignore_eos: keep going past the end-of-sequence token.
        min_tokens: no EOS or stop token before this many output tokens.
        max_tokens: maximum number of output tokens (>= 1); ``None`` fills the context.
        logprobs: number of top log-probabilities to return per output token (0..20);
            the sampled token's own is always included.
        prompt_logprobs: the same for prompt tokens (0..20).
        skip_special_tokens: drop special tokens from the text.
        output_kind: a :class:`RequestOutputKind` (or its value): every step's delta, or only the
            final output.
        structured_outputs: a :class:`~inference.structured_output.StructuredOutputsParams` (or a
            dict of its fields): the output must match a JSON schema, regex, choice or grammar.

    Raises:
        InvalidRequestError: from :meth:`verify`, naming the parameter and its limit.
    """

    n: int = 1
    best_of: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    logit_bias: dict[int, float] | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: int = 0
    max_tokens: int | None = 16
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    output_kind: RequestOutputKind = RequestOutputKind.DELTA
    structured_outputs: StructuredOutputsParams | None = None
    # Filled by the engine, not the user.
    eos_token_ids: tuple[int, ...] = field(default=(), repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if not isinstance(self.stop or [], (list, tuple)) or not all(isinstance(s, str) for s in self.stop or []):
            raise InvalidRequestError(f"stop must be a string or a list of strings, got {self.stop!r}.", param="stop")
        self.stop = list(self.stop or [])
        for name in ("stop_token_ids", "eos_token_ids"):
            if not isinstance(getattr(self, name) or [], (list, tuple)):
                raise InvalidRequestError(f"{name} must be a list of token ids, got {getattr(self, name)!r}.",
                                          param=name)
        self.stop_token_ids = list(self.stop_token_ids or [])
        if isinstance(self.output_kind, bool) or self.output_kind not in tuple(RequestOutputKind):
            raise InvalidRequestError(
                f"output_kind must be RequestOutputKind.DELTA (1) or FINAL_ONLY (2), got {self.output_kind!r}"
                " (CUMULATIVE is not offered: join the deltas).", param="output_kind")
        self.output_kind = RequestOutputKind(self.output_kind)
        if self.structured_outputs is not None:
            self.structured_outputs = StructuredOutputsParams.from_value(self.structured_outputs)
        # NumPy's integers (np.int64) are integers here as Python's are: stored as int, checked as int.
        for name in INTEGER_FIELDS + OPTIONAL_INTEGER_FIELDS:
            if _is_integer(getattr(self, name)):
                setattr(self, name, int(getattr(self, name)))
        if self.logit_bias:
            try:
                self.logit_bias = {int(k): float(v) for k, v in dict(self.logit_bias).items()}
            except (TypeError, ValueError, OverflowError):
                raise InvalidRequestError("logit_bias must map token ids to numbers (float32), got "
                                          f"{shown(self.logit_bias)}.", param="logit_bias") from None
        self.verify()

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    def verify(self) -> None:
        """Check every field against its limit.

        Raises:
            InvalidRequestError: naming the first parameter outside its range.
        """
        def bad(param: str, limit: str, value: object) -> None:
            raise InvalidRequestError(f"{param} must be {limit}, got {shown(value)}.", param=param)

        for name in INTEGER_FIELDS + OPTIONAL_INTEGER_FIELDS:
            value = getattr(self, name)
            if (value is not None or name in INTEGER_FIELDS) and not _is_integer(value):
                bad(name, "an integer", value)
        for name in BOOLEAN_FIELDS:
            if not isinstance(getattr(self, name), bool):
                bad(name, "true or false", getattr(self, name))
        for name in ("stop_token_ids", "eos_token_ids"):
            if not all(_is_integer(t) for t in getattr(self, name)):
                bad(name, "a list of token ids", getattr(self, name))
        for name in NUMBER_FIELDS:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Real):
                bad(name, "a number", value)

        if not isinstance(self.n, int) or isinstance(self.n, bool) or not 1 <= self.n <= MAX_N:
            bad("n", f"between 1 and {MAX_N}", self.n)
        if self.best_of is not None and self.best_of != self.n:
            bad("best_of", f"None or equal to n={self.n} (this engine generates no more candidates than n)",
                self.best_of)
        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                     "repetition_penalty"):
            if not math.isfinite(getattr(self, name)) or abs(getattr(self, name)) > FLOAT32_MAX:
                bad(name, f"a finite number of at most {FLOAT32_MAX:.4g} in magnitude (float32)", getattr(self, name))
        if self.seed is not None and not SEED_RANGE[0] <= self.seed <= SEED_RANGE[1]:
            bad("seed", f"an integer in [{SEED_RANGE[0]}, {SEED_RANGE[1]}]", self.seed)
        if self.temperature < 0:
            bad("temperature", "non-negative", self.temperature)
        if not 0 < self.top_p <= 1:
            bad("top_p", "in (0, 1]", self.top_p)
        if self.top_k < -1:
            bad("top_k", "-1 or 0 (keep all tokens), otherwise at least 1", self.top_k)
        if not 0 <= self.min_p <= 1:
            bad("min_p", "in [0, 1]", self.min_p)
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                bad(name, "in [-2, 2]", getattr(self, name))
        if self.repetition_penalty <= 0:
            bad("repetition_penalty", "greater than 0", self.repetition_penalty)
        if self.max_tokens is not None and self.max_tokens < 1:
            bad("max_tokens", "at least 1", self.max_tokens)
        if self.min_tokens < 0:
            bad("min_tokens", "at least 0", self.min_tokens)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            bad("min_tokens", f"at most max_tokens={self.max_tokens}", self.min_tokens)
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= MAX_LOGPROBS:
                bad(name, f"between 0 and {MAX_LOGPROBS}", value)
        for token_id, bias in (self.logit_bias or {}).items():
            if not -100 <= bias <= 100:  # also rejects NaN
                bad("logit_bias", "in [-100, 100] for every token", {token_id: bias})
        if any(not s for s in self.stop):
            bad("stop", "non-empty strings", self.stop)

    def clone(self, **changes: object) -> "SamplingParams":
        """A copy with some fields changed (validated again)."""
        values = {f: getattr(self, f) for f in self.__dataclass_fields__}
        values.update(changes)
        return SamplingParams(**values)
