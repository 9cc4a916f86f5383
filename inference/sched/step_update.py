"""The scheduler's update after a step: advance the requests that ran, append their sampled tokens.

:class:`StepUpdater` is the half of :class:`.scheduler.Scheduler` that runs once a step's tokens are
back (:meth:`.scheduler.Scheduler.update_from_output`): it advances ``num_computed_tokens``, registers
the blocks the step completed in the prefix cache, charges the tenants' fair share, forks the parallel
samples whose prompt the step computed (:mod:`.parallel_sampling`), appends the sampled tokens and
finishes the requests whose token ids end them (:mod:`.token_appends`). A multi-step window
(:mod:`.decode_windows`) is updated request by request over its tokens. With async scheduling, the
step scheduled ahead advances the step in flight before its tokens are known (:meth:`StepUpdater.advance_ahead`);
its update then only appends them.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from ..kv_cache import KVCacheManager
from ..request import FINISHED_STATUSES, Request, RequestStatus
from .fair_share import FairShare
from .parallel_sampling import ParallelSampling
from .policy import SchedulingPolicy
from .scheduler_output import ModelRunnerOutput, PromptLogprobs, SampledTokens, SchedulerOutput, SchedulerUpdate
from .token_appends import append_sampled_token, append_sampled_tokens


@dataclass(eq=False)
class StepUpdater:
    """Applies a step's outputs to its requests; one per scheduler, handed the scheduler's collaborators.

    Attributes:
        kv: the scheduler's KV-cache manager (prefix-cache registrations, the forks' shared blocks).
        parallel: the parallel samples waiting for their prompt's first token.
        running: the scheduler's running list (the forked samples join it, in place).
        policy: the scheduler's waiting queue (the samples forked without a seat are requeued).
        finish_request: the scheduler's :meth:`.scheduler.Scheduler.finish_request`.
        max_model_len: the longest request in tokens (a finish by length).
        max_num_seqs: the most running requests (seats for forked samples).
    """

    kv: KVCacheManager
    parallel: ParallelSampling
    running: list[Request]
    policy: SchedulingPolicy
    finish_request: Callable[[Request, RequestStatus], None]
    max_model_len: int
    max_num_seqs: int
    # the step advance_ahead advanced before its tokens
    _advanced_ahead: SchedulerOutput | None = field(default=None, init=False, repr=False)

    def advance_ahead(self, prev: SchedulerOutput, fair_share: FairShare | None) -> None:
        """Advance ``prev`` (still running on the device) as :meth:`update` would, for the step scheduled
        after it (:meth:`.scheduler.Scheduler.schedule_ahead`); ``prev``'s update then only appends its
        tokens. The blocks its tokens complete are cached once they are appended."""
        self._advance(prev, fair_share)
        self._advanced_ahead = prev

    def advanced(self, out: SchedulerOutput) -> bool:
        """Whether ``out`` (a step still on the device) was advanced already (:meth:`advance_ahead`): its
        requests' ``num_computed_tokens`` count its tokens."""
        return out is self._advanced_ahead

    def update(self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput,
               fair_share: FairShare | None) -> SchedulerUpdate:
        """:meth:`.scheduler.Scheduler.update_from_output`: advance the requests of ``scheduler_output``
        (charging ``fair_share``, None without tenant shares) unless :meth:`advance_ahead` already did,
        append the sampled tokens and finish the requests their ids end. Requests finished while the
        step ran (aborted, or ended by a stop string) append nothing: the token they sampled is dropped.

        Returns:
            The tokens appended per request and the prompt-logprob chunks (typed records), for the
            output processor.
        """
        if scheduler_output.num_steps > 1:
            return self._update_from_window(scheduler_output, runner_output.multi_step_token_ids, fair_share)
        advanced_ahead = scheduler_output is self._advanced_ahead
        if advanced_ahead:
            self._advanced_ahead = None
        else:
            self._advance_step(scheduler_output, fair_share)
        token_ids, logprobs_list, prompt_logprobs = (runner_output.sampled_token_ids, runner_output.logprobs,
                                                     runner_output.prompt_logprobs)
        max_model_len, finish_request = self.max_model_len, self.finish_request
        update = SchedulerUpdate()
        sampled = update.sampled
        row = 0  # the next sampled row: one per sampling request, in batch order
        prompts = computed = 0  # prompts whose prefill finished, prompt positions computed
        for item in scheduler_output.scheduled:
            req = item.request
            samples = () if not item.samples else item.sampling_requests if item.forks else (req,)
            first_row, row = row, row + len(samples)
            if req.status in FINISHED_STATUSES:  # aborted (every sample then) or ended by a stop string in flight
                continue
            if prompt_logprobs and req.request_id in prompt_logprobs:
                update.prompt_logprobs.append(PromptLogprobs(req, *prompt_logprobs[req.request_id]))
            start = req.num_computed_tokens - item.num_scheduled_tokens
            if start < len(req.prompt_token_ids):  # a prompt chunk (decodes skip this bookkeeping)
                computed += min(req.num_computed_tokens, req.num_prompt_tokens) - start
                if samples and req.num_output_tokens == 0:
                    prompts += req.num_prompt_tokens  # once per prompt, also with n > 1
            for index, sample in enumerate(samples, first_row):
                if sample.status in FINISHED_STATUSES:  # ended by a stop string while in flight
                    continue
                token_id = token_ids[index]
                status = append_sampled_token(sample, token_id, max_model_len)
                if status is not None:
                    finish_request(sample, status)
                sampled.append(SampledTokens(sample, [token_id], logprobs_list[index], status))
        update.num_prompt_tokens, update.num_prompt_tokens_computed = prompts, computed
        if advanced_ahead:
            self._cache_appended(scheduler_output)
        return update

    def _update_from_window(self, out: SchedulerOutput, window_tokens: list[list[int]],
                            fair_share: FairShare | None) -> SchedulerUpdate:
        """:meth:`update` of a multi-step window: per request, its tokens in order up to the one that
        finishes it (the others are dropped); then the window's advance, or, for a window
        :meth:`advance_ahead` advanced, the blocks its tokens completed (:meth:`_cache_appended`)."""
        max_model_len, finish_request = self.max_model_len, self.finish_request
        advanced_ahead = out is self._advanced_ahead
        # the requests still running, for _cache_appended's registrations (gathered here: one pass over the batch)
        appended = [] if advanced_ahead and self.kv.enable_prefix_caching else None
        sampled = []
        for item, tokens in zip(out.scheduled, window_tokens):
            req = item.request
            if req.status in FINISHED_STATUSES:  # aborted, or ended by a stop string, while in flight
                continue
            tokens, status = append_sampled_tokens(req, tokens, max_model_len)
            if status is not None:
                finish_request(req, status)
            elif appended is not None:
                appended.append(req)
            sampled.append(SampledTokens(req, tokens, None, status))
        if advanced_ahead:
            self._advanced_ahead = None
            if appended:
                self.kv.cache_blocks_of(appended)  # _cache_appended(out): its requests not finished, in order
        else:
            self._advance_window(out, fair_share)
        return SchedulerUpdate(sampled)

    def _cache_appended(self, out: SchedulerOutput) -> None:
        """With prefix caching, register the blocks that the tokens just appended completed, for a
        step that :meth:`advance_ahead` advanced before its tokens were known."""
        if self.kv.enable_prefix_caching:
            self.kv.cache_blocks_of([item.request for item in out.scheduled
                                     if item.request.status not in FINISHED_STATUSES])

    def _advance(self, out: SchedulerOutput, fair_share: FairShare | None) -> None:
        if out.num_steps > 1:
            self._advance_window(out, fair_share)
        else:
            self._advance_step(out, fair_share)

    def _advance_window(self, out: SchedulerOutput, fair_share: FairShare | None) -> None:
        """The advance of a multi-step window (``out.num_steps > 1``), once the window's tokens are
        appended (or, scheduling ahead, before: its blocks are cached after the append): every request still
        running computed ``num_steps`` tokens (those that finished in the window were freed; nothing
        of theirs is kept)."""
        num_steps = out.num_steps
        advanced = []
        for item in out.scheduled:
            request = item.request
            if fair_share is not None:
                fair_share.charge(request.tenant_id, num_steps)
            if request.status not in FINISHED_STATUSES:
                request.num_computed_tokens += num_steps
                advanced.append(request)
        self.kv.cache_blocks_of(advanced)  # each request's registrations depend on its own blocks alone

    def _advance_step(self, out: SchedulerOutput, fair_share: FairShare | None) -> None:
        """Advance ``num_computed_tokens`` of every request that ran in the step, register its newly
        completed blocks in the prefix cache, and fork the parallel samples whose prompt it computed."""
        kv = self.kv
        for item in out.scheduled:
            request = item.request
            request.num_computed_tokens += item.num_scheduled_tokens
            if fair_share is not None:
                fair_share.charge(request.tenant_id, item.num_scheduled_tokens)
            # a stop string can end a request while the step runs: its blocks are freed
            if kv.enable_prefix_caching and request.status not in FINISHED_STATUSES:
                kv.cache_blocks(request)
            if item.samples and self.parallel.holds(request):
                self._fork(request, item.forks)

    def _fork(self, leader: Request, sampled: list[Request]) -> None:
        """Give the followers that sampled beside the leader (``sampled``) its block table (shared) and
        let them run. The others, and any beyond ``max_num_seqs``, wait holding no blocks, as if
        preempted: they compute their prompt (and first token) when admitted, from the prefix cache
        when it is on."""
        overflow, sampled_ids = [], {id(follower) for follower in sampled}
        for follower in self.parallel.release(leader):
            if id(follower) in sampled_ids and len(self.running) < self.max_num_seqs:
                follower.first_scheduled_time = leader.first_scheduled_time
                self.kv.fork(leader, follower)
                follower.num_computed_tokens = leader.num_computed_tokens
                follower.status = RequestStatus.RUNNING
                self.running.append(follower)
            else:
                overflow.append(follower)
        for follower in reversed(overflow):
            self.policy.requeue(follower)
