"""The model runner: owns the weights and KV cache tensors, runs one step on the device."""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from ..config import EngineConfig
from ..host_to_device import tensor_to_device
from ..sched.decode_windows import window_lengths
from ..sched.scheduler_output import ModelRunnerOutput, SchedulerOutput
from ..attention import resolve_backend
from ..attention import kv_scales
from ..attention.kv_quant import FP8_DTYPE, kv_cache_torch_dtype
from ..distributed.partition import head_partition
from ..distributed.process_group import TensorParallelGroup
from ..lora.checkpoint import LoRAAdapter
from ..model_loader import iter_weights
from ..models import blas_choice, build_model
from ..models.parallel_layers import SINGLE_RANK
from ..quantization import held_dequantized_bytes
from ..sampling import Sampler, SamplingMetadata, compute_topk_logprobs
from ..structured_output.bitmask import apply_token_bitmask_, bitmask_width
from .cuda_graph import decode_split_plan, graph_batch_sizes
from .block_ops import copy_blocks, swap_blocks
from .input_batch import HostBatch, device_inputs, host_batch
from .multi_step import MultiStepHandle, run_decode_window
from .step_handle import StepHandle
from .kv_sizing import GiB, bytes_per_block, device_memory_check, num_swap_blocks
from .kv_sizing import num_kv_blocks as kv_sizing_num_blocks

logger = logging.getLogger(__name__)


@dataclass
class StepPlan:
    """The host-side description of one step, the same for every tensor-parallel rank.

    Attributes:
        blocks_to_swap_out, blocks_to_copy, blocks_to_swap_in: ``(source, destination)`` block ids
            (see ``SchedulerOutput``), applied in that order before the forward pass.
        batch: the step's flattened inputs; None when no request runs (block operations only).
        ahead: a decode step scheduled ahead: its input ids are the previous step's tokens, on rank 0's
            device; rank 0 broadcasts them to the other ranks.
        lora_loads: ``(slot, adapter)`` LoRA weights to copy into the device slots before the step (each rank
            takes its part; the adapters travel to the other ranks in the plan, only when a slot changes).
    """

    blocks_to_swap_out: list[tuple[int, int]]
    blocks_to_copy: list[tuple[int, int]]
    blocks_to_swap_in: list[tuple[int, int]]
    batch: HostBatch | None
    ahead: bool = False
    lora_loads: list[tuple[int, LoRAAdapter]] = field(default_factory=list)


class ModelRunner:
    """Loads the model, sizes and allocates the paged KV cache, and executes scheduled steps.

    KV cache: one tensor per layer, ``[2, num_blocks, block_size, num_kv_heads, head_dim]``
    in the model dtype (index 0 = keys, 1 = values). With ``preemption_mode="swap"``, a CPU swap
    space of the same layout with ``num_cpu_blocks`` blocks (pinned memory on CUDA).

    With tensor parallelism there is one runner per rank (``tp``), each holding its part of the
    weights and its KV heads; every rank has the same number of blocks (the smallest any rank can
    hold) and runs the same :class:`StepPlan`; only rank 0 samples.
    """

    def __init__(self, config: EngineConfig, num_kv_blocks: int | None = None,
                 tp: TensorParallelGroup = SINGLE_RANK) -> None:
        self.config = config
        self.device = config.device
        self.tp = tp
        hf = config.hf_config
        weights = None if config.load_format == "dummy" else iter_weights(config.model_dir)
        torch.manual_seed(config.seed)
        self.model = build_model(hf, config.dtype, self.device, config.max_model_len, weights,
                                 check_fits=device_memory_check(config), quant_config=config.quant_config, tp=tp)
        self.lora = self._wrap_lora(config)
        self.vocab_size = hf.vocab_size
        self.num_layers = hf.num_hidden_layers
        num_kv_heads = getattr(hf, "num_key_value_heads", None) or hf.num_attention_heads
        self.num_kv_heads = head_partition(hf.num_attention_heads, num_kv_heads, tp.world_size, tp.rank).num_kv_heads
        self.head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
        self.block_size = config.cache.block_size
        self.weights_bytes = (sum(p.numel() * p.element_size() for p in self.model.parameters())
                              + held_dequantized_bytes(self.model))
        if self.lora is not None:
            self.weights_bytes += self.lora.num_bytes
        self.kv_dtype = kv_cache_torch_dtype(config.cache.cache_dtype, config.dtype)
        self.bytes_per_block = bytes_per_block(config, self.num_layers, self.num_kv_heads, self.head_dim)
        self.num_blocks = tp.min_over_ranks(num_kv_blocks or kv_sizing_num_blocks(
            config, self.model, self.weights_bytes, self.bytes_per_block, self.num_kv_heads, self.head_dim),
            self.device)
        self.kv_caches = [self._zeros((2, self.num_blocks, self.block_size, self.num_kv_heads, self.head_dim))
                          for _ in range(self.num_layers)]
        self.num_cpu_blocks = 0
        self.cpu_kv_caches: list[torch.Tensor] = []
        if config.scheduler.preemption_mode == "swap":
            self.num_cpu_blocks = num_swap_blocks(config, self.bytes_per_block)
            self.cpu_kv_caches = [self._zeros((2, self.num_cpu_blocks, self.block_size, self.num_kv_heads,
                                               self.head_dim), cpu=True) for _ in range(self.num_layers)]
        self.sampler = Sampler()
        self._sampling_cache: tuple[list, SamplingMetadata] | None = None
        self.attention_backend = resolve_backend(config.attention_backend, self.device)
        self.graph_runner = None
        self.window_graphs = None
        self.piecewise_graphs = None
        self._graph_sizes = graph_batch_sizes(config.scheduler.max_num_seqs)
        self._max_seq_len = -(-config.max_model_len // self.block_size) * self.block_size
        self.kv_scales = self._kv_scales(config)  # before the graphs capture them
        self.graph_memory_bytes = 0  # device memory the captured graphs took (their pools), measured at capture
        self.blas_choice: blas_choice.BlasChoice | None = None  # cuBLAS or cuBLASLt per dense GEMM in the graphs
        if self.device.startswith("cuda") and not config.enforce_eager and self.attention_backend == "triton":
            self._capture_graphs(config, tp)
        self._log_memory()

    def _kv_scales(self, config: EngineConfig) -> str:
        """Where an FP8 cache's per-layer scales come from (checkpoint, calibration or 1.0: see
        :mod:`inference.attention.kv_scales`), calibrating them if need be; "" without an FP8 cache."""
        if self.kv_dtype != FP8_DTYPE:
            return ""
        if getattr(self.model, "kv_scales_from_checkpoint", False):
            return "from the checkpoint"
        if not config.cache.calculate_kv_scales:
            return "1.0 (--no-calculate-kv-scales)"
        sequences = kv_scales.calibration_sequences(
            config.tokenizer, min(self.num_blocks * self.block_size, config.max_model_len))
        if not sequences:
            return "1.0 (no tokenizer to calibrate with)"
        # a cache of the model's dtype for the calibration prompts: every layer sees the keys and values of the
        # layers before it unrounded, so the scales are those of the model, not of a 1.0-scaled FP8 cache
        blocks = -(-max(map(len, sequences)) // self.block_size)
        float_caches = [torch.zeros((2, blocks, self.block_size, self.num_kv_heads, self.head_dim),
                                    dtype=config.dtype, device=self.device) for _ in range(self.num_layers)]
        scales = kv_scales.calibrate(self.model, sequences, float_caches, self.block_size, self.device,
                                     self.attention_backend, self.tp)
        return (f"calibrated on {len(sequences)} prompts of {max(map(len, sequences))} tokens or fewer: "
                f"{kv_scales.describe(scales)}")

    def _wrap_lora(self, config: EngineConfig):
        """With LoRA on, wrap the model's projections with their adapter slots (:mod:`inference.lora.layers`)."""
        if config.lora is None:
            return None
        from ..lora.layers import LoRAModel  # noqa: PLC0415
        sched = config.scheduler
        return LoRAModel(self.model, config.lora.max_loras, config.lora.max_lora_rank,
                         max(sched.max_num_batched_tokens, sched.max_num_seqs), config.dtype, self.device)

    def _capture_graphs(self, config: EngineConfig, tp: TensorParallelGroup) -> None:
        """Capture the decode-step graphs (and, with ``num_scheduler_steps > 1`` on one rank, the window
        graphs; on one rank, the piecewise graphs of steps that compute prompt tokens); log how
        long that took and the device memory it took, as vLLM does."""
        from . import piecewise_graph, window_graph  # noqa: PLC0415
        from .cuda_graph import CudaGraphRunner  # noqa: PLC0415
        piecewise = tp.world_size == 1 and piecewise_graph.ENABLED
        token_sizes = piecewise_graph.piecewise_token_sizes(config.scheduler.max_num_batched_tokens) if piecewise else []
        self.blas_choice = choice = blas_choice.choose(self.model, self._graph_sizes + token_sizes)
        torch.cuda.empty_cache()  # the timing graphs' memory, before the graphs' own is measured
        (logger.warning if choice.error else logger.info)("Dense GEMMs in the CUDA graphs: %s", choice.describe())
        started, free_before = time.perf_counter(), torch.cuda.mem_get_info(self.device)[0]
        if self.lora is not None:  # the graphs launch the LoRA kernels in every step, with adapters or not
            self.lora.batch.static = True
        max_blocks = -(-config.max_model_len // self.block_size)
        self.graph_runner = CudaGraphRunner(self.model, self.kv_caches, config.scheduler.max_num_seqs,
                                            max_blocks, self.block_size, self.num_kv_heads, self.device)
        self.graph_runner.capture()
        if config.scheduler.num_scheduler_steps > 1 and tp.world_size == 1 and window_graph.ENABLED:
            lengths = window_lengths(config.scheduler.num_scheduler_steps, config.scheduler.adaptive_windows)
            self.window_graphs = window_graph.DecodeWindowGraphs(
                self.graph_runner, self.model.compute_logits, lengths[-1:] if window_graph.LONGEST_ONLY else lengths)
            self.window_graphs.capture()
        if piecewise:
            self.piecewise_graphs = piecewise_graph.PiecewiseGraphRunner(
                self.model, self.kv_caches, token_sizes, self.block_size, self.attention_backend)
            self.piecewise_graphs.capture()
        self.graph_memory_bytes = max(free_before - torch.cuda.mem_get_info(self.device)[0], 0)
        windows = f", windows of {self.window_graphs.lengths} steps" if self.window_graphs else ""
        if self.piecewise_graphs is not None:
            windows += f" and piecewise graphs for {len(self.piecewise_graphs.sizes)} token counts"
        logger.info("CUDA graphs captured for %d batch sizes%s in %.1f s; they took %.2f GiB",
                    len(self.graph_runner.sizes), windows, time.perf_counter() - started,
                    self.graph_memory_bytes / GiB)

    def _zeros(self, shape: tuple[int, ...], cpu: bool = False) -> torch.Tensor:
        """A zeroed KV tensor on the device (or on the CPU, pinned when the device is CUDA). On CPU
        it comes from calloc (numpy), whose large allocations are zero pages mapped lazily, so a
        multi-GiB pool costs nothing until blocks are written."""
        if cpu and self.device != "cpu":
            return torch.zeros(shape, dtype=self.kv_dtype, pin_memory=True)
        if self.device != "cpu" or self.kv_dtype == torch.bfloat16:
            return torch.zeros(shape, dtype=self.kv_dtype, device=self.device)
        if self.kv_dtype == FP8_DTYPE:  # zero bytes are e4m3 zeros
            return torch.from_numpy(np.zeros(shape, dtype=np.uint8)).view(FP8_DTYPE)
        np_dtype = {torch.float32: np.float32, torch.float16: np.float16}[self.kv_dtype]
        return torch.from_numpy(np.zeros(shape, dtype=np_dtype))

    def _log_memory(self) -> None:
        kv_bytes = self.num_blocks * self.bytes_per_block
        max_len = self.config.max_model_len
        concurrency = self.num_blocks * self.block_size / max_len
        logger.info("Model weights take %.2f GiB; KV cache %.2f GiB (%s) = %d blocks of %d tokens, %d tokens; "
                    "maximum concurrency at max_model_len=%d: %.2fx",
                    self.weights_bytes / GiB, kv_bytes / GiB, str(self.kv_dtype).removeprefix("torch."),
                    self.num_blocks, self.block_size, self.num_blocks * self.block_size, max_len, concurrency)
        if self.kv_scales:
            logger.info("FP8 KV cache scales %s", self.kv_scales)
        if self.num_cpu_blocks:
            logger.info("CPU swap space %.2f GiB = %d blocks", self.num_cpu_blocks * self.bytes_per_block / GiB,
                        self.num_cpu_blocks)

    def execute(self, sched_out: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step and wait for its sampled tokens (``execute_async(...).result()``)."""
        return self.execute_async(sched_out).result()

    def execute_async(self, sched_out: SchedulerOutput, input_ids: torch.Tensor | None = None,
                      prev: "StepHandle | None" = None) -> "StepHandle | MultiStepHandle":
        """Launch the forward pass and sampling of one step without waiting for the device.

        ``input_ids``: for a decode step scheduled ahead, the previous step's sampled tokens on the
        device (``StepHandle.device_token_ids``), one per request in batch order, or per row of the
        previous batch when ``sched_out.input_rows`` picks some. ``prev``: that previous step's
        handle. When a request of the step follows a grammar, its bitmask needs ``prev``'s token:
        the forward pass is launched first, then the host waits for ``prev``'s tokens, advances the
        grammars past them and fills the bitmask while the device computes the logits.

        The sampled tokens (and logprobs) are copied to host memory behind the step on the current
        stream; ``StepHandle.result()`` waits for that copy only, so the caller can do host work
        (detokenizing the previous step) while the device runs this one.
        """
        input_ids = self._ahead_input_ids(sched_out, input_ids)
        return self.run(self.plan(sched_out, ahead=input_ids is not None), sched_out, input_ids, prev)

    @staticmethod
    def _ahead_input_ids(sched_out: SchedulerOutput, input_ids: torch.Tensor | None) -> torch.Tensor | None:
        """The rows of the previous step's tokens ``input_ids`` that ``sched_out`` decodes (all of them
        unless requests left since, see ``SchedulerOutput.input_rows``)."""
        if input_ids is not None and sched_out.input_rows is not None:
            input_ids = input_ids[tensor_to_device(torch.tensor(sched_out.input_rows), input_ids.device)]
        return input_ids

    def apply_block_ops(self, sched_out: SchedulerOutput) -> None:
        """Apply the block copies and swaps of a step in which no request runs."""
        self.run(self.plan(sched_out, with_batch=False))

    def plan(self, sched_out: SchedulerOutput, with_batch: bool = True, ahead: bool = False) -> StepPlan:
        """The step's host-side description (block operations and flattened inputs)."""
        batch = host_batch(sched_out, self.block_size, ahead) if with_batch and not sched_out.is_empty else None
        return StepPlan(sched_out.blocks_to_swap_out, sched_out.blocks_to_copy, sched_out.blocks_to_swap_in, batch,
                        ahead and batch is not None, sched_out.lora_loads)

    @torch.inference_mode()
    def run(self, plan: StepPlan, sched_out: SchedulerOutput | None = None,
            input_ids: torch.Tensor | None = None, prev: "StepHandle | None" = None
            ) -> "StepHandle | MultiStepHandle | None":
        """Run a planned step on this rank.

        Args:
            sched_out: the scheduler's output, on rank 0 only (it samples); the other ranks compute
                the same logits rows for the gather and return a handle without tokens.
            input_ids, prev: a step scheduled ahead, see :meth:`execute_async`.
        Returns:
            The launched step (a window of ``sched_out.num_steps`` decode steps when that is more
            than 1, see :mod:`.multi_step`), or None for a plan without inputs.
        """
        # Host-to-device copies go through pinned memory (inference/host_to_device.py): a copy from
        # pageable memory would wait for the stream, i.e. for the previous step still running.
        self._apply_block_ops(plan)
        if plan.lora_loads:
            self.lora.load(plan.lora_loads)
        if plan.batch is None:
            return None
        if self.lora is not None:
            self.lora.prepare(plan.batch.token_slots)
        if plan.ahead and self.tp is not None and self.tp.world_size > 1:  # rank 0's tokens to every rank
            if input_ids is None:
                input_ids = torch.empty(len(plan.batch.input_ids), dtype=torch.int64, device=self.device)
            input_ids = self.tp.broadcast(input_ids.contiguous())
        inputs = device_inputs(plan.batch, self.block_size, self.device, self.attention_backend, input_ids)
        sampling = []
        if sched_out is not None:
            sampling = [s.request for s in sched_out.scheduled if s.samples]
            if any(s.forks for s in sched_out.scheduled):  # parallel samples sample beside their leader
                sampling = [r for s in sched_out.scheduled for r in s.sampling_requests]
        sampling_meta = self._sampling_metadata(sampling) if sampling else None
        if inputs.meta.decode_only:  # same split plan as the CUDA graphs, graph or not
            inputs.meta.max_seq_len = self._max_seq_len
            inputs.meta.num_splits = decode_split_plan(inputs.input_ids.shape[0], self._graph_sizes,
                                                       self.num_kv_heads, self._max_seq_len, self.device)
        # A decode-only launch's device time sizes the engine's decode windows: timed from here, once its inputs
        # are built, so that the host's preparation is not counted when the device was idle meanwhile.
        start = self._timing_start() if sched_out is not None and sched_out.is_decode_only else None
        if sched_out is not None and sched_out.num_steps > 1:
            if self.window_graphs is not None and self.window_graphs.can_run(inputs, sched_out.num_steps,
                                                                             sampling_meta):
                handle = self.window_graphs.run(inputs, sched_out.num_steps)
            else:
                handle = run_decode_window(self._decode_and_sample, inputs, sampling_meta, sched_out.num_steps,
                                           self.block_size)
            handle.start_event = start
            return handle
        hidden = self._forward(inputs)
        sampled = None
        if plan.batch.logits_rows.size:  # on every rank: the ranks gather the logits together
            logits = self.model.compute_logits(hidden[inputs.logits_indices])
            if sampling:
                self._apply_grammars(logits, sampling, prev)
                sampled = self.sampler(logits, sampling_meta)
        prompt_logprobs = self._prompt_logprobs(sched_out, inputs, hidden)
        handle = StepHandle(sampling, sampled, prompt_logprobs)
        handle.start_event = start
        return handle

    def _timing_start(self) -> "torch.cuda.Event | None":
        """A timing event recorded now on the current stream (CUDA); None elsewhere."""
        if not self.device.startswith("cuda"):
            return None
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def _forward(self, inputs) -> torch.Tensor:
        """Hidden states ``[T, H]`` of the step's tokens (a CUDA graph replay where one fits)."""
        if self.graph_runner is not None and self.graph_runner.can_run(inputs):
            return self.graph_runner.run(inputs)
        if self.piecewise_graphs is not None and self.piecewise_graphs.can_run(inputs):
            return self.piecewise_graphs.run(inputs)
        return self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.meta)

    def _decode_and_sample(self, inputs, sampling_meta: SamplingMetadata) -> torch.Tensor:
        """One step of a multi-step window: ``[B]`` int64 tokens sampled from the logits rows."""
        hidden = self._forward(inputs)
        return self.sampler(self.model.compute_logits(hidden[inputs.logits_indices]), sampling_meta).token_ids

    @staticmethod
    def _apply_grammars(logits: torch.Tensor, sampling: list, prev: "StepHandle | None" = None) -> None:
        """Structured output: ``-inf`` on the logits ``[N, V]`` of every token a row's grammar does
        not allow next. The bitmask is filled on the host from each grammar's state and applied on
        the device. In a step scheduled ahead (``prev`` given) the grammars are first advanced past
        ``prev``'s tokens, which the host waits for here: the device meanwhile runs this step's
        forward pass, launched before.

        Raises:
            RuntimeError: a constrained request of a step scheduled ahead did not sample in ``prev``.
        """
        rows = [i for i, request in enumerate(sampling) if request.grammar is not None]
        if not rows:
            return
        if prev is not None:
            prev_tokens = {id(request): token for request, token in zip(prev.requests, prev.result().sampled_token_ids)}
            for i in rows:
                token = prev_tokens.get(id(sampling[i]))
                if token is None:
                    raise RuntimeError(f"request {sampling[i].request_id} was scheduled ahead of a step it did not sample in")
                sampling[i].grammar.accept_ahead(token)
        host = torch.empty((len(rows), bitmask_width(logits.shape[1])), dtype=torch.int32, pin_memory=logits.is_cuda)
        for j, i in enumerate(rows):
            sampling[i].grammar.fill_bitmask(host, j)
        bitmask = host.to(logits.device, non_blocking=True)
        apply_token_bitmask_(logits, bitmask, tensor_to_device(torch.tensor(rows), logits.device))

    def _sampling_metadata(self, requests: list) -> SamplingMetadata:
        """The step's sampling tensors; reused while the same requests sample in the same order
        and nothing in them changes from step to step (no penalties, no pending ``min_tokens``),
        as in a steady stream of decode steps."""
        cached = self._sampling_cache
        if (cached is not None and len(cached[0]) == len(requests)
                and all(a is b for a, b in zip(cached[0], requests))):
            return cached[1]
        meta = SamplingMetadata.from_requests(requests, self.vocab_size, self.device)
        self._sampling_cache = (requests, meta) if meta.step_invariant else None
        return meta

    def _apply_block_ops(self, plan: StepPlan) -> None:
        """Swap out, copy on write, swap in (in that order: each reads blocks a later one may write)."""
        if plan.blocks_to_swap_out:
            swap_blocks(self.kv_caches, self.cpu_kv_caches, plan.blocks_to_swap_out)
        if plan.blocks_to_copy:
            copy_blocks(self.kv_caches, plan.blocks_to_copy, self.device)
        if plan.blocks_to_swap_in:
            swap_blocks(self.cpu_kv_caches, self.kv_caches, plan.blocks_to_swap_in)

    def _prompt_logprobs(self, sched_out, inputs, hidden) -> dict:
        if not inputs.prompt_logprob_rows:
            return {}
        requests = {item.request.request_id: item.request for item in sched_out.scheduled} if sched_out else {}
        result = {}
        for request_id, (first, scored) in inputs.prompt_logprob_rows.items():
            logits = self.model.compute_logits(hidden[first:first + len(scored)])
            if logits is None:  # a tensor-parallel rank other than 0
                continue
            req = requests[request_id]
            logprobs = torch.log_softmax(logits.float(), dim=-1)
            targets = tensor_to_device(torch.tensor([req.prompt_token_ids[p] for p in scored]), logprobs.device)
            ids, values, ranks = compute_topk_logprobs(logprobs, targets, req.sampling_params.prompt_logprobs)
            result[request_id] = (ids, values, ranks)
        return result

    def release_graphs(self) -> None:
        """Destroy the captured CUDA graphs (idempotent; later decode steps run eagerly). Tensor-parallel
        ranks call it before tearing down their communicators (see ``CudaGraphRunner.release``)."""
        if self.window_graphs is not None:
            self.window_graphs.release()
        if self.piecewise_graphs is not None:
            self.piecewise_graphs.release()
        if self.graph_runner is not None:
            self.graph_runner.release()

    def close(self) -> None:
        """Release what the runner holds outside this process (nothing for a single rank)."""
