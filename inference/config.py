"""Frozen engine configuration, built once from the user's arguments.

Values discovered at run time are not patched in here: the number of KV blocks is the model
runner's (``ModelRunner.num_blocks``: the ``num_kv_blocks`` override, else what
``runner/kv_sizing.py`` finds room for, the minimum over tensor-parallel ranks), and the engine
builds its ``KVCacheManager`` from it.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .errors import InvalidRequestError
from .lora.config import LoRAConfig
from .quantization.config import QuantizationConfig

_DTYPES = {
    "float32": torch.float32, "float": torch.float32, "fp32": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "half": torch.float16, "fp16": torch.float16,
}


def parse_dtype(dtype: str | torch.dtype, checkpoint_dtype: torch.dtype | None, device: str) -> torch.dtype:
    """Resolve the user's ``dtype`` argument.

    ``"auto"`` takes the checkpoint's dtype on GPU and float32 on CPU (CPU matmuls in
    half precision are slow and inexact).

    Raises:
        InvalidRequestError: for an unknown dtype name.
    """
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        if device == "cpu" or checkpoint_dtype is None:
            return torch.float32
        return checkpoint_dtype
    try:
        return _DTYPES[dtype]
    except KeyError:
        raise InvalidRequestError(
            f"dtype must be one of auto, float32, bfloat16, float16; got {dtype!r}.", param="dtype") from None


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache settings.

    Attributes:
        block_size: tokens per KV block.
        gpu_memory_utilization: fraction of GPU memory the engine may use (weights + activations + KV).
        kv_cache_space: GiB of KV cache on CPU.
        enable_prefix_caching: share full blocks between requests by content hash.
        swap_space: GiB of CPU memory (pinned on CUDA) for swapped-out blocks (preemption_mode "swap").
        cache_dtype: ``"auto"`` (the model's dtype), ``"fp8"`` or ``"fp8_e4m3"`` (float8 e4m3 with
            per-layer scales, :mod:`inference.attention.kv_quant`).
        calculate_kv_scales: with an FP8 cache and a checkpoint without KV scales, measure each layer's
            scales in a calibration prefill at start-up (:mod:`inference.attention.kv_scales`); False: 1.0.
    """

    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    kv_cache_space: float = 4.0
    enable_prefix_caching: bool = False
    swap_space: float = 0.0
    cache_dtype: str = "auto"
    calculate_kv_scales: bool = True


@dataclass(frozen=True)
class SchedulerConfig:
    """Continuous-batching limits.

    Attributes:
        max_num_seqs: requests in one step.
        max_num_batched_tokens: tokens (prefill + decode) in one step.
        max_model_len: longest prompt + output, in tokens.
        enable_chunked_prefill: split long prompts over steps and mix them with decodes.
        scheduling_policy: ``"fcfs"`` (arrival order) or ``"priority"`` (lower ``priority`` first,
            ties by arrival; preemption takes the lowest priority first).
        preemption_mode: ``"recompute"`` (drop the KV, recompute on resume) or ``"swap"`` (copy the
            KV blocks to the CPU swap space and back; recompute when the swap space is full).
        async_scheduling: in a steady run of decode steps, schedule and launch step N+1 before the
            tokens of step N are back, feeding it N's tokens on the device (vLLM's
            ``--async-scheduling``), so the device never waits for the host between steps.
        num_scheduler_steps: decode steps run back to back on the device per scheduling of a
            decode-only batch (vLLM's former ``--num-scheduler-steps``; 1: one step per schedule).
            See :mod:`inference.sched.decode_windows` for when a batch falls back to one step.
        adaptive_windows: ``num_scheduler_steps`` is an upper bound: the engine sizes each window
            so that it lasts about :data:`~inference.sched.decode_windows.WINDOW_TARGET_S` at the
            measured decode-step time (:func:`~inference.sched.decode_windows.adaptive_window`).
    """

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int = 8192
    enable_chunked_prefill: bool = True
    scheduling_policy: str = "fcfs"
    preemption_mode: str = "recompute"
    async_scheduling: bool = False
    num_scheduler_steps: int = 1
    adaptive_windows: bool = False


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine needs, resolved and validated."""

    model: str
    tokenizer: str | None
    model_dir: str  # a Hugging Face style directory (config.json + weights), possibly a converted cache
    hf_config: object = field(repr=False, compare=False)
    dtype: torch.dtype = torch.float32
    device: str = "cpu"
    load_format: str = "auto"
    seed: int = 0
    enforce_eager: bool = True
    attention_backend: str = "auto"
    tensor_parallel_size: int = 1
    quantization: str | None = None
    quant_config: QuantizationConfig | None = None  # resolved from ``quantization`` and config.json
    served_model_name: str | None = None
    cache: CacheConfig = CacheConfig()
    scheduler: SchedulerConfig = SchedulerConfig()
    lora: LoRAConfig | None = None  # None: LoRA adapters are off (no enable_lora)

    @property
    def max_model_len(self) -> int:
        return self.scheduler.max_model_len
