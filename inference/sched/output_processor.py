"""Turns sampled token ids into text deltas and finish decisions (stop tokens, stop strings, limits)."""
from __future__ import annotations

import time

import torch

from ..detokenizer import IncrementalDetokenizer
from ..outputs import CompletionOutput, Logprob
from ..request import Request, RequestStatus
from ..sampling_params import RequestOutputKind


class SequenceOutputState:
    """Per-sequence detokenizer and the output accumulated since the last ``step()`` returned.

    A ``FINAL_ONLY`` request without stop strings holds its token ids back from the detokenizer
    (``held``) and decodes them in one call when it finishes: the same text, one decode instead of
    one per step.
    """

    def __init__(self, request: Request, tokenizer) -> None:
        params = request.sampling_params
        self.defer_text = params.output_kind is RequestOutputKind.FINAL_ONLY and not params.stop
        self.held: list[int] = []
        self.detokenizer = IncrementalDetokenizer(
            tokenizer, request.prompt_token_ids, skip_special_tokens=params.skip_special_tokens,
            spaces_between_special_tokens=params.spaces_between_special_tokens, stop=list(params.stop),
            include_stop_str_in_output=params.include_stop_str_in_output, min_tokens=params.min_tokens)
        self.pending = CompletionOutput(index=request.index)
        self.cumulative_logprob = 0.0 if params.logprobs is not None else None

    def flush_held(self) -> None:
        """Add the text of the token ids a deferring state holds back to the pending output (a request
        aborted before it finished), as a ``DELTA`` request would have streamed it."""
        if self.held:
            text, _ = self.detokenizer.update(self.held, finished=False)
            self.pending.text += text
            self.held = []

    def take_delta(self) -> CompletionOutput:
        delta, self.pending = self.pending, CompletionOutput(index=self.pending.index)
        delta.cumulative_logprob = self.cumulative_logprob
        return delta


def check_stop_token(request: Request, token_id: int) -> RequestStatus | None:
    """The finish status implied by the newly appended ``token_id``, if any (before stop strings)."""
    params = request.sampling_params
    num_output_tokens = len(request.output_token_ids)
    if num_output_tokens >= params.min_tokens:
        if not params.ignore_eos and token_id in params.eos_token_ids:  # before stop_token_ids, as vLLM
            return RequestStatus.FINISHED_STOPPED
        if token_id in params.stop_token_ids:
            request.stop_reason = token_id
            return RequestStatus.FINISHED_STOPPED
    if num_output_tokens >= request.max_tokens:
        return RequestStatus.FINISHED_LENGTH
    return None


def logprobs_entry(tokenizer, ids: torch.Tensor, values: torch.Tensor, sampled_rank: int) -> dict[int, Logprob]:
    """``{token_id: Logprob}`` for one position; ``ids[0]`` is the chosen token (rank ``sampled_rank``)."""
    entry: dict[int, Logprob] = {}
    id_list, value_list = ids.tolist(), values.tolist()
    for position, (token_id, value) in enumerate(zip(id_list, value_list)):
        if token_id in entry:
            continue
        rank = sampled_rank if position == 0 else position
        entry[token_id] = Logprob(value, rank, tokenizer.decode([token_id]))
    return entry


def append_sampled_token(request: Request, token_id: int, max_model_len: int) -> RequestStatus | None:
    """The cheap half of output processing, done before the next step is scheduled: append the
    token, advance the request's grammar (structured output) past it, and decide the finishes
    that token ids alone imply (stop token, EOS, length limits, a grammar complete).

    Returns:
        The finish status if the request finished with this token, else None.
    """
    if request.first_token_time is None:
        request.first_token_time = time.monotonic()
    request.output_token_ids.append(token_id)  # request.append_output_token, inlined (hot path)
    request.all_token_ids.append(token_id)
    status = check_stop_token(request, token_id)
    if status is None and len(request.all_token_ids) >= max_model_len:
        status = RequestStatus.FINISHED_LENGTH
    grammar = request.grammar
    if grammar is not None and (not grammar.accept(token_id) or grammar.is_terminated) and status is None:
        status = RequestStatus.FINISHED_STOPPED  # complete (a stop token accepted), or a token it refused
    return status


def _text_delta(state: SequenceOutputState, token_ids: list[int],
                status: RequestStatus | None) -> tuple[str, str | None]:
    """``(text delta, matched stop string or None)`` of ``token_ids``; a deferring state returns no
    text until ``status`` says the request finished, then the text of every token it held."""
    if state.defer_text:
        state.held.extend(token_ids)
        if status is None:
            return "", None
        token_ids, state.held = state.held, []
    return state.detokenizer.update(token_ids, finished=status is not None,
                                    stop_terminated=status is RequestStatus.FINISHED_STOPPED)


def detokenize_sampled_token(request: Request, state: SequenceOutputState, token_id: int, logprobs,
                             status: RequestStatus | None, tokenizer) -> RequestStatus | None:
    """The text half, done while the device runs the next step: detokenize ``token_id``, look for
    stop strings and add text, token and logprobs to the pending delta. A stop token or EOS that
    finished the request (``status`` FINISHED_STOPPED here) adds its id and logprobs but no text,
    unless ``include_stop_str_in_output``.

    Returns:
        ``status``, or FINISHED_STOPPED when a stop string ended the text here.
    """
    delta_text, stop_str = _text_delta(state, [token_id], status)
    if stop_str is not None:
        status = RequestStatus.FINISHED_STOPPED
        request.stop_reason = stop_str
    pending = state.pending
    pending.text += delta_text
    pending.token_ids.append(token_id)
    if logprobs is not None:
        ids, values, rank = logprobs
        if pending.logprobs is None:
            pending.logprobs = []
        pending.logprobs.append(logprobs_entry(tokenizer, ids, values, rank))
        state.cumulative_logprob += float(values[0])
    if status is not None:
        pending.finish_reason = status.value
        pending.stop_reason = request.stop_reason
    return status


def append_sampled_tokens(request: Request, token_ids: list[int],
                          max_model_len: int) -> tuple[list[int], RequestStatus | None]:
    """:func:`append_sampled_token` over the tokens of a multi-step window, in order, up to the
    one that finishes the request; the tokens sampled after it are dropped.

    Returns:
        ``(the tokens appended, the finish status or None)``.
    """
    # The same decisions as append_sampled_token token by token, taken over the window at once (host time per
    # token is what bounds W2's small batches): the length limits first fix the last token, then the first
    # stop token or EOS before it (counted only from min_tokens on) ends the request earlier.
    if not token_ids:
        return token_ids, None
    params = request.sampling_params
    num_output = len(request.output_token_ids)
    count = max(1, min(request.max_tokens - num_output, max_model_len - len(request.all_token_ids)))
    status = RequestStatus.FINISHED_LENGTH if count <= len(token_ids) else None
    count = min(count, len(token_ids))
    eos = () if params.ignore_eos else params.eos_token_ids
    if eos or params.stop_token_ids:
        for i in range(max(0, params.min_tokens - num_output - 1), count):
            token_id = token_ids[i]
            if token_id in eos:  # before stop_token_ids, as vLLM
                count, status = i + 1, RequestStatus.FINISHED_STOPPED
                break
            if token_id in params.stop_token_ids:
                request.stop_reason = token_id
                count, status = i + 1, RequestStatus.FINISHED_STOPPED
                break
    appended = token_ids if count == len(token_ids) else token_ids[:count]
    if request.first_token_time is None:
        request.first_token_time = time.monotonic()
    request.output_token_ids.extend(appended)
    request.all_token_ids.extend(appended)
    return appended, status


def detokenize_sampled_tokens(request: Request, state: SequenceOutputState, token_ids: list[int],
                              status: RequestStatus | None) -> RequestStatus | None:
    """:func:`detokenize_sampled_token` for the tokens a multi-step window appended (no logprobs:
    windows never carry them), in one detokenizer call. A stop string completed by one of them
    ends the request there: the tokens after it leave the request and the delta.

    Returns:
        ``status``, or FINISHED_STOPPED when a stop string ended the text.
    """
    detokenizer = state.detokenizer
    delta_text, stop_str = _text_delta(state, token_ids, status)
    if stop_str is not None:
        status = RequestStatus.FINISHED_STOPPED
        request.stop_reason = stop_str
        num_dropped = len(request.output_token_ids) - detokenizer.truncate_token_ids_to
        if num_dropped:
            del request.output_token_ids[-num_dropped:], request.all_token_ids[-num_dropped:]
            token_ids = token_ids[:len(token_ids) - num_dropped]
    pending = state.pending
    pending.text += delta_text
    pending.token_ids.extend(token_ids)
    if status is not None:
        pending.finish_reason = status.value
        pending.stop_reason = request.stop_reason
    return status
