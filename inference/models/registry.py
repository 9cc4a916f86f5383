"""Architecture name -> model class, and model construction on the target device and dtype."""
from __future__ import annotations

import itertools
from collections.abc import Callable

import torch
from torch import nn

from ..distributed.process_group import TensorParallelGroup
from ..errors import ModelLoadError, UnsupportedArchitectureError
from ..quantization import (QuantizationConfig, QuantizedLinear, log_weight_memory, process_quantized_weights,
                            quantize_linear_layers)
from .llama import LlamaFamilyForCausalLM
from .parallel_layers import SINGLE_RANK

SUPPORTED_ARCHITECTURES: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaFamilyForCausalLM,
    "MistralForCausalLM": LlamaFamilyForCausalLM,
    "Qwen2ForCausalLM": LlamaFamilyForCausalLM,
    "Qwen3ForCausalLM": LlamaFamilyForCausalLM,
}


def architecture_of(hf_config) -> str:
    """The supported architecture named by ``hf_config.architectures``.

    Raises:
        UnsupportedArchitectureError: listing the supported architectures.
    """
    names = list(getattr(hf_config, "architectures", None) or [])
    for name in names:
        if name in SUPPORTED_ARCHITECTURES:
            return name
    raise UnsupportedArchitectureError(
        f"Model architecture {names or getattr(hf_config, 'model_type', '?')} is not supported. "
        f"Supported architectures: {', '.join(SUPPORTED_ARCHITECTURES)}.")


def build_model(hf_config, dtype: torch.dtype, device: str, max_position: int, weights=None,
                check_fits: Callable[[int], None] | None = None,
                quant_config: QuantizationConfig | None = None, tp: TensorParallelGroup = SINGLE_RANK) -> nn.Module:
    """Construct the model (this tensor-parallel rank's part of it) directly on ``device`` in ``dtype``
    and load its weights.

    Args:
        weights: iterable of ``(hf_name, tensor)``; None initialises random weights
            (``load_format="dummy"``: normal(0, 0.02), norms at 1; the same whole model for every
            ``tensor_parallel_size``, of which each rank keeps its part).
        check_fits: called with the bytes of the parameters and buffers before any device memory is
            taken; it raises when they cannot fit (so that start-up never ends in a raw out-of-memory trace).
    Raises:
        UnsupportedArchitectureError, ModelLoadError: missing or mis-shaped tensors.
    """
    arch = architecture_of(hf_config)
    cls = SUPPORTED_ARCHITECTURES[arch]
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("meta"):  # no memory, no random init: every tensor is written below
            model = cls(hf_config, arch, max_position, tp)
            if quant_config is not None:
                quantize_linear_layers(model, quant_config)
    finally:
        torch.set_default_dtype(previous)
    if check_fits is not None:
        check_fits(sum(t.numel() * t.element_size() for t in itertools.chain(model.parameters(), model.buffers())))
    model.to_empty(device=device)
    for module in model.modules():
        if hasattr(module, "reset_buffers"):
            module.reset_buffers()
    if weights is None:
        _init_dummy(model)
        if quant_config is not None:
            process_quantized_weights(model, torch.Generator(device=device).manual_seed(0))
    else:
        try:
            loaded = model.load_weights(weights)
        except ValueError as exc:
            raise ModelLoadError(f"Weights do not match the model's config: {exc}") from exc
        missing = sorted(set(dict(model.named_parameters())) - loaded)
        if missing:
            raise ModelLoadError(f"Weights file lacks {len(missing)} tensors, e.g. {missing[:3]}")
        if quant_config is not None:
            process_quantized_weights(model)
    if quant_config is not None:
        log_weight_memory(model, quant_config)
    return model.eval()


@torch.no_grad()
def _init_dummy(model: nn.Module) -> None:
    """Random weights drawn on the parameters' own device (fast for 7B-sized models on a GPU).

    A tensor-parallel layer draws its whole unsplit parameter (``full_shape``) and keeps its part,
    so the random model is the same whatever the ``tensor_parallel_size``."""
    generator = None
    quantized = {id(p) for m in model.modules() if isinstance(m, QuantizedLinear) for p in m.parameters()}
    for name, param in model.named_parameters():
        if not param.is_floating_point() or id(param) in quantized:
            continue  # quantized layers draw their own, full-size (process_quantized_weights)
        if generator is None:
            generator = torch.Generator(device=param.device).manual_seed(0)
        module_name, _, param_name = name.rpartition(".")
        module = model.get_submodule(module_name)
        if "norm" in name:
            param.fill_(1.0)
        elif hasattr(module, "full_shape"):
            full = torch.empty(module.full_shape(param_name), dtype=param.dtype, device=param.device)
            module.load_weight(param_name, full.normal_(0.0, 0.02, generator=generator))
        else:
            param.normal_(0.0, 0.02, generator=generator)
