"""FP8 W8A8 (e4m3): weights quantized at load with one float32 scale per output channel, activations
quantized per token at run time, multiplied on FP8 tensor cores by ``torch._scaled_mm`` with row-wise
scales (as vLLM's ``fp8`` method does for a 16-bit checkpoint).

Reference (the CPU path, and the oracle of the tests): quantize both operands exactly as the GPU
does, dequantize them, and multiply in float32. On CUDA the activations are quantized by one fused
Triton kernel (``triton_fp8.per_token_fp8``, equal to ``quantize_fp8_rowwise``); the weights are kept
row-major ``[N, K]``, so ``weight.t()`` is the column-major ``[K, N]`` operand ``torch._scaled_mm`` wants
(no copy per call), with ``scale_a [T, 1]`` and ``scale_b [1, N]`` float32 and a bfloat16 output. Decode
steps of up to 256 tokens take a Triton FP8 GEMM with split-K instead where it is faster
(``triton_fp8_gemm.fp8_gemm_config``). The engine itself refuses ``quantization="fp8"`` without FP8
tensor cores (``check_fp8_supported``).
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from ..errors import InvalidRequestError
from ..triton_utils import num_sms, use_triton_layers
from .linear import LinearMethodBase, QuantizedLinear

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite float8_e4m3fn
_MIN_SCALE = 1e-12


class Fp8Activation(NamedTuple):
    """An activation already quantized per token by the kernel that produced it (RMSNorm or SwiGLU with
    ``fp8_out``), handed to an FP8 linear layer in place of the 16-bit tensor it stands for.

    ``codes [T, K]`` float8_e4m3fn, ``scales [T, 1]`` float32 (``x ~= codes * scales``), ``dtype``: the
    dtype of the 16-bit activation (the layer's output dtype).
    """
    codes: torch.Tensor
    scales: torch.Tensor
    dtype: torch.dtype


def check_fp8_supported(device: str) -> None:
    """Raise unless ``device`` has FP8 tensor cores (CUDA compute capability 8.9 or newer).

    Raises:
        InvalidRequestError (param ``"quantization"``): naming the requirement and this machine.
    """
    requirement = ("quantization='fp8' needs a GPU with FP8 tensor cores (compute capability >= 8.9, e.g. "
                   "H100/H200/L40S)")
    if not str(device).startswith("cuda") or not torch.cuda.is_available():
        raise InvalidRequestError(f"{requirement}; this machine runs on {device} (no CUDA device).",
                                  param="quantization")
    capability = torch.cuda.get_device_capability(torch.device(device))
    if capability < (8, 9):
        name = torch.cuda.get_device_name(torch.device(device))
        raise InvalidRequestError(f"{requirement}; this machine has {name} (compute capability "
                                  f"{capability[0]}.{capability[1]}). Use awq or gptq instead.", param="quantization")


def quantize_fp8_rowwise(x: torch.Tensor, row_max: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row FP8 quantization: ``x [R, C]`` -> ``(codes [R, C] float8_e4m3fn, scales [R, 1] float32)``
    with ``x ~= codes * scales`` and each row's largest magnitude mapped to 448.

    Args:
        row_max: ``[R, 1]`` float32 largest magnitude of each row, when ``x`` is only part of the
            rows (a row-parallel rank's columns; the maximum is then taken over all ranks).
    """
    if row_max is None:
        row_max = x.abs().amax(dim=-1, keepdim=True).float()
    scales = (row_max / FP8_MAX).clamp(min=_MIN_SCALE)
    codes = (x.float() / scales).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return codes, scales


class Fp8LinearMethod(LinearMethodBase):
    """W8A8 FP8 with per-output-channel weight scales and dynamic per-token activation scales.

    Loads ``weight [N, K]`` in the model dtype, then holds ``weight [N, K]`` float8_e4m3fn and
    ``weight_scale [N]`` float32.

    Tensor parallelism (``N``, ``K``: this rank's features): a column-parallel rank quantizes its
    output rows, whose scales are the matching slice of the full layer's. A row-parallel rank holds
    its input columns and all ``N`` scales, taken over the FULL rows (the ranks' row maxima are
    combined with a max all-reduce at load), so each rank's codes are exactly its columns of the
    single-GPU layer's. Activation scales are per token and per rank (over the rank's ``K``
    columns): each rank's partial product is scaled before the all-reduce sums them.
    """

    def create_weights(self, layer: QuantizedLinear, params_dtype: torch.dtype) -> None:
        layer.register("weight", (layer.out_features, layer.in_features), params_dtype)

    def output_dim(self, param_name: str) -> tuple[int, int] | None:
        return (0, 1)

    def input_dim(self, layer: QuantizedLinear, param_name: str) -> tuple[int, int] | None:
        return (1, 1)

    def dummy_checkpoint(self, layer: QuantizedLinear, generator: torch.Generator) -> dict[str, torch.Tensor]:
        part = layer.partition
        weight = torch.empty((part.full_out_features, part.full_in_features), dtype=layer.weight.dtype,
                             device=layer.weight.device)
        return {"weight": weight.normal_(0.0, 0.02, generator=generator)}

    def process_weights_after_loading(self, layer: QuantizedLinear) -> None:
        with torch.no_grad():
            row_max = None
            if layer.partition.splits_input:  # scales over the full rows: the max over the ranks
                row_max = layer.partition.tp.all_reduce_max(layer.weight.abs().amax(dim=-1, keepdim=True).float())
            codes, scales = quantize_fp8_rowwise(layer.weight, row_max)
        layer.replace("weight", codes)
        layer.replace("weight_scale", scales.reshape(-1))
        if codes.is_cuda:
            from .triton_fp8_gemm import max_counters_size
            # The Triton GEMM's split-K arrival counters: zero between calls (the kernel resets them).
            layer.register_buffer("fp8_split_k_counters", torch.zeros(
                max_counters_size(layer.weight.shape[0]), dtype=torch.int32, device=codes.device), persistent=False)
        else:
            layer.fp8_split_k_counters = None

    takes_fp8_activations = True  # the producer of x may quantize it (``Fp8Activation``)

    def apply(self, layer: QuantizedLinear, x: torch.Tensor | Fp8Activation) -> torch.Tensor:
        if isinstance(x, Fp8Activation):
            (x_codes, x_scales), dtype = x[:2], x.dtype
        elif use_triton_layers(x):
            from .triton_fp8 import per_token_fp8
            (x_codes, x_scales), dtype = per_token_fp8(x), x.dtype
        else:
            (x_codes, x_scales), dtype = quantize_fp8_rowwise(x), x.dtype
        bias = layer.fused_bias
        if x_codes.is_cuda:
            from .triton_fp8_gemm import fp8_gemm, fp8_gemm_config
            config = fp8_gemm_config(x_codes.shape[0], layer.weight.shape[0], layer.weight.shape[1],
                                     num_sms(x_codes.device))
            if config is not None:  # few rows: the Triton kernel (bias added in float32)
                return fp8_gemm(x_codes, x_scales, layer.weight, layer.weight_scale, config, bias=bias,
                                out_dtype=dtype, counters=layer.fp8_split_k_counters)
            # A row-major [T, K] times the column-major view [K, N] of the row-major weight; the bias
            # is added in the GEMM's epilogue (bfloat16, the output dtype).
            out = torch._scaled_mm(x_codes, layer.weight.t(), scale_a=x_scales,
                                   scale_b=layer.weight_scale.view(1, -1), out_dtype=torch.bfloat16,
                                   bias=None if bias is None else bias.to(torch.bfloat16))
            return out.to(dtype)
        w = layer.weight.float() * layer.weight_scale[:, None]
        out = torch.matmul(x_codes.float() * x_scales, w.t()).to(dtype)
        return out if bias is None else out + bias.to(out.dtype)
