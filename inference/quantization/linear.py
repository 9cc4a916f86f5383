"""Quantized linear layers: a ``QuantizedLinear`` module holding a ``LinearMethodBase`` (the
quantization method), in the spirit of vLLM's ``LinearMethodBase`` (create weights, load them,
process them after loading, apply).

The model is built unquantized on the ``meta`` device; ``quantize_linear_layers`` then swaps every
``nn.Linear`` of the decoder layers (the fused Q/K/V and gate/up projections included, the LM head
excluded: published AWQ/GPTQ checkpoints keep it in 16 bits) for a ``QuantizedLinear`` of the same
shape and shard offsets, so the model's ``load_weights`` keeps working unchanged: fused shards go
through ``load_shard``, other tensors through ``load_weight``.

Under tensor parallelism the replacement keeps the parallel layer's ``LinearPartition``: every rank
reads the full checkpoint tensors and keeps its part, cut along the dimensions each method declares
(``output_dim``, ``input_dim``); the same code cuts AWQ, GPTQ and FP8 weights, and random weights
are drawn full-size so that every ``tensor_parallel_size`` runs the same model.
"""
from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch
from torch import nn

from ..distributed.partition import LinearPartition
from ..distributed.process_group import TensorParallelGroup
from .config import QuantizationConfig

logger = logging.getLogger(__name__)
GiB = 1 << 30


class LinearMethodBase(ABC):
    """How one quantization stores and multiplies a linear layer's weights.

    Subclasses register their parameters on the layer in ``create_weights`` under the checkpoint's
    names (``qweight``, ``scales``, ...), say how each is split along the output features
    (``output_dim``) and the input features (``input_dim``) so that ``QuantizedLinear`` can cut a
    tensor-parallel rank's part out of the full checkpoint tensor, convert them once loaded
    (``process_weights_after_loading``), and compute ``apply(layer, x [T, K]) -> x W^T + layer.fused_bias``
    (``[T, N]`` in ``x.dtype``; a kernel may fuse the bias; ``K``, ``N``: this rank's features; a
    row-parallel layer's partial sum without the bias, which the layer adds once after its all-reduce).
    """

    @abstractmethod
    def create_weights(self, layer: "QuantizedLinear", params_dtype: torch.dtype) -> None:
        ...

    @abstractmethod
    def output_dim(self, param_name: str) -> tuple[int, int] | None:
        """``(dim, pack_factor)``: output features of ``param_name`` lie along ``dim``, ``pack_factor``
        per element; None for a parameter every shard carries whole (GPTQ's ``g_idx``)."""
        ...

    @abstractmethod
    def input_dim(self, layer: "QuantizedLinear", param_name: str) -> tuple[int, int] | None:
        """``(dim, features_per_element)``: input features of ``param_name`` lie along ``dim``,
        ``features_per_element`` per element (8 for GPTQ's packed rows, the group size for scales);
        None for a parameter that a row-parallel rank keeps whole."""
        ...

    def process_weights_after_loading(self, layer: "QuantizedLinear") -> None:
        """Convert the loaded checkpoint tensors into what ``apply`` reads."""

    @abstractmethod
    def dummy_checkpoint(self, layer: "QuantizedLinear", generator: torch.Generator) -> dict[str, torch.Tensor]:
        """Random checkpoint tensors of the FULL (unsplit) layer (``load_format="dummy"``), on the
        layer's device, so that every ``tensor_parallel_size`` draws the same model."""
        ...

    @abstractmethod
    def apply(self, layer: "QuantizedLinear", x: torch.Tensor) -> torch.Tensor:
        ...


def _param(shape, dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)


def _narrow(tensor: torch.Tensor, dim: int, start: int, end: int, per: int, what: str) -> torch.Tensor:
    if start % per or end % per:
        raise ValueError(f"{what}: features [{start}, {end}) do not fall on whole elements of {per} features")
    return tensor.narrow(dim, start // per, (end - start) // per)


class QuantizedLinear(nn.Module):
    """A linear layer ``y = x W^T + b`` whose weights a ``LinearMethodBase`` stores and multiplies.

    ``in_features`` / ``out_features`` are this tensor-parallel rank's; ``partition`` says where they
    lie in the full layer (see ``models.parallel_layers.LinearPartition``; None: a single rank).
    ``shard_sizes`` maps each Hugging Face projection fused into this layer (``"q_proj"``) to its
    local output features, as ``FusedLinear`` does; None for an unfused layer.
    ``forward(x [..., in_features]) -> [..., out_features]`` in ``x.dtype``; a row-parallel layer
    all-reduces its partial product over the ranks before adding the bias.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool, method: LinearMethodBase,
                 params_dtype: torch.dtype, shard_sizes: dict[str, int] | None = None,
                 partition: LinearPartition | None = None) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.params_dtype = params_dtype
        self.method = method
        self.offsets: dict[str, tuple[int, int]] = {}
        self._whole_loaded: set[str] = set()
        start = 0
        for name, size in (shard_sizes or {}).items():
            self.offsets[name] = (start, start + size)
            start += size
        self.partition = partition or LinearPartition(
            in_features, out_features, (0, in_features), ((0, out_features),),
            {name: (0, end - begin) for name, (begin, end) in self.offsets.items()}, False, TensorParallelGroup(),
            {name: end - begin for name, (begin, end) in self.offsets.items()})
        method.create_weights(self, params_dtype)
        self.bias = _param((out_features,), params_dtype) if bias else None

    @property
    def fused_bias(self) -> torch.Tensor | None:
        """The bias ``method.apply`` adds: the layer's, except in a row-parallel layer (None), whose
        partial sums are all-reduced first and which adds its bias once, in ``forward``."""
        return None if self.partition.reduce else self.bias

    def register(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        """Register a parameter (no gradient) of the checkpoint's name, shape and dtype."""
        self.register_parameter(name, _param(shape, dtype))

    def replace(self, name: str, tensor: torch.Tensor | None) -> None:
        """Swap a parameter for a converted tensor (None removes it)."""
        if hasattr(self, name):
            delattr(self, name)
        if tensor is not None:
            self.register_parameter(name, nn.Parameter(tensor, requires_grad=False))

    def rank_part(self, param_name: str, full: torch.Tensor, out_ranges: tuple[tuple[int, int], ...],
                  full_out: int, what: str | None = None) -> torch.Tensor:
        """This rank's part of a checkpoint tensor: ``out_ranges`` of its ``full_out`` output features
        (concatenated) and, in a row-parallel layer, the rank's input features.

        Raises:
            ValueError: ``full`` does not have the full tensor's extent along a split dimension.
        """
        what = what or param_name
        out = (0, 1) if param_name == "bias" else self.method.output_dim(param_name)
        if out is not None:
            dim, pack = out
            if full.dim() <= dim or full.shape[dim] * pack != full_out:
                raise ValueError(f"{what}: expected {full_out // pack} elements along dim {dim} ({full_out} output "
                                 f"features), got shape {tuple(full.shape)}")
            parts = [_narrow(full, dim, lo, hi, pack, what) for lo, hi in out_ranges]
            full = parts[0] if len(parts) == 1 else torch.cat(parts, dim)
        inp = None if param_name == "bias" else self.method.input_dim(self, param_name)
        if inp is not None and self.partition.splits_input:
            dim, per = inp
            if full.shape[dim] * per != self.partition.full_in_features:
                raise ValueError(f"{what}: expected {self.partition.full_in_features // per} elements along dim "
                                 f"{dim} ({self.partition.full_in_features} input features), got shape "
                                 f"{tuple(full.shape)}")
            full = _narrow(full, dim, *self.partition.in_range, per, what)
        return full

    def load_weight(self, param_name: str, full: torch.Tensor) -> None:
        """Copy this rank's part of the full (unsplit, unfused) checkpoint tensor ``param_name``.

        Raises:
            ValueError: an unknown parameter, or a shape that does not match the full layer's.
        """
        target = getattr(self, param_name, None)
        if not isinstance(target, torch.Tensor):
            raise ValueError(f"{param_name}: not a tensor of a {type(self.method).__name__} layer")
        part = self.rank_part(param_name, full, self.partition.out_ranges, self.partition.full_out_features)
        self._copy_checked(param_name, target, part)

    def load_shard(self, shard: str, param_name: str, tensor: torch.Tensor) -> None:
        """Copy this rank's part of one fused projection's full checkpoint tensor into its slice of
        ``param_name``.

        Raises:
            ValueError: an unknown parameter, or a shape that does not match the projection's.
        """
        start, end = self.offsets[shard]
        target = getattr(self, param_name, None)
        if not isinstance(target, torch.Tensor):
            raise ValueError(f"{shard}.{param_name}: not a tensor of a {type(self.method).__name__} layer")
        tensor = self.rank_part(param_name, tensor, (self.partition.shard_ranges[shard],),
                                self.partition.full_shard_sizes[shard], what=f"{shard}.{param_name}")
        where = (0, 1) if param_name == "bias" else self.method.output_dim(param_name)
        if where is None:  # carried whole by every shard (the same input rows); they must agree
            if param_name in self._whole_loaded:
                if not torch.equal(target.cpu(), tensor.to(target.dtype).cpu()):
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

    def init_dummy(self, generator: torch.Generator) -> None:
        """Random weights (``load_format="dummy"``): the full layer's, of which this rank keeps its part."""
        for name, full in self.method.dummy_checkpoint(self, generator).items():
            self.load_weight(name, full)
        if self.bias is not None:
            full = torch.empty(self.partition.full_out_features, dtype=self.bias.dtype, device=self.bias.device)
            self.load_weight("bias", full.normal_(0.0, 0.02, generator=generator))

    @property
    def takes_fp8_activations(self) -> bool:
        """Whether ``forward`` accepts an ``fp8.Fp8Activation`` (per-token FP8 codes made by the producing
        kernel) in place of ``x``: true for FP8 layers."""
        return getattr(self.method, "takes_fp8_activations", False)

    def forward(self, x) -> torch.Tensor:
        """``x [..., K]`` (or an ``Fp8Activation`` of ``[T, K]`` codes, see ``takes_fp8_activations``) ->
        ``[..., N]``."""
        lead = x.codes.shape[:-1] if hasattr(x, "codes") else x.shape[:-1]
        out = self.method.apply(self, x if hasattr(x, "codes") else x.reshape(-1, self.in_features))
        if self.partition.reduce:
            out = self.partition.tp.all_reduce(out)
            if self.bias is not None:
                out = out + self.bias.to(out.dtype)
        return out.reshape(*lead, self.out_features)

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

    Call on a model built on the ``meta`` device, under the model's default dtype. Tensor-parallel
    layers keep their split (``LinearPartition``): each rank loads its part of the quantized
    checkpoint. Returns the number of layers replaced.
    """
    count = 0
    for parent in list(model.modules()):
        for child_name, child in list(parent.named_children()):
            if not isinstance(child, nn.Linear) or child_name in skip:
                continue
            offsets = getattr(child, "offsets", None)
            shard_sizes = {k: end - start for k, (start, end) in offsets.items()} if offsets else None
            layer = QuantizedLinear(child.in_features, child.out_features, child.bias is not None,
                                    make_linear_method(config), child.weight.dtype, shard_sizes,
                                    child.linear_partition() if hasattr(child, "linear_partition") else None)
            setattr(parent, child_name, layer)
            count += 1
    return count


def process_quantized_weights(model: nn.Module, generator: torch.Generator | None = None) -> None:
    """After loading (or, with ``generator``, random init): convert every quantized layer's weights."""
    for module in model.modules():
        if isinstance(module, QuantizedLinear):
            if generator is not None:
                module.init_dummy(generator)
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


def held_dequantized_bytes(model: nn.Module) -> int:
    """Bytes of the dequantized copies that quantized layers hold beside their packed weights (on a CPU:
    ``int4.Int4LinearMethod``), which ``weight_memory`` leaves out."""
    return sum(m.dense_weight.numel() * m.dense_weight.element_size() for m in model.modules()
               if isinstance(m, QuantizedLinear) and getattr(m, "dense_weight", None) is not None)


def log_weight_memory(model: nn.Module, config: QuantizationConfig) -> WeightMemory:
    """Log, at start-up, the two figures a reader compares with bf16: the quantized linear layers alone, and
    the whole model (the embedding, norms and LM head stay 16-bit, as in published AWQ/GPTQ checkpoints)."""
    memory = weight_memory(model)
    logger.info("Quantization %s: quantized linear layers %.2f GiB = %.1f%% of their bf16 size (%.2f GiB); "
                "whole model %.2f GiB = %.1f%% of its bf16 size (%.2f GiB), of which %.2f GiB stay 16-bit "
                "(embeddings, norms, LM head)", config.method,
                memory.quantized_bytes / GiB, 100 * memory.quantized_ratio, memory.quantized_bf16_bytes / GiB,
                memory.total_bytes / GiB, 100 * memory.total_ratio, memory.total_bf16_bytes / GiB,
                (memory.total_bytes - memory.quantized_bytes) / GiB)
    dense = held_dequantized_bytes(model)
    if dense:
        logger.info("Quantization %s: on the CPU the quantized layers are also held dequantized (%.2f GiB), "
                    "as the CPU has no int4 kernel", config.method, dense / GiB)
    return memory
