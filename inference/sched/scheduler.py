"""Iteration-level (continuous batching) scheduler with chunked prefill and preemption.

Each step fills a token budget (``max_num_batched_tokens``) with running requests first
(decodes and unfinished prefill chunks), then waiting ones in the policy's order, up to
``max_num_seqs`` requests (Yu et al., "Orca", OSDI 2022; chunked prefill after
Agrawal et al., "Sarathi-Serve", OSDI 2024). When the KV pool runs out, the last running
request in the policy's order is preempted (the newest under ``fcfs``, the lowest priority under
``priority``, see :mod:`.policy`): its blocks are freed and it restarts from its
prompt plus the tokens it has generated (recompute), or, with ``preemption_mode="swap"``, its
blocks are copied to the CPU swap space and back when it resumes (recompute when the swap space
is full). With prefix caching, a request being admitted starts after its longest cached prefix
(a preempted one usually finds its own blocks). Parallel samples of one prompt are prefilled
once and fork (:mod:`.parallel_sampling`). With LoRA, a waiting request whose adapter would make the
running requests use more than ``max_loras`` adapters waits, and the ones behind it are still
admitted; each step's adapters get device slots (:mod:`inference.lora.slots`).

After each step, :meth:`Scheduler.update_from_output` alone updates the requests (:mod:`.step_update`):
it advances ``num_computed_tokens``, appends the sampled tokens and finishes the requests whose token
ids end them (:mod:`.token_appends`); stop strings are found later, in the text (the engine's output
processor), and the engine then finishes those requests here.
"""
from __future__ import annotations

import time

from ..config import SchedulerConfig
from ..kv_cache import KVCacheManager
from ..lora.slots import LoRASlots
from ..request import Request, RequestStatus
from .decode_windows import reserve_window, rows_ahead, window_size
from .fair_share import FairShare
from .parallel_sampling import ParallelSampling
from .policy import SchedulingPolicy, make_policy
from .scheduler_output import ModelRunnerOutput, ScheduledRequest, SchedulerOutput, SchedulerUpdate
from .step_update import StepUpdater

PREEMPTION_MODES = ("recompute", "swap")


class Scheduler:
    """Decides which requests run in each step and how many tokens each computes."""

    def __init__(self, config: SchedulerConfig, kv_cache_manager: KVCacheManager,
                 lora_slots: LoRASlots | None = None) -> None:
        self.config = config
        self.kv = kv_cache_manager
        self.lora_slots = lora_slots  # None: LoRA is off
        self.policy = make_policy(config.scheduling_policy)
        self.running: list[Request] = []
        self.parallel = ParallelSampling()  # parallel samples waiting for their prompt's prefill
        self._forks_granted = 0  # seats promised to parallel samples in the step being scheduled
        self.requests: dict[str, Request] = {}
        self.num_preemptions_total = 0
        self.fair_share: FairShare | None = None  # tenants' GPU shares (see fair_share.py); None: the policy's order
        self._observed_running = 0  # running requests when the fair share last saw them
        self._rows_ahead: list[int] | None = None  # multi-step: the batch can_schedule_ahead found for schedule_ahead
        self.step_updater = StepUpdater(kv_cache_manager, self.parallel, self.running, self.policy,
                                        self.finish_request, config.max_model_len, config.max_num_seqs)
        # the longest window a decode-only batch may run now: num_scheduler_steps, or what the engine
        # sets from the measured step time with adaptive windows (decode_windows.adaptive_window)
        self.window_limit = 1 if config.adaptive_windows else config.num_scheduler_steps

    # ---- admission and removal -------------------------------------------------------
    def add_request(self, request: Request, followers: list[Request] | None = None) -> None:
        """Queue a request; ``followers`` are the other samples of its prompt (``n > 1``), which
        fork from it once its prompt is computed."""
        for r in [request, *(followers or [])]:
            self.requests[r.request_id] = r
        self.parallel.hold(request, followers or [])
        self.policy.add(request)

    def finish_request(self, request: Request, status: RequestStatus) -> None:
        """Mark a request finished, take it out of the queues and free its blocks."""
        request.status = status
        if request in self.running:
            self.running.remove(request)
        elif request in self.policy:
            self.policy.remove(request)
        else:
            self.parallel.discard(request)
        self.kv.free(request)
        self.requests.pop(request.request_id, None)

    def finish_requests(self, request_ids: list[str], status: RequestStatus) -> None:
        """:meth:`finish_request` by id (the requests a stop string ended); ids of requests already
        finished are ignored."""
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is not None and not request.is_finished:
                self.finish_request(request, status)

    @property
    def waiting(self) -> SchedulingPolicy:
        """The waiting queue (the policy owns it and its order)."""
        return self.policy

    @property
    def num_waiting(self) -> int:
        """Requests not running: queued ones and parallel samples waiting for their prompt."""
        return len(self.waiting) + len(self.parallel)

    @property
    def num_unfinished(self) -> int:
        return self.num_waiting + len(self.running)

    # ---- one step -------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        """Build the batch for one step (see module docstring)."""
        out = SchedulerOutput()
        self._forks_granted = 0  # seats promised to parallel samples in this step (_scheduled)
        budget = self.config.max_num_batched_tokens
        budget = self._schedule_running(out, budget)
        if not out.preempted_ids:
            self._schedule_waiting(out, budget)
        now = time.monotonic()
        for item in out.scheduled:
            if item.request.first_scheduled_time is None:
                item.request.first_scheduled_time = now
        if self.config.num_scheduler_steps > 1:
            self._reserve_window(out)
        return self._finish_batch(out)

    def while_step_runs(self, out: SchedulerOutput) -> None:
        """Host work that overlaps the step ``out`` (launched by :meth:`schedule`), taken out of the next
        :meth:`update_from_output` and :meth:`schedule`. With prefix caching: register the full blocks the step
        computes (a prefill chunk's prompt blocks), and hash the blocks of the requests waiting next, up to
        one step's token budget (their prefix lookups then only read the pool's table)."""
        kv = self.kv
        if not kv.enable_prefix_caching:
            return
        if out.num_steps == 1:
            for item in out.scheduled:
                request = item.request
                if not request.is_finished:
                    kv.cache_blocks(request, request.num_computed_tokens + item.num_scheduled_tokens)
        budget = self.config.max_num_batched_tokens
        for request in self.policy:  # the admission order under fcfs; any order is correct
            if budget <= 0:
                break
            kv.hash_prompt(request)
            budget -= request.num_tokens

    def _finish_batch(self, out: SchedulerOutput) -> SchedulerOutput:
        """The last of :meth:`schedule` and :meth:`schedule_ahead`: the block swaps and copies the batch's
        allocations queued, and the adapters' device slots."""
        ops = self.kv.take_block_ops()
        out.blocks_to_swap_out, out.blocks_to_copy, out.blocks_to_swap_in = ops.swap_out, ops.copy, ops.swap_in
        if self.lora_slots is not None:
            out.lora_slots, out.lora_loads = self.lora_slots.assign(item.request for item in out.scheduled)
        return out

    def _reserve_window(self, out: SchedulerOutput, num_pending: int = 0) -> None:
        """Multi-step scheduling: let a decode-only batch run several steps (``out.num_steps``)
        when :func:`.decode_windows.window_size` allows and the KV pool holds the window."""
        admission_possible = bool(self.num_waiting) and len(self.running) < self.config.max_num_seqs
        num_steps = window_size(out, self.window_limit, self.config.max_model_len, admission_possible, num_pending)
        if num_steps > 1 and reserve_window(out, self.kv, num_steps):
            out.num_steps = num_steps

    def _num_new_tokens(self, request: Request, budget: int, num_hit_tokens: int = 0) -> int:
        num_new = request.num_tokens - request.num_computed_tokens - num_hit_tokens
        if self.config.enable_chunked_prefill:
            return min(num_new, budget)
        return num_new if num_new <= budget else 0

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        self.policy.order_running(self.running)
        if self.fair_share is not None:  # tenants furthest below their share first, stable within one
            self.running[:] = self.fair_share.order_running(self.running)
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            num_new = self._num_new_tokens(request, budget)
            if num_new == 0:
                index += 1
                continue
            while not self.kv.allocate_slots(request, num_new):
                victim = self.running[-1] if self.fair_share is None else self.fair_share.pick_victim(self.running, index)
                self._preempt(victim)
                out.preempted_ids.append(victim.request_id)
                if victim is request:
                    break
            else:
                out.scheduled.append(self._scheduled(request, num_new))
                budget -= num_new
                index += 1
        return budget

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        order = None  # the policy's own order; with tenant shares, weighted fair queuing over tenants
        if self.fair_share is not None and self.policy:
            order = iter(self.fair_share.order_waiting(list(self.policy), self.running, self.config.max_num_seqs))
        elif self.fair_share is not None and len(self.running) != self._observed_running:
            # Nothing waits, and a request ended: a tenant may have gone idle. Observed so that a tenant
            # served alone meanwhile owes nothing when the others return (not every step: the hot path).
            self.fair_share.observe((), self.running)
        self._observed_running = len(self.running)
        lora_active = None
        if self.lora_slots is not None and self.policy:  # some may wait behind the step's adapter limit
            lora_active = self.lora_slots.active_keys(self.running)
            order = order if order is not None else iter(self.policy.in_order())
        # seats promised to this step's forks count as taken: a step samples at most max_num_seqs rows
        while self.policy and budget > 0 and len(self.running) + self._forks_granted < self.config.max_num_seqs:
            request = self.policy.peek() if order is None else next(order, None)
            if request is None:
                break
            if lora_active is not None:
                if not self.lora_slots.admits(request, lora_active):
                    continue  # its adapter would exceed max_loras: it waits, the next may run
                if request.lora_adapter is not None:
                    lora_active.add(request.lora_adapter.key)
            num_new = self._allocate_waiting(request, budget)
            if num_new == 0:
                break
            self.policy.remove(request)
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            out.scheduled.append(self._scheduled(request, num_new))
            budget -= num_new

    def _allocate_waiting(self, request: Request, budget: int) -> int:
        """Hold blocks for a waiting request (its swapped-out blocks, or its prefix hit, then new
        ones); returns the tokens it computes in this step, 0 when it cannot run now (nothing is
        held then)."""
        if request.is_swapped:
            num_new = self._num_new_tokens(request, budget)
            return num_new if num_new and self.kv.swap_in(request, num_new) else 0
        hit = self.kv.get_computed_blocks(request)
        num_new = self._num_new_tokens(request, budget, hit.num_tokens)
        if num_new == 0 or not self.kv.allocate_slots(request, num_new, hit):
            return 0
        return num_new

    def _scheduled(self, request: Request, num_new: int) -> ScheduledRequest:
        samples = request.num_computed_tokens + num_new == request.num_tokens
        forks = self.parallel.forks_of(request, samples,
                                       self.config.max_num_seqs - len(self.running) - self._forks_granted)
        self._forks_granted += len(forks)
        return ScheduledRequest(request, num_new, samples, forks)

    def _preempt(self, request: Request) -> None:
        """Swap the request's KV out (``preemption_mode="swap"``, while the swap space has room),
        else drop it to recompute; requeue the request (at the front under fcfs)."""
        self.running.remove(request)
        if not (self.config.preemption_mode == "swap" and self.kv.swap_out(request)):
            self.kv.free(request)
            request.num_computed_tokens = 0
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        self.num_preemptions_total += 1
        self.policy.requeue(request)

    # ---- scheduling ahead (async scheduling) -------------------------------------------
    def can_schedule_ahead(self, prev: SchedulerOutput, max_model_len: int) -> bool:
        """Whether the step after ``prev`` (still running on the device) is known without its
        tokens: ``prev`` decoded every running request, in running order, nothing waits that could
        be admitted (a request waiting while every one of ``max_num_seqs`` seats is taken, as under a
        tenant's flood, waits for a request to end, after which the next step is scheduled normally),
        and no request can finish by length with ``prev``'s token. Then the next step decodes the same
        requests again, whatever tokens ``prev`` samples (a request that ``prev`` ends with EOS or
        a stop string computes one token that is thrown away). With multi-step scheduling the rule
        is :func:`.decode_windows.rows_ahead`'s. Not while a request is short of ``min_tokens``: its ban on
        stop tokens is built from the tokens appended so far, which would not count ``prev``'s. A request
        whose output follows a grammar may run ahead: the runner fills its bitmask once ``prev``'s
        token is on the host, while the device runs the forward pass (``ModelRunner.execute_async``)."""
        if (self.num_waiting and len(self.running) < self.config.max_num_seqs) or prev.preempted_ids:
            return False  # a waiting request may be admitted now (with every seat taken it waits anyway)
        if self.config.num_scheduler_steps > 1:
            self._rows_ahead = rows_ahead(prev, self.running, max_model_len)  # schedule_ahead's batch
            return self._rows_ahead is not None
        if len(self.running) != len(prev.scheduled):
            return False
        for item, request in zip(prev.scheduled, self.running):  # properties inlined: the hot path
            if (item.request is not request or item.num_scheduled_tokens != 1 or not item.samples or item.forks
                    or len(request.output_token_ids) + 1 >= request.max_tokens
                    or len(request.all_token_ids) + 1 >= max_model_len
                    or len(request.output_token_ids) < request.sampling_params.min_tokens):
                return False
        return True

    def schedule_ahead(self, prev: SchedulerOutput) -> SchedulerOutput | None:
        """The decode step after ``prev`` (after :meth:`can_schedule_ahead`): one token per request,
        whose input is the token ``prev`` samples on the device. First advances ``prev``'s requests
        as :meth:`update_from_output` would (it then only appends ``prev``'s tokens). None when the
        KV pool cannot hold the new tokens (the regular :meth:`schedule` then preempts); slots
        already given stay with their requests.

        With multi-step scheduling: the requests of ``prev`` still running (``out.input_rows``
        when some have left), their input the token of ``prev``'s last step, and a window itself
        when :func:`.decode_windows.window_size` allows."""
        self.step_updater.advance_ahead(prev, self.fair_share)
        if self.config.num_scheduler_steps > 1:
            rows = self._rows_ahead
            out = SchedulerOutput(scheduled=[prev.scheduled[row] for row in rows],
                                  input_rows=None if len(rows) == len(prev.scheduled) else rows)
        else:  # prev's items are exactly this step's: one token each, sampled, no forks (can_schedule_ahead)
            out = SchedulerOutput(scheduled=list(prev.scheduled))
        if not self.kv.allocate_decode_slots([item.request for item in out.scheduled]):
            return None
        if self.config.num_scheduler_steps > 1:  # prev's tokens are not appended yet
            self._reserve_window(out, num_pending=prev.num_steps)
        return self._finish_batch(out)

    # ---- after a step ---------------------------------------------------------------------
    def update_from_output(self, scheduler_output: SchedulerOutput,
                           runner_output: ModelRunnerOutput) -> SchedulerUpdate:
        """Update the requests after ``scheduler_output`` ran: advance ``num_computed_tokens`` (and the
        prefix cache, the tenants' charges, the forks of parallel samples) unless
        :meth:`schedule_ahead` already did, append the sampled tokens and finish the requests their
        ids end (:mod:`.token_appends`). Requests finished while the step ran (aborted, or ended by a
        stop string) append nothing: the token they sampled is dropped. See :mod:`.step_update`.

        Returns:
            The tokens appended per request and the prompt-logprob chunks (typed records), for the
            output processor.
        """
        return self.step_updater.update(scheduler_output, runner_output, self.fair_share)
