"""What a worker needs to load one served model: the seam between the admin's catalog
(``webapp.catalog``, Django) and a worker's runtime (plain values, no Django).

A spec travels as JSON on the worker's command list (:mod:`.commands`) and is laid over the
engine flags the worker was started with (``--kv-cache-space``, ``--block-size``, ...), so
a model registered in the admin only names what differs per model.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from inference import EngineArgs


@dataclass(frozen=True)
class ModelSpec:
    """One served model's engine settings (vLLM's names).

    Attributes:
        name: the name clients send as ``"model"`` (``--served-model-name``); also the
            Celery queue's suffix.
        source: the packaged model's name, a Hugging Face model directory or a ``.gguf`` file.
        dtype: ``auto``, ``float32``, ``bfloat16`` or ``float16``.
        quantization: weight quantization method, None for none.
        max_model_len: context length in tokens (prompt + output); None: the model's.
        gpu_memory_utilization: fraction of GPU memory for the engine, in (0, 1].
        max_num_seqs: requests in one engine step (also the worker's admission slots).
        tensor_parallel_size: GPUs per engine.
    """

    name: str
    source: str
    dtype: str = "auto"
    quantization: str | None = None
    max_model_len: int | None = None
    gpu_memory_utilization: float = 0.9
    max_num_seqs: int = 256
    tensor_parallel_size: int = 1

    def engine_args(self, base: EngineArgs) -> EngineArgs:
        """``base`` (the worker's own flags) with this model's settings laid over it."""
        return dataclasses.replace(
            base, model=self.source, served_model_name=self.name, dtype=self.dtype, quantization=self.quantization,
            max_model_len=self.max_model_len, gpu_memory_utilization=self.gpu_memory_utilization,
            max_num_seqs=self.max_num_seqs, tensor_parallel_size=self.tensor_parallel_size,
            # a tokenizer flag belongs to the model the worker was started with, not to this one
            tokenizer=base.tokenizer if base.model == self.source else None,
            # the adapters of --lora-modules are the start-up model's only: another name on the same weights
            # would serve them twice (docs/lora_serving.md)
            lora_modules=base.lora_modules if self._is_startup_model(base) else None)

    def _is_startup_model(self, base: EngineArgs) -> bool:
        return self.name == (base.served_model_name or base.model) and self.source == base.model

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> "ModelSpec":
        """The spec of a worker started with a model on its command line."""
        return cls(name=args.served_model_name or args.model, source=args.model, dtype=args.dtype,
                   quantization=args.quantization, max_model_len=args.max_model_len,
                   gpu_memory_utilization=args.gpu_memory_utilization, max_num_seqs=args.max_num_seqs,
                   tensor_parallel_size=args.tensor_parallel_size)

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "ModelSpec":
        """Raises:
            TypeError: unknown or missing fields.
        """
        return cls(**data)
