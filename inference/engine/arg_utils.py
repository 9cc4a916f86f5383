"""User-facing engine arguments (vLLM's names) and their resolution into an ``EngineConfig``."""
from __future__ import annotations

import dataclasses
import logging
import os
import types
import typing
from dataclasses import dataclass

import torch

from ..config import CacheConfig, EngineConfig, SchedulerConfig, parse_dtype
from ..sched.decode_windows import AUTO_MAX_WINDOW, MAX_SCHEDULER_STEPS

# Devices where the engine sizes decode windows itself by default: on the CPU a decode step is
# already longer than a window may last (decode_windows.WINDOW_TARGET_S), so windows would be 1.
AUTO_WINDOW_DEVICES = ("cuda",)
from ..sched.policy import POLICIES
from ..sched.scheduler import PREEMPTION_MODES
from ..distributed.partition import check_quantized_tensor_parallel_size, check_tensor_parallel_size
from ..attention.kv_quant import FP8_DTYPE, kv_cache_torch_dtype
from ..errors import InvalidRequestError, ModelLoadError, NotSupportedYetError
from ..lora.config import MAX_LORA_RANK_LIMIT, LoRAConfig, parse_lora_modules
from ..model_loader import check_architecture, is_dummy_only, load_hf_config, resolve_model
from ..quantization import resolve_quantization
from ..quantization.fp8 import check_fp8_supported

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineArgs:
    """Arguments of ``LLM(...)`` / ``LLMEngine.from_engine_args`` / ``manage.py serve``.

    Lengths are in tokens, memory in GiB or fractions. ``max_model_len=None`` takes the model's
    ``max_position_embeddings``; ``max_num_batched_tokens=None`` takes 2048 with chunked prefill,
    else ``max(max_model_len, 2048)``. ``num_kv_blocks`` overrides the profiled KV pool size
    (vLLM's ``num_gpu_blocks_override``). ``async_scheduling=None`` turns scheduling ahead on
    on a GPU (any number of tensor-parallel ranks). ``num_scheduler_steps``
    (1 to 64, one rank) runs that many decode steps per scheduling of a decode-only batch
    (:mod:`inference.sched.decode_windows`). ``enable_lora`` serves LoRA adapters (docs/lora.md):
    ``max_loras`` in one batch, of rank up to ``max_lora_rank``, ``max_cpu_loras`` (default
    ``max_loras``) kept loaded in host memory; ``lora_modules`` are loaded at start (``"name=path"`` or
    vLLM's JSON form, ids 1, 2, ... in order).
    """

    model: str = "smollm2-135m-instruct"
    tokenizer: str | None = None
    dtype: str = "auto"
    device: str | None = None
    load_format: str = "auto"
    seed: int = 0
    max_model_len: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    enable_chunked_prefill: bool = True
    gpu_memory_utilization: float = 0.9
    kv_cache_space: float = 4.0
    block_size: int = 16
    num_kv_blocks: int | None = None
    enable_prefix_caching: bool = True
    scheduling_policy: str = "fcfs"
    preemption_mode: str = "recompute"
    swap_space: float = 0.0
    kv_cache_dtype: str = "auto"
    calculate_kv_scales: bool = True
    tensor_parallel_size: int = 1
    quantization: str | None = None
    enforce_eager: bool = False
    attention_backend: str = "auto"
    served_model_name: str | None = None
    async_scheduling: bool | None = None
    num_scheduler_steps: int | None = None
    enable_lora: bool = False
    lora_modules: list | tuple | None = None
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None

    @classmethod
    def from_kwargs(cls, **kwargs) -> "EngineArgs":
        """Build from keyword arguments, rejecting unknown names.

        Raises:
            InvalidRequestError: an unknown argument (naming it).
        """
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise InvalidRequestError(f"Unknown engine argument(s): {', '.join(unknown)}.", param=unknown[0])
        return cls(**kwargs)

    def _check_types(self) -> None:
        """Each argument has its annotated type (ints for floats too; ``dtype`` may be a torch.dtype), so
        that a wrong type is an error naming it, not a TypeError later."""
        extra = {"dtype": (torch.dtype,)}
        hints = typing.get_type_hints(type(self))
        for field in dataclasses.fields(self):
            hint, value = hints[field.name], getattr(self, field.name)
            allowed = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
            allowed = tuple(a for a in allowed if isinstance(a, type)) + extra.get(field.name, ())
            if float in allowed:
                allowed += (int,)
            if isinstance(value, allowed) and (bool in allowed or not isinstance(value, bool)):
                continue
            names = " or ".join("None" if a is type(None) else a.__name__ for a in allowed if a is not int or
                                float not in allowed)
            raise InvalidRequestError(f"{field.name} must be {names}, got {value!r} ({type(value).__name__}).",
                                      param=field.name)

    def _check_ranges(self) -> None:
        self._check_types()
        if self.block_size not in (1, 2, 4, 8, 16, 32, 64, 128):
            raise InvalidRequestError(f"block_size must be a power of two up to 128, got {self.block_size}.",
                                      param="block_size")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise InvalidRequestError(f"gpu_memory_utilization must be in (0, 1], got "
                                      f"{self.gpu_memory_utilization}.", param="gpu_memory_utilization")
        if self.max_num_seqs < 1:
            raise InvalidRequestError(f"max_num_seqs must be at least 1, got {self.max_num_seqs}.",
                                      param="max_num_seqs")
        for name in ("max_model_len", "max_num_batched_tokens"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise InvalidRequestError(f"{name} must be at least 1 token, got {value}.", param=name)
        if not self.kv_cache_space > 0:
            raise InvalidRequestError(f"kv_cache_space must be a positive number of GiB, got {self.kv_cache_space}.",
                                      param="kv_cache_space")
        host_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
        if self.kv_cache_space > host_gib:
            raise InvalidRequestError(f"kv_cache_space={self.kv_cache_space} GiB is more than this machine's "
                                      f"{host_gib:.1f} GiB of memory.", param="kv_cache_space")
        if self.scheduling_policy not in POLICIES:
            raise InvalidRequestError(f"scheduling_policy must be one of {', '.join(POLICIES)}, got "
                                      f"{self.scheduling_policy!r}.", param="scheduling_policy")
        if self.preemption_mode not in PREEMPTION_MODES:
            raise InvalidRequestError(f"preemption_mode must be one of {', '.join(PREEMPTION_MODES)}, got "
                                      f"{self.preemption_mode!r}.", param="preemption_mode")
        if self.swap_space < 0 or (self.preemption_mode == "swap" and not self.swap_space > 0):
            raise InvalidRequestError(f"swap_space must be positive (GiB) for preemption_mode='swap', got "
                                      f"{self.swap_space}.", param="swap_space")
        if self.swap_space and self.preemption_mode != "swap":
            logger.warning("swap_space=%s GiB is unused: preemption_mode is %r (pass preemption_mode='swap', "
                           "--preemption-mode swap, to swap preempted requests out)", self.swap_space,
                           self.preemption_mode)
        if self.num_scheduler_steps is not None and not 1 <= self.num_scheduler_steps <= MAX_SCHEDULER_STEPS:
            raise InvalidRequestError(f"num_scheduler_steps must be between 1 and {MAX_SCHEDULER_STEPS}, got "
                                      f"{self.num_scheduler_steps}.", param="num_scheduler_steps")
        if (self.num_scheduler_steps or 1) > 1 and self.tensor_parallel_size > 1:
            raise InvalidRequestError("num_scheduler_steps > 1 needs tensor_parallel_size=1 (the other ranks "
                                      "run one step per plan).", param="num_scheduler_steps")
        if self.load_format not in ("auto", "dummy"):
            raise InvalidRequestError(f"load_format must be 'auto' or 'dummy', got {self.load_format!r}.",
                                      param="load_format")
        self._check_lora()

    def _check_lora(self) -> None:
        if not self.enable_lora:
            if self.lora_modules:
                raise InvalidRequestError("lora_modules needs enable_lora=True (--enable-lora).", param="enable_lora")
            return
        if self.max_loras < 1:
            raise InvalidRequestError(f"max_loras must be at least 1, got {self.max_loras}.", param="max_loras")
        if not 1 <= self.max_lora_rank <= MAX_LORA_RANK_LIMIT:
            raise InvalidRequestError(f"max_lora_rank must be between 1 and {MAX_LORA_RANK_LIMIT}, got "
                                      f"{self.max_lora_rank}.", param="max_lora_rank")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise InvalidRequestError(f"max_cpu_loras ({self.max_cpu_loras}) must be at least max_loras "
                                      f"({self.max_loras}).", param="max_cpu_loras")
        served = {self.model, self.served_model_name} - {None}
        for module in parse_lora_modules(self.lora_modules):
            if module.lora_name in served:
                raise InvalidRequestError(f"lora_modules: {module.lora_name!r} is the served model's name; an adapter "
                                          "needs a name of its own.", param="lora_modules")
            if module.base_model_name is not None and module.base_model_name not in served:
                raise InvalidRequestError(
                    f"lora_modules: adapter {module.lora_name!r} names base_model_name {module.base_model_name!r}, "
                    f"but this engine serves {sorted(served)[0]!r}.", param="lora_modules")
        if self.quantization is not None:
            raise NotSupportedYetError("LoRA adapters on a quantized model are not supported yet (enable_lora with "
                                       f"quantization={self.quantization!r}).")

    def _lora_config(self) -> LoRAConfig | None:
        """The LoRA limits and start-up adapters (None without ``enable_lora``)."""
        if not self.enable_lora:
            return None
        return LoRAConfig(max_loras=self.max_loras, max_lora_rank=self.max_lora_rank,
                          max_cpu_loras=self.max_cpu_loras or self.max_loras,
                          modules=parse_lora_modules(self.lora_modules))

    def create_engine_config(self) -> EngineConfig:
        """Resolve the model, its config and all limits.

        Raises:
            ModelLoadError (param ``"load_format"``): a weightless benchmark shape such as
                ``qwen2.5-7b`` without ``load_format="dummy"``, raised before anything is built.
            ModelLoadError, UnsupportedArchitectureError, InvalidRequestError.
        """
        self._check_ranges()
        device = self.device or ("cuda" if torch.cuda.is_available() else "cpu")
        resolved, hf_config, quant_config, max_model_len = self._check_against_model(device)
        checkpoint_dtype = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
        if isinstance(checkpoint_dtype, str):
            checkpoint_dtype = getattr(torch, checkpoint_dtype, None)
        dtype = parse_dtype(self.dtype, checkpoint_dtype, device)
        if quant_config is not None and quant_config.method == "fp8":
            check_fp8_supported(device)
        batched = self.max_num_batched_tokens or (2048 if self.enable_chunked_prefill else max(max_model_len, 2048))
        if not self.enable_chunked_prefill and batched < max_model_len:
            raise InvalidRequestError(
                f"max_num_batched_tokens={batched} is smaller than max_model_len={max_model_len}; "
                "enable chunked prefill or raise max_num_batched_tokens.", param="max_num_batched_tokens")
        self._check_kv_cache_dtype(dtype, device)
        lora = self._lora_config()
        if lora is not None and quant_config is not None:
            raise NotSupportedYetError("LoRA adapters on a quantized model are not supported yet (enable_lora with "
                                       f"a {quant_config.method} checkpoint).")
        return EngineConfig(
            model=self.model, tokenizer=str(resolved.tokenizer_dir), model_dir=str(resolved.model_dir),
            hf_config=hf_config, dtype=dtype, device=device, load_format=self.load_format, seed=self.seed,
            enforce_eager=self.enforce_eager, attention_backend=self.attention_backend,
            tensor_parallel_size=self.tensor_parallel_size,
            quantization=quant_config.method if quant_config else None, quant_config=quant_config,
            served_model_name=self.served_model_name or self.model,
            cache=CacheConfig(block_size=self.block_size, gpu_memory_utilization=self.gpu_memory_utilization,
                              kv_cache_space=self.kv_cache_space, enable_prefix_caching=self.enable_prefix_caching,
                              swap_space=self.swap_space, cache_dtype=self.kv_cache_dtype,
                              calculate_kv_scales=self.calculate_kv_scales),
            scheduler=SchedulerConfig(max_num_seqs=self.max_num_seqs, max_num_batched_tokens=batched,
                                      max_model_len=max_model_len,
                                      enable_chunked_prefill=self.enable_chunked_prefill,
                                      scheduling_policy=self.scheduling_policy,
                                      preemption_mode=self.preemption_mode,
                                      async_scheduling=self._async_scheduling(device),
                                      **self._decode_windows(device)),
            lora=lora,
        )

    def check_model(self) -> None:
        """The checks of :meth:`create_engine_config` that need the model's config but not the device that
        will run it (for a catalog entry saved where no worker runs): the weights exist, the architecture is
        supported, ``quantization`` matches the checkpoint, ``max_model_len`` fits the model and
        ``tensor_parallel_size`` splits its heads (and its 4-bit layers). A GGUF file is converted (cached) on
        the first check, as at a load.

        Raises:
            InvalidRequestError, ModelLoadError, UnsupportedArchitectureError: naming the argument (``param``).
        """
        self._check_against_model(device=None)

    def _check_against_model(self, device: str | None):
        """Resolve the model and check the arguments against its config (``device`` None: skip what depends
        on the device, e.g. the number of GPUs). Returns ``(resolved, hf_config, quant_config, max_model_len)``."""
        if self.load_format != "dummy" and is_dummy_only(self.model):
            raise ModelLoadError(f"There are no weights for {self.model!r}: it is a benchmark shape (config and "
                                 "tokenizer only). Pass load_format='dummy' to run it with random weights.",
                                 param="load_format")
        resolved = resolve_model(self.model, self.tokenizer, load_format=self.load_format)
        hf_config = load_hf_config(resolved.model_dir)
        check_architecture(hf_config)
        check_tensor_parallel_size(self.tensor_parallel_size, hf_config, self.model, device or "")
        quant_config = resolve_quantization(self.quantization, hf_config, self.load_format)
        if quant_config is not None:
            check_quantized_tensor_parallel_size(self.tensor_parallel_size, hf_config, quant_config.method,
                                                 quant_config.group_size)
        model_max = getattr(hf_config, "max_position_embeddings", None) or 8192
        max_model_len = self.max_model_len or model_max
        if max_model_len > model_max:
            raise InvalidRequestError(f"max_model_len={max_model_len} exceeds the model's "
                                      f"max_position_embeddings={model_max}.", param="max_model_len")
        return resolved, hf_config, quant_config, max_model_len

    def _decode_windows(self, device: str) -> dict:
        """``num_scheduler_steps`` and ``adaptive_windows`` of the scheduler: the user's fixed windows,
        or (None) windows the engine sizes by the measured step time, up to
        :data:`~inference.sched.decode_windows.AUTO_MAX_WINDOW` steps, on a GPU with one rank."""
        if self.num_scheduler_steps is not None:
            return dict(num_scheduler_steps=self.num_scheduler_steps, adaptive_windows=False)
        auto = device.startswith(AUTO_WINDOW_DEVICES) and self.tensor_parallel_size == 1
        return dict(num_scheduler_steps=AUTO_MAX_WINDOW if auto else 1, adaptive_windows=auto)

    def _check_kv_cache_dtype(self, dtype: torch.dtype, device: str) -> None:
        """Raises InvalidRequestError for an unknown ``kv_cache_dtype``, or an FP8 cache on a GPU without
        float8 e4m3 (compute capability below 8.9)."""
        if kv_cache_torch_dtype(self.kv_cache_dtype, dtype) != FP8_DTYPE or not device.startswith("cuda"):
            return
        major, minor = torch.cuda.get_device_capability(device)
        if (major, minor) < (8, 9):
            raise InvalidRequestError(
                f"kv_cache_dtype={self.kv_cache_dtype!r} needs a GPU with float8 e4m3 (compute capability 8.9 or "
                f"newer: Ada, Hopper); {torch.cuda.get_device_name(device)} has {major}.{minor}.",
                param="kv_cache_dtype")

    def _async_scheduling(self, device: str) -> bool:
        return device.startswith("cuda") if self.async_scheduling is None else self.async_scheduling
