"""Quantized linear layers: a ``QuantizedLinear`` module holding a ``LinearMethodBase`` (the
quantization method), in the spirit of vLLM's ``LinearMethodBase`` (create weights, load them,
process them after loading, apply).

The model is built unquantized on the ``meta`` device; ``quantize_linear_layers`` then swaps every
``nn.Linear`` of the decoder layers (the fused Q/K/V and gate/up projections included, the LM head
excluded: published AWQ/GPTQ checkpoints keep it in 16 bits) for a ``QuantizedLinear`` of the same
shape and shard offsets, so the model's ``load_weights`` keeps working unchanged: fused shards go
through ``load_shard``, other tensors are plain parameters.
"""
from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch
from torch import nn

from .config import QuantizationConfig

logger = logging.getLogger(__name__)
GiB = 1 << 30


class LinearMethodBase(ABC):
    """How one quantization stores and multiplies a linear layer's weights.

    Subclasses register their parameters on the layer in ``create_weights`` under the checkpoint's
    names (``qweight``, ``scales``, ...), say how each is split along the output features
    (``output_dim``), convert them once loaded (``process_weights_after_loading``), and compute
    ``apply(layer, x [T, K]) -> x W^T + layer.bias`` (``[T, N]`` in ``x.dtype``; a kernel may fuse the bias).
    """

    @abstractmethod
    def create_weights(self, layer: "QuantizedLinear", params_dtype: torch.dtype) -> None:
        ...

    @abstractmethod
    def output_dim(self, param_name: str) -> tuple[int, int] | None:
        """``(dim, pack_factor)``: output features of ``param_name`` lie along ``dim``, ``pack_factor``
        per element; None for a parameter every shard carries whole (GPTQ's ``g_idx``)."""
        ...

    def process_weights_after_loading(self, layer: "QuantizedLinear") -> None:
        """Convert the loaded checkpoint tensors into what ``apply`` reads."""

    @abstractmethod
    def init_dummy(self, layer: "QuantizedLinear", generator: torch.Generator) -> None:
        """Random weights of the right layout (``load_format="dummy"``), before processing."""
        ...

    @abstractmethod
    def apply(self, layer: "QuantizedLinear", x: torch.Tensor) -> torch.Tensor:
        ...


def _param(shape, dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)


class QuantizedLinear(nn.Module):
    """A linear layer ``y = x W^T + b`` whose weights a ``LinearMethodBase`` stores and multiplies.

    ``shard_sizes`` maps each Hugging Face projection fused into this layer (``"q_proj"``) to its
    output features, as ``FusedLinear`` does; None for an unfused layer.
    ``forward(x [..., in_features]) -> [..., out_features]`` in ``x.dtype``.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool, method: LinearMethodBase,
                 params_dtype: torch.dtype, shard_sizes: dict[str, int] | None = None) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.method = method
        self.offsets: dict[str, tuple[int, int]] = {}
        self._whole_loaded: set[str] = set()
        start = 0
        for name, size in (shard_sizes or {}).items():
            self.offsets[name] = (start, start + size)
            start += size
        method.create_weights(self, params_dtype)
        self.bias = _param((out_features,), params_dtype) if bias else None

    def register(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        """Register a parameter (no gradient) of the checkpoint's name, shape and dtype."""
        self.register_parameter(name, _param(shape, dtype))

    def replace(self, name: str, tensor: torch.Tensor | None) -> None:
        """Swap a parameter for a converted tensor (None removes it)."""
        if hasattr(self, name):
            delattr(self, name)
        if tensor is not None:
            self.register_parameter(name, nn.Parameter(tensor, requires_grad=False))

    def load_shard(self, shard: str, param_name: str, tensor: torch.Tensor) -> None:
        """Copy the checkpoint tensor of one fused projection into its slice of ``param_name``.

        Raises:
            ValueError: an unknown parameter, or a shape that does not match the slice.
        """
        start, end = self.offsets[shard]
        target = getattr(self, param_name, None)
        if not isinstance(target, torch.Tensor):
            raise ValueError(f"{shard}.{param_name}: not a tensor of a {type(self.method).__name__} layer")
        where = (0, 1) if param_name == "bias" else self.method.output_dim(param_name)
        if where is None:  # carried whole by every shard (the same input rows); they must agree
            if param_name in self._whole_loaded:
                if not torch.equal(target.cpu(), tensor.to(target.dtype)):
                    raise ValueError(f"{shard}.{param_name} differs from the other fused projections'")
                return
            self._copy_checked(f"{shard}.{param_name}", target, tensor)
            self._whole_loaded.add(param_name)
            return
        dim, pack = where
        self._copy_checked(f"{shard}.{param_name}", target.narrow(dim, start // pack, (end - start) // pack), tensor)

    @staticmethod
    def _copy_checked(name: str, target: torch.Tensor, tensor: torch.Tensor) -> None:
        if tuple(target.shape) != tuple(tensor.shape):
            raise ValueError(f"{name}: expected shape {tuple(target.shape)}, got {tuple(tensor.shape)}")
        with torch.no_grad():
            target.copy_(tensor)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.method.apply(self, x.reshape(-1, self.in_features))
        return out.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, method={type(self.method).__name__}"


def make_linear_method(config: QuantizationConfig) -> LinearMethodBase:
    if config.method == "fp8":
        from .fp8 import Fp8LinearMethod
        return Fp8LinearMethod()
    from .int4 import Int4LinearMethod
    return Int4LinearMethod(config)


def quantize_linear_layers(model: nn.Module, config: QuantizationConfig, skip: tuple[str, ...] = ("lm_head",)) -> int:
    """Replace the model's ``nn.Linear`` layers (not those named in ``skip``) by ``QuantizedLinear``.

    Call on a model built on the ``meta`` device, under the model's default dtype. Returns the number
    of layers replaced.
    """
    count = 0
    for parent in list(model.modules()):
        for child_name, child in list(parent.named_children()):
            if not isinstance(child, nn.Linear) or child_name in skip:
                continue
            offsets = getattr(child, "offsets", None)
            shard_sizes = {k: end - start for k, (start, end) in offsets.items()} if offsets else None
            layer = QuantizedLinear(child.in_features, child.out_features, child.bias is not None,
                                    make_linear_method(config), child.weight.dtype, shard_sizes)
            setattr(parent, child_name, layer)
            count += 1
    return count


def process_quantized_weights(model: nn.Module, generator: torch.Generator | None = None) -> None:
    """After loading (or, with ``generator``, random init): convert every quantized layer's weights."""
    for module in model.modules():
        if isinstance(module, QuantizedLinear):
            if generator is not None:
                module.method.init_dummy(module, generator)
                if module.bias is not None:
                    with torch.no_grad():
                        module.bias.normal_(0.0, 0.02, generator=generator)
            module.method.process_weights_after_loading(module)


@dataclass(frozen=True)
class WeightMemory:
    """Weight bytes of a model, and what the same weights take in bfloat16.

    ``quantized_*`` counts the quantized linear layers only (embeddings, norms and the LM head stay
    in 16 bits in AWQ/GPTQ checkpoints).
    """

    total_bytes: int
    total_bf16_bytes: int
    quantized_bytes: int
    quantized_bf16_bytes: int

    @property
    def quantized_ratio(self) -> float:
        return self.quantized_bytes / max(1, self.quantized_bf16_bytes)

    @property
    def total_ratio(self) -> float:
        return self.total_bytes / max(1, self.total_bf16_bytes)


def weight_memory(model: nn.Module) -> WeightMemory:
    """Bytes of the model's parameters (works on the ``meta`` device: shapes only)."""
    quantized = quantized_bf16 = 0
    quantized_ids: set[int] = set()
    for module in model.modules():
        if isinstance(module, QuantizedLinear):
            params = list(module.parameters())
            quantized_ids.update(id(p) for p in params)
            quantized += sum(p.numel() * p.element_size() for p in params)
            quantized_bf16 += 2 * module.in_features * module.out_features
            quantized_bf16 += 2 * module.out_features if module.bias is not None else 0
    others = [p for p in model.parameters() if id(p) not in quantized_ids]
    other_bytes = sum(p.numel() * p.element_size() for p in others)
    other_bf16 = sum(2 * p.numel() for p in others)
    return WeightMemory(quantized + other_bytes, quantized_bf16 + other_bf16, quantized, quantized_bf16)


def log_weight_memory(model: nn.Module, config: QuantizationConfig) -> WeightMemory:
    memory = weight_memory(model)
    logger.info("Quantization %s: linear layers take %.2f GiB = %.1f%% of bf16 (%.2f GiB); whole model %.2f GiB = "
                "%.1f%% of bf16 (embeddings, norms, LM head unquantized)", config.method,
                memory.quantized_bytes / GiB, 100 * memory.quantized_ratio, memory.quantized_bf16_bytes / GiB,
                memory.total_bytes / GiB, 100 * memory.total_ratio)
    return memory
