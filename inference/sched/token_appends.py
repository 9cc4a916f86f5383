"""Appending sampled tokens to a request and the finishes their ids imply: EOS, stop token ids, the
length limits, a structured-output grammar that completes or refuses a token. The scheduler's half of
a step's update (:meth:`.scheduler.Scheduler.update_from_output`); stop strings need the text and are
the output processor's (:mod:`inference.engine.output_processor`).
"""
from __future__ import annotations

import time

from ..request import Request, RequestStatus


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


def append_sampled_token(request: Request, token_id: int, max_model_len: int) -> RequestStatus | None:
    """Append the token, advance the request's grammar (structured output) past it, and decide the finishes
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
    num_window = len(token_ids)
    if not num_window:
        return token_ids, None
    params, output_token_ids, all_token_ids = request.sampling_params, request.output_token_ids, request.all_token_ids
    num_output = len(output_token_ids)
    # count = max(1, min(tokens left to max_tokens, to max_model_len)), without the builtins' calls (once per request
    # and window)
    count = request.max_tokens - num_output
    room = max_model_len - len(all_token_ids)
    if room < count:
        count = room
    if count < 1:
        count = 1
    if count <= num_window:
        status = RequestStatus.FINISHED_LENGTH
    else:
        status, count = None, num_window
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
    appended = token_ids if count == num_window else token_ids[:count]
    if request.first_token_time is None:
        request.first_token_time = time.monotonic()
    output_token_ids.extend(appended)
    all_token_ids.extend(appended)
    return appended, status
