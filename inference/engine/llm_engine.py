"""``LLMEngine``: add requests, call ``step()`` repeatedly, collect output deltas.

Each ``step()`` is schedule -> execute -> update (vLLM v1's engine core shape); the engine
does no I/O, so it can be driven by the offline ``LLM`` or by a serving worker's loop.
"""
from __future__ import annotations

import itertools
import logging
import time
from concurrent.futures import FIRST_COMPLETED
from concurrent.futures import wait as wait_futures
from collections.abc import Mapping
from dataclasses import dataclass, field

from ..config import EngineConfig
from ..sched.fair_share import FairShare
from ..sched.output_processor import (SequenceOutputState, append_sampled_token, append_sampled_tokens,
                                     detokenize_sampled_token, detokenize_sampled_tokens, logprobs_entry)
from ..sched.scheduler import Scheduler
from ..errors import InvalidRequestError
from ..kv_cache import KVCacheManager
from ..model_loader import load_tokenizer
from ..outputs import CompletionOutput, RequestOutput
from ..request import Request, RequestStatus
from ..runner import ModelRunner
from ..sampling_params import RequestOutputKind, SamplingParams
from ..structured_output.compiler import GrammarCompiler, GrammarState
from ..validation import validate_priority, validate_prompt, validate_text
from .arg_utils import EngineArgs
from .iteration_stats import IterationTokens

logger = logging.getLogger(__name__)
GRAMMAR_WAIT = 0.005  # seconds step() waits for a compiling grammar when nothing else runs


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


@dataclass
class _ParentRequest:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    children: list[Request]
    states: dict[str, SequenceOutputState]
    prompt_logprobs: list | None = None
    prompt_logprobs_sent: bool = False
    finished_children: set[str] = field(default_factory=set)
    final_only: bool = False  # RequestOutputKind.FINAL_ONLY: one output, when every sample has finished


def make_runner(config: EngineConfig, num_kv_blocks: int | None) -> ModelRunner:
    """A ``ModelRunner``, or with ``tensor_parallel_size > 1`` rank 0's runner that spawns the other ranks."""
    if config.tensor_parallel_size == 1:
        return ModelRunner(config, num_kv_blocks)
    from ..distributed.tp_runner import TensorParallelRunner  # noqa: PLC0415
    return TensorParallelRunner(config, num_kv_blocks)


def _eos_token_ids(tokenizer, hf_config) -> tuple[int, ...]:
    """EOS ids of the tokenizer and the model config that the model can emit (``< vocab_size``)."""
    ids: set[int] = set()
    for value in (getattr(tokenizer, "eos_token_id", None), getattr(hf_config, "eos_token_id", None)):
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(int(v) for v in value)
    return tuple(sorted(i for i in ids if i < hf_config.vocab_size))


class LLMEngine:
    """The inference engine: continuous batching over a paged KV cache.

    Args:
        config: the resolved engine configuration.
        num_kv_blocks: override of the KV pool size (tests force preemption with a few blocks).
    """

    def __init__(self, config: EngineConfig, num_kv_blocks: int | None = None) -> None:
        self.config = config
        self.tokenizer = load_tokenizer(config.tokenizer)
        self.runner = make_runner(config, num_kv_blocks)
        self.kv_cache_manager = KVCacheManager(self.runner.num_blocks, config.cache.block_size,
                                               enable_prefix_caching=config.cache.enable_prefix_caching,
                                               num_cpu_blocks=self.runner.num_cpu_blocks)
        self.scheduler = Scheduler(config.scheduler, self.kv_cache_manager)
        self.eos_token_ids = _eos_token_ids(self.tokenizer, config.hf_config)
        self._parents: dict[str, _ParentRequest] = {}
        self._grammar_compiler: GrammarCompiler | None = None
        self._awaiting_grammar: list[str] = []  # parent ids whose grammar compiles (not yet scheduled)
        if config.device != "cpu":  # a long-lived GPU server: the vocabulary's grammar tables off the first request
            self.grammar_compiler.prewarm()
        self._aborted_outputs: list[RequestOutput] = []
        self._inflight = None  # (SchedulerOutput, StepHandle, updated) of the launched, not yet collected step
        self.device_wait_seconds = 0.0  # host time spent waiting for launched steps (s); ~0 means host-bound
        self.num_steps_ahead = 0  # steps launched before the previous step's tokens were back
        self.num_multi_step_windows = 0  # steps that ran several decode steps (num_scheduler_steps > 1)
        self._counter = itertools.count()
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.prompt_tokens_computed_total = 0
        self.iteration_tokens = IterationTokens()

    def close(self) -> None:
        """Release the engine's processes (the tensor-parallel ranks); a no-op for a single rank.
        Also happens when the engine is garbage-collected or the interpreter exits."""
        self.runner.close()
        if self._grammar_compiler is not None:
            self._grammar_compiler.close()

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> "LLMEngine":
        return cls(args.create_engine_config(), args.num_kv_blocks)

    @property
    def max_model_len(self) -> int:
        return self.config.max_model_len

    # ---- requests --------------------------------------------------------------------
    def add_request(self, request_id: str | None, prompt: str | list[int], params: SamplingParams,
                    arrival_time: float | None = None, priority: int = 0, prompt_text: str | None = None,
                    cache_salt: str | None = None, tenant_id: str | None = None) -> str:
        """Queue a request; returns its id (generated when ``request_id`` is None).

        Args:
            prompt: text (tokenized with the model's tokenizer, special tokens added) or token ids.
            arrival_time: ``time.monotonic()`` seconds of arrival (now when None).
            priority: lower runs earlier under ``scheduling_policy="priority"``.
            prompt_text: the text of a prompt given as token ids, echoed in the outputs.
            cache_salt: prefix-cache key: requests share cached blocks only with requests of the
                same salt (one per tenant keeps tenants from hitting, or timing, each other's prompts).
            tenant_id: whose GPU share the request runs on (see :meth:`set_tenant_shares`).
        Raises:
            InvalidRequestError: a duplicate id, ``params`` not a ``SamplingParams``, a prompt/params outside
                the limits, a priority that is not an integer, or other than 0 under the ``fcfs`` policy
                (nothing is queued).
        """
        request_id = request_id if request_id is not None else str(next(self._counter))
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError(f"params must be a SamplingParams, got {type(params).__name__}.", param="params")
        if request_id in self._parents:
            raise InvalidRequestError(f"request_id {request_id!r} is already in use.", param="request_id")
        validate_priority(priority, self.config.scheduler.scheduling_policy)
        priority = int(priority)  # a NumPy integer too
        if isinstance(prompt, str):
            validate_text(prompt, "prompt")
            text, token_ids = prompt, self.tokenizer.encode(prompt)
        else:
            text, token_ids = prompt_text, [int(t) for t in prompt]
        max_tokens = validate_prompt(token_ids, params, self.max_model_len, self.runner.vocab_size)
        params = params.clone(eos_token_ids=self.eos_token_ids)
        children = []
        for index in range(params.n):
            child_id = request_id if params.n == 1 else f"{request_id}#{index}"
            children.append(Request(child_id, request_id, index, token_ids, params, max_tokens,
                                    arrival_time, priority, cache_salt, tenant_id))
        states = {c.request_id: SequenceOutputState(c, self.tokenizer) for c in children}
        self._parents[request_id] = _ParentRequest(
            request_id, text, token_ids, children, states,
            final_only=params.output_kind is RequestOutputKind.FINAL_ONLY,
            prompt_logprobs=None if params.prompt_logprobs is None else [None])  # the first token has none
        if params.structured_outputs is not None:
            compiled = self.grammar_compiler.compile(params.structured_outputs)
            for child in children:
                child.grammar = GrammarState(compiled)
            if not compiled.done():  # compiles on its own thread; scheduled once done (_admit_compiled)
                self._awaiting_grammar.append(request_id)
                return request_id
        self.scheduler.add_request(children[0], followers=children[1:])  # one prefill for all n samples
        return request_id

    @property
    def grammar_compiler(self) -> GrammarCompiler:
        """Compiles and caches the grammars of structured-output requests (made on first use)."""
        if self._grammar_compiler is None:
            self._grammar_compiler = GrammarCompiler(self.tokenizer, self.runner.vocab_size, self.eos_token_ids)
        return self._grammar_compiler

    def _admit_compiled(self) -> None:
        """Schedule the requests whose grammar finished compiling; end those whose compilation
        failed (finish reason ``abort``). When nothing else runs, wait a moment for one."""
        waiting = [self._parents[rid].children[0].grammar.compiled for rid in self._awaiting_grammar
                   if rid in self._parents]
        if waiting and self._inflight is None and not self.scheduler.num_unfinished:
            wait_futures(waiting, timeout=GRAMMAR_WAIT, return_when=FIRST_COMPLETED)
        still = []
        for request_id in self._awaiting_grammar:
            parent = self._parents.get(request_id)
            if parent is None:  # aborted while compiling
                continue
            first = parent.children[0]
            if not first.grammar.ready:
                still.append(request_id)
            elif first.grammar.error is not None:
                logger.error("request %s: its grammar did not compile (%s)", request_id, first.grammar.error)
                self.abort_request(request_id)
            else:
                self.scheduler.add_request(first, followers=parent.children[1:])
        self._awaiting_grammar = still

    def set_tenant_shares(self, shares: Mapping[str, float], priorities: Mapping[str, int] | None = None) -> None:
        """Turn on (or update) tenant GPU shares: from the next step, the scheduler admits
        waiting requests by weighted fair queuing over tokens and preempts from tenants above
        their share first (:mod:`inference.sched.fair_share`).

        Args:
            shares: tenant id -> share in percent (only ratios matter; a tenant not listed,
                or with 0, weighs ``fair_share.MIN_SHARE``).
            priorities: tenant id -> priority between tenants equally far below their shares.
        Raises:
            InvalidRequestError: a share is negative or not finite (``param="shares"``).
        """
        try:
            if self.scheduler.fair_share is None:
                self.scheduler.fair_share = FairShare(shares, priorities)
            else:
                self.scheduler.fair_share.set_shares(shares, priorities)
        except ValueError as error:
            raise InvalidRequestError(str(error), param="shares") from None

    def unstarted_requests(self) -> list[tuple[str, str | None]]:
        """``(request_id, tenant_id)`` of the requests the scheduler has not started yet (waiting,
        no token computed or sampled for any of their samples), in arrival order. A caller may
        abort one of them (``report=False``) and hand it to another engine: nothing of it was
        computed here."""
        unstarted = [p for p in self._parents.values()
                     if all(c.status == RequestStatus.WAITING and c.num_computed_tokens == 0
                            and c.num_output_tokens == 0 for c in p.children)]
        unstarted.sort(key=lambda p: p.children[0].arrival_time)
        return [(p.request_id, p.children[0].tenant_id) for p in unstarted]

    def abort_request(self, request_ids: str | list[str], report: bool = True) -> None:
        """Abort requests at once: their blocks return to the pool, and (with ``report``) the next
        ``step()`` reports them with ``finish_reason="abort"``. Unknown or finished ids (and None) are ignored."""
        if request_ids is None:
            return
        for request_id in [request_ids] if isinstance(request_ids, str) else list(request_ids):
            parent = self._parents.pop(request_id, None)
            if parent is None:
                continue
            outputs = []
            for child in parent.children:
                if not child.is_finished:
                    self.scheduler.finish_request(child, RequestStatus.FINISHED_ABORTED)
                    state = parent.states[child.request_id]
                    state.flush_held()
                    delta = state.take_delta()
                    delta.finish_reason = "abort"
                    outputs.append(delta)
            if report:
                self._aborted_outputs.append(self._request_output(parent, outputs, finished=True))

    def has_unfinished_requests(self) -> bool:
        return bool(self._parents) or bool(self._aborted_outputs) or self._inflight is not None

    def get_num_unfinished_requests(self) -> int:
        return len(self._parents)

    # ---- the step --------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One iteration, pipelined so that the device never waits for detokenization:

        1. wait for the tokens of the step launched by the previous call, append them and decide
           the finishes token ids imply (EOS, stop tokens, lengths);
        2. schedule and launch the next step (the device starts on it);
        3. while it runs, detokenize the tokens of 1 (stop strings, logprobs) into deltas.

        A request that a stop string ends in 3 was already launched in 2; that extra token is
        dropped when it arrives. On CPU, step 2 runs to completion before 3 (no overlap).
        With ``num_scheduler_steps > 1`` the launched step may be a window of several decode
        steps (:mod:`inference.sched.decode_windows`); 1 and 3 then take up to that many tokens per request.

        Returns:
            Deltas for every request that progressed (new text and token ids; ``finished`` set
            on the last one), aborted ones included.
        Raises:
            RuntimeError: the KV pool cannot hold even one waiting request.
        """
        if self._awaiting_grammar:
            self._admit_compiled()
        outputs, self._aborted_outputs = self._aborted_outputs, []
        ahead = self._launch_ahead()
        sampled = self._finish_inflight()
        if ahead is not None:
            self._inflight = ahead
        else:
            sched_out = self.scheduler.schedule()
            if not sched_out.is_empty:
                self._inflight = (sched_out, self.runner.execute_async(sched_out), False)
            else:  # nothing runs; a step that preempted every running request still swaps
                self.runner.apply_block_ops(sched_out)
                if (not sampled and self.scheduler.num_unfinished and not self.scheduler.running
                        and not sched_out.preempted_ids):
                    raise RuntimeError("Scheduler made no progress: KV pool too small for the waiting request")
        outputs.extend(self._detokenize(sampled))
        return outputs

    def _launch_ahead(self):
        """With async scheduling, launch the step after the one in flight before waiting for it
        (see ``Scheduler.can_schedule_ahead``); returns the new in-flight entry, or None."""
        if not self.config.scheduler.async_scheduling or self._inflight is None:
            return None
        sched_out, handle, updated = self._inflight
        if updated or not self.scheduler.can_schedule_ahead(sched_out, self.max_model_len):
            return None
        if sched_out.num_steps > 1:
            self.scheduler.update_after_multi_step(sched_out)
        else:
            self.scheduler.update_after_step(sched_out)
        self._inflight = (sched_out, handle, True)
        ahead = self.scheduler.schedule_ahead(sched_out)
        if ahead is None:
            return None
        self.num_steps_ahead += 1
        return ahead, self.runner.execute_async(ahead, input_ids=handle.device_token_ids), False

    def _finish_inflight(self) -> list[tuple]:
        """Step 1 of ``step()``: returns ``(parent, request, token_id, logprobs, status)`` per sampled token
        (a prompt's parallel samples fork from it and sample in the same step) and
        ``(parent, request, None, prompt_logprobs, None)`` per prompt-logprob chunk."""
        if self._inflight is None:
            return []
        sched_out, handle, updated = self._inflight
        self._inflight = None
        waited = time.perf_counter()
        runner_out = handle.result()
        self.device_wait_seconds += time.perf_counter() - waited
        if sched_out.num_steps > 1:
            return self._finish_window(sched_out, runner_out.multi_step_token_ids, updated)
        if not updated:  # scheduling ahead already advanced the requests
            self.scheduler.update_after_step(sched_out)
        token_ids, logprobs_list, prompt_logprobs = (runner_out.sampled_token_ids, runner_out.logprobs,
                                                     runner_out.prompt_logprobs)
        parents, max_model_len, finish_request = self._parents, self.max_model_len, self.scheduler.finish_request
        result = []
        row = 0  # the next sampled row: one per sampling request, in batch order
        generated = prompts = 0  # tokens of this step: sampled, and prompts whose prefill finished
        for item in sched_out.scheduled:
            req = item.request
            samples = () if not item.samples else item.sampling_requests if item.forks else (req,)
            first_row, row = row, row + len(samples)
            parent = parents.get(req.parent_id)
            if parent is None:  # aborted while in flight
                continue
            if prompt_logprobs and req.request_id in prompt_logprobs and not req.is_finished:
                result.append((parent, req, None, prompt_logprobs[req.request_id], None))
            start = req.num_computed_tokens - item.num_scheduled_tokens
            if start < len(req.prompt_token_ids):  # a prompt chunk (decodes skip this bookkeeping)
                self.prompt_tokens_computed_total += min(req.num_computed_tokens, req.num_prompt_tokens) - start
                if samples and req.num_output_tokens == 0:
                    prompts += req.num_prompt_tokens  # once per prompt, also with n > 1
            for index, sample in enumerate(samples, first_row):
                if sample.is_finished:  # ended by a stop string (or aborted) while in flight
                    continue
                generated += 1
                token_id = token_ids[index]
                status = append_sampled_token(sample, token_id, max_model_len)
                if status is not None:
                    finish_request(sample, status)
                result.append((parent, sample, token_id, logprobs_list[index], status))
        self.prompt_tokens_total += prompts
        self.generation_tokens_total += generated
        self.iteration_tokens.observe(prompts + generated)
        return result

    def _finish_window(self, sched_out, window_tokens: list[list[int]], updated: bool) -> list[tuple]:
        """``_finish_inflight`` of a multi-step window: per request, its tokens in order up to the
        one that finishes it (the others are dropped), as ``(parent, request, token_ids, None, status)``."""
        parents, max_model_len, finish_request = self._parents, self.max_model_len, self.scheduler.finish_request
        result = []
        kept = []  # tokens appended per request
        for item, tokens in zip(sched_out.scheduled, window_tokens):
            req = item.request
            parent = parents.get(req.parent_id)
            if parent is None or req.is_finished:  # aborted, or ended by a stop string, while in flight
                continue
            tokens, status = append_sampled_tokens(req, tokens, max_model_len)
            kept.append(len(tokens))
            if status is not None:
                finish_request(req, status)
            result.append((parent, req, tokens, None, status))
        if not updated:  # scheduling ahead already advanced the requests
            self.scheduler.update_after_multi_step(sched_out)
        self.generation_tokens_total += sum(kept)
        self.iteration_tokens.observe_window(kept)
        self.num_multi_step_windows += 1
        return result

    def _detokenize(self, sampled: list[tuple]) -> list[RequestOutput]:
        """Step 3 of ``step()``: text deltas of the tokens from step 1."""
        touched: dict[str, _ParentRequest] = {}
        parents, tokenizer = self._parents, self.tokenizer
        for parent, req, token_id, logprobs, status in sampled:
            if parent.request_id not in parents:  # aborted meanwhile
                continue
            if token_id is None:
                self._record_prompt_logprobs(parent, req, logprobs)
                continue
            if type(token_id) is list:  # the tokens of a multi-step window
                num_tokens = len(req.output_token_ids)
                status = detokenize_sampled_tokens(req, parent.states[req.request_id], token_id, status)
                self.generation_tokens_total -= num_tokens - len(req.output_token_ids)  # after a stop string
            else:
                status = detokenize_sampled_token(req, parent.states[req.request_id], token_id, logprobs, status,
                                                  tokenizer)
            if status is not None:
                if not req.is_finished:  # a stop string: the token ids alone did not finish it
                    self.scheduler.finish_request(req, status)
                parent.finished_children.add(req.request_id)
            if not parent.final_only or len(parent.finished_children) == len(parent.children):
                touched[parent.request_id] = parent
        return [self._collect(parent) for parent in touched.values()]

    def _record_prompt_logprobs(self, parent, req, data) -> None:
        if req.index != 0:
            return
        ids, values, ranks = data
        for row in range(ids.shape[0]):
            parent.prompt_logprobs.append(logprobs_entry(self.tokenizer, ids[row], values[row], int(ranks[row])))

    def _collect(self, parent: _ParentRequest) -> RequestOutput:
        if len(parent.children) == 1:  # n=1: touched in this step, so it has a token or a finish
            deltas = [next(iter(parent.states.values())).take_delta()]
        else:
            deltas = [state.take_delta() for state in parent.states.values()  # children's order
                      if state.pending.token_ids or state.pending.finish_reason]
        finished = len(parent.finished_children) == len(parent.children)
        if finished:
            del self._parents[parent.request_id]
        return self._request_output(parent, deltas, finished)

    def _request_output(self, parent: _ParentRequest, deltas: list[CompletionOutput], finished: bool) -> RequestOutput:
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

    def get_stats(self) -> EngineStats:
        kv = self.kv_cache_manager
        running = self.scheduler.running
        return EngineStats(len(running), self.scheduler.num_waiting + len(self._awaiting_grammar), kv.num_free_blocks,
                           kv.num_blocks, kv.usage, self.scheduler.num_preemptions_total,
                           self.prompt_tokens_total, self.generation_tokens_total,
                           num_live_tokens=sum(r.num_computed_tokens for r in running),
                           num_allocated_slots=sum(len(r.block_ids) for r in running) * kv.block_size,
                           prefix_cache_queries_total=kv.prefix_cache_queries,
                           prefix_cache_hits_total=kv.prefix_cache_hits,
                           prompt_tokens_computed_total=self.prompt_tokens_computed_total,
                           num_swapped=kv.num_swapped, num_swapped_out_total=kv.num_swapped_out_total,
                           num_cpu_blocks=kv.num_cpu_blocks, num_free_cpu_blocks=kv.num_free_cpu_blocks,
                           cpu_kv_cache_usage=kv.cpu_usage,
                           iteration_tokens_counts=tuple(self.iteration_tokens.counts),
                           iteration_tokens_sum=self.iteration_tokens.sum)
