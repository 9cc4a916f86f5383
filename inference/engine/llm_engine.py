"""``LLMEngine``: add requests, call ``step()`` repeatedly, collect output deltas.

Each ``step()`` is schedule -> execute -> update (vLLM v1's engine core shape); the engine
does no I/O, so it can be driven by the offline ``LLM`` or by a serving worker's loop.
"""
from __future__ import annotations

import collections
import itertools
import logging
import time
from concurrent.futures import FIRST_COMPLETED
from concurrent.futures import wait as wait_futures
from collections.abc import Mapping

from ..config import EngineConfig
from ..sched.decode_windows import DecodeStepClock
from ..sched.fair_share import FairShare
from ..sched.scheduler import Scheduler
from ..sched.scheduler_output import SchedulerOutput, SchedulerUpdate
from ..errors import InvalidRequestError
from ..kv_cache import KVCacheManager
from ..lora.registry import LoRARegistry
from ..lora.request import LoRARequest
from ..lora.slots import LoRASlots
from ..model_loader import load_tokenizer
from ..outputs import RequestOutput
from ..request import Request, RequestStatus
from ..runner import ModelRunner
from ..sampling_params import SamplingParams
from ..structured_output.compiler import GrammarCompiler, GrammarState
from ..validation import validate_priority, validate_prompt, validate_text
from .arg_utils import EngineArgs
from .iteration_stats import IterationTokens
from .output_processor import OutputProcessor
from .stats import EngineStats

logger = logging.getLogger(__name__)
GRAMMAR_WAIT = 0.005  # seconds step() waits for a compiling grammar when nothing else runs


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
        self.lora_registry: LoRARegistry | None = None
        if config.lora is not None:  # the start-up adapters are checked before the model loads
            self.lora_registry = LoRARegistry(config.lora, config.hf_config, config.dtype)
            for module in config.lora.modules:
                self.lora_registry.add(module)
            if len(config.lora.modules) > config.lora.max_cpu_loras:
                logger.warning("%d start-up LoRA adapters and max_cpu_loras=%d: all were checked, %d stay loaded; "
                               "the others are read from disk again when a request names them (raise "
                               "--max-cpu-loras to keep them all)", len(config.lora.modules),
                               config.lora.max_cpu_loras, config.lora.max_cpu_loras)
        self.tokenizer = load_tokenizer(config.tokenizer)
        self.runner = make_runner(config, num_kv_blocks)
        self.kv_cache_manager = KVCacheManager(self.runner.num_blocks, config.cache.block_size,
                                               enable_prefix_caching=config.cache.enable_prefix_caching,
                                               num_cpu_blocks=self.runner.num_cpu_blocks)
        self.scheduler = Scheduler(config.scheduler, self.kv_cache_manager,
                                   LoRASlots(config.lora.max_loras) if config.lora is not None else None)
        self.eos_token_ids = _eos_token_ids(self.tokenizer, config.hf_config)
        self.output_processor = OutputProcessor(self.tokenizer)
        self._grammar_compiler: GrammarCompiler | None = None
        self._awaiting_grammar: list[str] = []  # parent ids whose grammar compiles (not yet scheduled)
        if config.device != "cpu":  # a long-lived GPU server: the vocabulary's grammar tables off the first request
            self.grammar_compiler.prewarm()
        self._aborted_outputs: list[RequestOutput] = []
        self._inflight = None  # (SchedulerOutput, StepHandle) of the launched, not yet collected step
        self.device_wait_seconds = 0.0  # host time spent waiting for launched steps (s); ~0 means host-bound
        self.num_steps_ahead = 0  # steps launched before the previous step's tokens were back
        self.num_multi_step_windows = 0  # steps that ran several decode steps (num_scheduler_steps > 1)
        self.decode_clock = DecodeStepClock()  # decode-only launches by length, and one decode step's time
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
                    cache_salt: str | None = None, tenant_id: str | None = None,
                    lora_request: LoRARequest | None = None) -> str:
        """Queue a request; returns its id (generated when ``request_id`` is None).

        Args:
            prompt: text (tokenized with the model's tokenizer, special tokens added) or token ids.
            arrival_time: ``time.monotonic()`` seconds of arrival (now when None).
            priority: lower runs earlier under ``scheduling_policy="priority"``.
            prompt_text: the text of a prompt given as token ids, echoed in the outputs.
            cache_salt: prefix-cache key: requests share cached blocks only with requests of the
                same salt (one per tenant keeps tenants from hitting, or timing, each other's prompts).
            tenant_id: whose GPU share the request runs on (see :meth:`set_tenant_shares`).
            lora_request: the LoRA adapter to run with (loaded first when it is not, see :meth:`add_lora`).
        Raises:
            InvalidRequestError: a duplicate id, ``params`` not a ``SamplingParams``, a prompt/params outside
                the limits, a priority that is not an integer, or other than 0 under the ``fcfs`` policy,
                a ``lora_request`` without ``enable_lora`` or whose adapter does not load (nothing is queued).
        """
        request_id = request_id if request_id is not None else str(next(self._counter))
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError(f"params must be a SamplingParams, got {type(params).__name__}.", param="params")
        if request_id in self.output_processor:
            raise InvalidRequestError(f"request_id {request_id!r} is already in use.", param="request_id")
        validate_priority(priority, self.config.scheduler.scheduling_policy)
        priority = int(priority)  # a NumPy integer too
        if isinstance(prompt, str):
            validate_text(prompt, "prompt")
            text, token_ids = prompt, self.tokenizer.encode(prompt)
        else:
            text, token_ids = prompt_text, [int(t) for t in prompt]
        max_tokens = validate_prompt(token_ids, params, self.max_model_len, self.runner.vocab_size)
        adapter = None if lora_request is None else self._lora_registry(lora_request).get(lora_request)
        params = params.clone(eos_token_ids=self.eos_token_ids)
        children = []
        for index in range(params.n):
            child_id = request_id if params.n == 1 else f"{request_id}#{index}"
            children.append(Request(child_id, request_id, index, token_ids, params, max_tokens,
                                    arrival_time, priority, cache_salt, tenant_id, adapter))
        self.output_processor.add_request(request_id, text, token_ids, children)
        if params.structured_outputs is not None:
            compiled = self.grammar_compiler.compile(params.structured_outputs)
            for child in children:
                child.grammar = GrammarState(compiled)
            if not compiled.done():  # compiles on its own thread; scheduled once done (_admit_compiled)
                self._awaiting_grammar.append(request_id)
                return request_id
        self.scheduler.add_request(children[0], followers=children[1:])  # one prefill for all n samples
        return request_id

    # ---- LoRA adapters -----------------------------------------------------------------
    def _lora_registry(self, lora_request) -> LoRARegistry:
        if self.lora_registry is None:
            raise InvalidRequestError(f"lora_request {getattr(lora_request, 'lora_name', lora_request)!r}: LoRA is "
                                      "not enabled; start the engine with enable_lora=True (--enable-lora).",
                                      param="lora_request")
        return self.lora_registry

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Load a LoRA adapter into host memory (checked against the model), as vLLM's ``add_lora``; the least
        recently used one is evicted beyond ``max_cpu_loras``. Returns False when it was already loaded.

        Raises:
            InvalidRequestError: LoRA is off, the id is loaded under another name or path, or the adapter does
                not load or fit (the parameter and the limit named; nothing changes).
        """
        return self._lora_registry(lora_request).add(lora_request)

    def remove_lora(self, lora_int_id: int) -> bool:
        """Unload an adapter from host memory; False when it was not loaded (or LoRA is off). Requests already
        queued with it still run with it."""
        return self.lora_registry is not None and self.lora_registry.remove(lora_int_id)

    def list_loras(self) -> set[int]:
        """The ids of the adapters loaded in host memory (empty when LoRA is off)."""
        return set() if self.lora_registry is None else self.lora_registry.ids()

    def _lora_stats(self) -> dict:
        if self.config.lora is None:
            return {}
        running = {r.lora_name for r in self.scheduler.running if r.lora_adapter is not None}
        waiting = {r.lora_name for r in self.scheduler.requests.values()
                   if r.lora_adapter is not None and r.status != RequestStatus.RUNNING}
        parents = self.output_processor.parents
        waiting.update(parents[rid].children[0].lora_name for rid in self._awaiting_grammar
                       if rid in parents and parents[rid].children[0].lora_adapter is not None)
        return dict(lora_running_adapters=tuple(sorted(running)), lora_waiting_adapters=tuple(sorted(waiting)),
                    max_lora=self.config.lora.max_loras)

    @property
    def grammar_compiler(self) -> GrammarCompiler:
        """Compiles and caches the grammars of structured-output requests (made on first use)."""
        if self._grammar_compiler is None:
            self._grammar_compiler = GrammarCompiler(self.tokenizer, self.runner.vocab_size, self.eos_token_ids)
        return self._grammar_compiler

    def _admit_compiled(self) -> None:
        """Schedule the requests whose grammar finished compiling; end those whose compilation
        failed (finish reason ``abort``). When nothing else runs, wait a moment for one."""
        parents = self.output_processor.parents
        waiting = [parents[rid].children[0].grammar.compiled for rid in self._awaiting_grammar if rid in parents]
        if waiting and self._inflight is None and not self.scheduler.num_unfinished:
            wait_futures(waiting, timeout=GRAMMAR_WAIT, return_when=FIRST_COMPLETED)
        still = []
        for request_id in self._awaiting_grammar:
            parent = parents.get(request_id)
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
        unstarted = [p for p in self.output_processor.parents.values()
                     if all(c.status == RequestStatus.WAITING and c.num_computed_tokens == 0
                            and c.num_output_tokens == 0 for c in p.children)]
        unstarted.sort(key=lambda p: p.children[0].arrival_time)
        return [(p.request_id, p.children[0].tenant_id) for p in unstarted]

    def abort_request(self, request_ids: str | list[str], report: bool = True) -> dict[str, int]:
        """Abort requests at once: their blocks return to the pool, and (with ``report``) the next
        ``step()`` reports them with ``finish_reason="abort"``. Unknown or finished ids (and None) are ignored.

        Returns:
            request id -> prompt tokens computed when it was aborted (prefix-cache hits included; the most of its
            samples), for each request aborted: what a server charges a request whose client left before its
            first token.
        """
        if request_ids is None:
            return {}
        computed: dict[str, int] = {}
        in_flight = self._in_flight_tokens()
        for request_id in [request_ids] if isinstance(request_ids, str) else list(request_ids):
            aborted = self.output_processor.abort(request_id)
            if aborted is None:
                continue
            unfinished, output = aborted
            computed[request_id] = max((min(c.num_computed_tokens + in_flight.get(id(c), 0), c.num_prompt_tokens)
                                        for c in unfinished), default=0)
            for child in unfinished:
                self.scheduler.finish_request(child, RequestStatus.FINISHED_ABORTED)
            if report:
                self._aborted_outputs.append(output)
        return computed

    def _in_flight_tokens(self) -> dict[int, int]:
        """``id(request) -> tokens`` the step on the device computes for it, where its ``num_computed_tokens``
        does not count them yet (a single step not advanced ahead)."""
        if self._inflight is None:
            return {}
        out = self._inflight[0]
        if out.num_steps > 1 or self.scheduler.step_updater.advanced(out):
            return {}
        return {id(item.request): item.num_scheduled_tokens for item in out.scheduled}

    def has_unfinished_requests(self) -> bool:
        return bool(self.output_processor) or bool(self._aborted_outputs) or self._inflight is not None

    def get_num_unfinished_requests(self) -> int:
        return len(self.output_processor)

    # ---- the step --------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One iteration, schedule -> execute -> update, pipelined so that the device never waits
        for detokenization:

        1. wait for the tokens of the step launched by the previous call; the scheduler appends
           them and finishes the requests their ids end (EOS, stop tokens, lengths, a grammar),
           returning typed records (``Scheduler.update_from_output``);
        2. schedule and launch the next step (the device starts on it);
        3. while it runs, the output processor detokenizes the records of 1 (stop strings,
           logprobs) into deltas; the requests a stop string ended are then finished in the scheduler;
           then the scheduler's prefix-cache work for the next step (``Scheduler.while_step_runs``).

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
        if self._inflight is None:  # idle since the last launch came back: not a step's time, nor the host's
            self.decode_clock.restart()
        ahead = self._launch_ahead()
        update = self._finish_inflight()
        launched = None
        if ahead is not None:
            self._inflight = ahead
        else:
            sched_out = self.scheduler.schedule()
            if not sched_out.is_empty:
                self._inflight = (sched_out, self.runner.execute_async(sched_out))
                launched = sched_out
            else:  # nothing runs; a step that preempted every running request still swaps
                self.runner.apply_block_ops(sched_out)
                if ((update is None or update.is_empty) and self.scheduler.num_unfinished
                        and not self.scheduler.running and not sched_out.preempted_ids):
                    raise RuntimeError("Scheduler made no progress: KV pool too small for the waiting request")
        if update is not None:
            processed = self.output_processor.process(update)
            self.scheduler.finish_requests(processed.stopped_request_ids, RequestStatus.FINISHED_STOPPED)
            self.generation_tokens_total -= processed.num_dropped_tokens
            outputs.extend(processed.request_outputs)
        if launched is not None:
            self.scheduler.while_step_runs(launched)
        return outputs

    def _launch_ahead(self):
        """With async scheduling, launch the step after the one in flight before waiting for it
        (see ``Scheduler.can_schedule_ahead``); returns the new in-flight entry, or None."""
        if not self.config.scheduler.async_scheduling or self._inflight is None:
            return None
        sched_out, handle = self._inflight
        if not self.scheduler.can_schedule_ahead(sched_out, self.max_model_len):
            return None
        ahead = self.scheduler.schedule_ahead(sched_out)  # advances sched_out's requests first
        if ahead is None:
            return None
        self.num_steps_ahead += 1
        return ahead, self.runner.execute_async(ahead, input_ids=handle.device_token_ids, prev=handle)

    def _finish_inflight(self) -> SchedulerUpdate | None:
        """Step 1 of ``step()``: wait for the step in flight and let the scheduler update the
        requests from its output; None when nothing was in flight."""
        if self._inflight is None:
            return None
        sched_out, handle = self._inflight
        self._inflight = None
        waited = time.perf_counter()
        runner_out = handle.result()
        finished = time.perf_counter()
        self.device_wait_seconds += finished - waited
        # a grammar's bitmask waited for these tokens earlier, while the next step was launched ahead
        self._measure_decode_step(sched_out, min(waited, handle.waited_at or waited), finished, handle.device_seconds)
        update = self.scheduler.update_from_output(sched_out, runner_out)
        if sched_out.num_steps > 1:
            kept = [len(record.token_ids) for record in update.sampled]  # tokens appended per request
            self.generation_tokens_total += sum(kept)
            self.iteration_tokens.observe_window(kept)
            self.num_multi_step_windows += 1
        else:  # one record per sampled token
            generated = len(update.sampled)
            self.prompt_tokens_total += update.num_prompt_tokens
            self.generation_tokens_total += generated
            self.prompt_tokens_computed_total += update.num_prompt_tokens_computed
            self.iteration_tokens.observe(update.num_prompt_tokens + generated)
        return update

    @property
    def window_steps(self) -> collections.Counter:
        """Decode-only launches by their number of steps."""
        return self.decode_clock.window_steps

    @property
    def decode_step_seconds(self) -> float | None:
        """Moving average of one decode step's time (s): each decode-only launch's device time on CUDA; elsewhere
        the wall time between two decode-only launches' returns. None before it was measured."""
        return self.decode_clock.step_seconds

    def _measure_decode_step(self, sched_out: SchedulerOutput, waited: float, finished: float,
                             device_seconds: float | None) -> None:
        """Time decode-only steps (and the host's iterations between them) and, with adaptive windows, size the
        next windows from them."""
        clock = self.decode_clock
        seconds = clock.observe(sched_out, finished, device_seconds, waited)
        if seconds is not None and self.config.scheduler.adaptive_windows:
            self.scheduler.window_limit = clock.choose_window(self.config.scheduler.num_scheduler_steps)

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
                           iteration_tokens_sum=self.iteration_tokens.sum, **self._lora_stats())
