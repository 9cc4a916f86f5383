"""``OutputProcessor``: turns the tokens a step appended into the requests' outputs.

It owns the detokenization half of a step's update (vLLM v1's ``OutputProcessor``): per sequence an
incremental detokenizer, stop strings, logprob entries, and the aggregation of a prompt's ``n``
parallel samples into one ``RequestOutput``. It consumes the typed records of
``Scheduler.update_from_output`` (:mod:`inference.sched.scheduler_output`) and never calls the
scheduler: the ids of the requests a stop string ended go back to the engine, which finishes them.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from ..detokenizer import IncrementalDetokenizer
from ..outputs import CompletionOutput, Logprob, RequestOutput
from ..request import FINISHED_STATUSES, Request, RequestStatus
from ..sampling_params import RequestOutputKind
from ..sched.scheduler_output import PromptLogprobs, SampledTokens, SchedulerUpdate
from ..token_bytes import partial_token_bytes


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


@dataclass
class ParentRequest:
    """A request as the user made it: its ``n`` samples (``children``) and their output states."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    children: list[Request]
    states: dict[str, SequenceOutputState]
    prompt_logprobs: list | None = None
    prompt_logprobs_sent: bool = False
    finished_children: set[str] = field(default_factory=set)
    final_only: bool = False  # RequestOutputKind.FINAL_ONLY: one output, when every sample has finished


@dataclass(slots=True)
class ProcessedOutputs:
    """What :meth:`OutputProcessor.process` made of a step.

    Attributes:
        request_outputs: one per request that progressed (new text or token ids, or finished).
        stopped_request_ids: the samples a stop string ended (their token ids did not): the
            engine finishes them in the scheduler (FINISHED_STOPPED).
        num_dropped_tokens: tokens of multi-step windows taken back from their requests because
            a stop string ended the text before them.
    """

    request_outputs: list[RequestOutput]
    stopped_request_ids: list[str]
    num_dropped_tokens: int


def logprobs_entry(tokenizer, ids: torch.Tensor, values: torch.Tensor, sampled_rank: int) -> dict[int, Logprob]:
    """``{token_id: Logprob}`` for one position; ``ids[0]`` is the chosen token (rank ``sampled_rank``)."""
    entry: dict[int, Logprob] = {}
    id_list, value_list = ids.tolist(), values.tolist()
    for position, (token_id, value) in enumerate(zip(id_list, value_list)):
        if token_id in entry:
            continue
        rank = sampled_rank if position == 0 else position
        text = tokenizer.decode([token_id])
        entry[token_id] = Logprob(value, rank, text, partial_token_bytes(tokenizer, token_id, text))
    return entry


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


class OutputProcessor:
    """Owns the requests' output states (``parents``, by request id) and turns each step's
    :class:`SchedulerUpdate` into ``RequestOutput`` deltas.

    Args:
        tokenizer: the model's tokenizer (a Hugging Face tokenizer or one with its ``decode``).
    """

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.parents: dict[str, ParentRequest] = {}
        self._num_dropped = 0  # of the step being processed (see ProcessedOutputs)

    def add_request(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                    children: list[Request]) -> None:
        """Track a request's samples (``children``, ``n`` of them, sharing its sampling params)."""
        params = children[0].sampling_params
        states = {c.request_id: SequenceOutputState(c, self.tokenizer) for c in children}
        self.parents[request_id] = ParentRequest(
            request_id, prompt, prompt_token_ids, children, states,
            final_only=params.output_kind is RequestOutputKind.FINAL_ONLY,
            prompt_logprobs=None if params.prompt_logprobs is None else [None])  # the first token has none

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.parents

    def __len__(self) -> int:
        return len(self.parents)

    def abort(self, request_id: str) -> tuple[list[Request], RequestOutput] | None:
        """Stop tracking a request: its unfinished samples (for the engine to finish in the
        scheduler) and its last output (their remaining text, ``finish_reason="abort"``). None for
        an unknown or finished id."""
        parent = self.parents.pop(request_id, None)
        if parent is None:
            return None
        unfinished, deltas = [], []
        for child in parent.children:
            if not child.is_finished:
                unfinished.append(child)
                state = parent.states[child.request_id]
                state.flush_held()
                delta = state.take_delta()
                delta.finish_reason = "abort"
                deltas.append(delta)
        return unfinished, self._request_output(parent, deltas, finished=True)

    def process(self, update: SchedulerUpdate) -> ProcessedOutputs:
        """Detokenize the tokens of ``update`` (stop strings, logprobs) into deltas.

        A stop token or EOS that finished a request adds its id and logprobs but no text, unless
        ``include_stop_str_in_output``. A stop string completed by a token of a multi-step window
        ends the request there: the window's tokens after it leave the request and the delta.
        """
        parents = self.parents
        for chunk in update.prompt_logprobs:
            parent = parents.get(chunk.request.parent_id)
            if parent is not None and chunk.request.index == 0:
                self._record_prompt_logprobs(parent, chunk)
        touched: dict[str, ParentRequest] = {}
        stopped: list[str] = []
        self._num_dropped = 0
        for record in update.sampled:
            req = record.request
            parent = parents.get(req.parent_id)
            if parent is None:  # aborted meanwhile
                continue
            state = parent.states[req.request_id]
            if state.defer_text and record.status is None and record.logprobs is None:
                # _detokenize of a deferring state's running request, inlined (the hot path of FINAL_ONLY
                # outputs): its token ids are held back from the detokenizer, no text yet
                state.held.extend(record.token_ids)
                state.pending.token_ids.extend(record.token_ids)
            else:
                status = self._detokenize(state, record)
                if status is not None:
                    if req.status not in FINISHED_STATUSES:  # a stop string: the token ids alone did not finish it
                        stopped.append(req.request_id)
                    parent.finished_children.add(req.request_id)
            if not parent.final_only or len(parent.finished_children) == len(parent.children):
                touched[parent.request_id] = parent
        return ProcessedOutputs([self._collect(parent) for parent in touched.values()], stopped, self._num_dropped)

    def _detokenize(self, state: SequenceOutputState, record: SampledTokens) -> RequestStatus | None:
        """Add the text, token ids and logprobs of ``record`` to the pending delta.

        Returns:
            ``record.status``, or FINISHED_STOPPED when a stop string ended the text here.
        """
        req, token_ids, status = record.request, record.token_ids, record.status
        delta_text, stop_str = _text_delta(state, token_ids, status)
        if stop_str is not None:
            status = RequestStatus.FINISHED_STOPPED
            req.stop_reason = stop_str
            num_dropped = len(req.output_token_ids) - state.detokenizer.truncate_token_ids_to
            if num_dropped:  # only a window's tokens: a single token completes the match itself
                del req.output_token_ids[-num_dropped:], req.all_token_ids[-num_dropped:]
                token_ids = token_ids[:len(token_ids) - num_dropped]
                self._num_dropped += num_dropped
        pending = state.pending
        pending.text += delta_text
        pending.token_ids.extend(token_ids)
        logprobs = record.logprobs
        if logprobs is not None:  # single steps only
            ids, values, rank = logprobs
            if pending.logprobs is None:
                pending.logprobs = []
            pending.logprobs.append(logprobs_entry(self.tokenizer, ids, values, rank))
            state.cumulative_logprob += float(values[0])
        if status is not None:
            pending.finish_reason = status.value
            pending.stop_reason = req.stop_reason
        return status

    def _record_prompt_logprobs(self, parent: ParentRequest, chunk: PromptLogprobs) -> None:
        ids, values, ranks = chunk.token_ids, chunk.logprobs, chunk.ranks
        for row in range(ids.shape[0]):
            parent.prompt_logprobs.append(logprobs_entry(self.tokenizer, ids[row], values[row], int(ranks[row])))

    def _collect(self, parent: ParentRequest) -> RequestOutput:
        if len(parent.children) == 1:  # n=1: touched in this step, so it has a token or a finish
            deltas = [next(iter(parent.states.values())).take_delta()]
        else:
            deltas = [state.take_delta() for state in parent.states.values()  # children's order
                      if state.pending.token_ids or state.pending.finish_reason]
        finished = len(parent.finished_children) == len(parent.children)
        if finished:
            del self.parents[parent.request_id]
        return self._request_output(parent, deltas, finished)

    def _request_output(self, parent: ParentRequest, deltas: list[CompletionOutput], finished: bool) -> RequestOutput:
        first = parent.children[0]
        metrics = {"arrival": first.arrival_time}
        if first.first_scheduled_time is not None:
            metrics["first_scheduled"] = first.first_scheduled_time
        if first.first_token_time is not None:
            metrics["first_token"] = first.first_token_time
        if finished:
            metrics["finished"] = time.monotonic()
        prompt_logprobs = None
        if parent.prompt_logprobs is not None and not parent.prompt_logprobs_sent and (
                len(parent.prompt_logprobs) == len(parent.prompt_token_ids) or finished):
            prompt_logprobs, parent.prompt_logprobs_sent = parent.prompt_logprobs, True
        return RequestOutput(parent.request_id, parent.prompt, parent.prompt_token_ids, deltas, finished,
                             prompt_logprobs=prompt_logprobs, num_cached_tokens=first.num_cached_tokens or 0,
                             metrics=metrics)
