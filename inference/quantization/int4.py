"""AWQ and GPTQ 4-bit weights (W4A16): loaded in their published layouts, repacked once into the
internal layout of ``packing``, multiplied by the Triton W4A16 kernel on CUDA and by
dequantize-then-matmul (the reference) elsewhere.
"""
from __future__ import annotations

import torch

from ..errors import ModelLoadError
from ..models.layers import use_triton_layers
from . import packing
from .config import QuantizationConfig
from .linear import LinearMethodBase, QuantizedLinear

_DUMMY_SCALE = 0.0045  # random codes 0..15 around zero point 8: weights of std ~0.02, like the bf16 dummies


class Int4LinearMethod(LinearMethodBase):
    """4-bit weights with per-group float16 scales and 4-bit zero points (AWQ GEMM or GPTQ v1 on disk).

    After loading, the layer holds ``qweight [K_pad/8, N]`` int32 in the K-tiled layout of ``packing``,
    ``qzeros [G, N/8]`` int32 (true zero points), ``scales [G, N]`` float16, ``perm [K]`` int64 when
    act-order scattered the groups (rows are then sorted by group and ``x`` is permuted the same way),
    and the decode kernel's ``split_k_counters`` int32 buffer.
    """

    def __init__(self, config: QuantizationConfig) -> None:
        self.config = config
        self.is_awq = config.method == "awq"

    def create_weights(self, layer: QuantizedLinear, params_dtype: torch.dtype) -> None:
        K, N = layer.in_features, layer.out_features
        group = K if self.config.group_size == -1 else self.config.group_size
        if K % group or group % 16 or K % 8 or N % 8:
            raise ModelLoadError(
                f"{self.config.method.upper()} group_size={self.config.group_size} does not fit a linear layer of "
                f"{K} input and {N} output features: in_features must be a multiple of the group size, the group "
                "size a multiple of 16, and both feature counts multiples of 8 (try group_size 32, 64 or -1).",
                param="quantization")
        layer.group_size = group
        num_groups = K // group
        if self.is_awq:
            layer.register("qweight", (K, N // 8), torch.int32)
        else:
            layer.register("qweight", (K // 8, N), torch.int32)
            layer.register("g_idx", (K,), torch.int32)
        layer.register("qzeros", (num_groups, N // 8), torch.int32)
        layer.register("scales", (num_groups, N), torch.float16)
        layer.perm = None

    def output_dim(self, param_name: str) -> tuple[int, int] | None:
        if param_name == "g_idx":
            return None
        if param_name == "scales" or (param_name == "qweight" and not self.is_awq):
            return (1, 1)
        return (1, 8)  # qzeros, AWQ's qweight

    def init_dummy(self, layer: QuantizedLinear, generator: torch.Generator) -> None:
        with torch.no_grad():
            layer.qweight.random_(-2 ** 31, 2 ** 31 - 1, generator=generator)
            eights = torch.full((8,), 8 - (not self.is_awq), dtype=torch.int32, device=layer.qzeros.device)
            layer.qzeros.copy_(packing.pack_cols(eights[None, :]).expand_as(layer.qzeros))
            layer.scales.fill_(_DUMMY_SCALE)
            if not self.is_awq:
                layer.g_idx.copy_(packing.group_index(layer.in_features, layer.group_size, layer.g_idx.device))

    def process_weights_after_loading(self, layer: QuantizedLinear) -> None:
        with torch.no_grad():
            if self.is_awq:
                codes = packing.unpack_awq(layer.qweight)
                zeros = packing.unpack_awq(layer.qzeros)
            else:
                codes = packing.unpack_gptq_qweight(layer.qweight)
                zeros = (packing.unpack_cols(layer.qzeros) + 1) & 0xF  # v1 stores zero - 1
                g_idx = layer.g_idx.to(torch.int64)
                layer.replace("g_idx", None)
                if not torch.equal(g_idx, packing.group_index(layer.in_features, layer.group_size,
                                                              g_idx.device).long()):
                    layer.perm = self._act_order_perm(layer, g_idx)
                    codes = codes[layer.perm]
            layer.replace("qweight", packing.pack_ktiled(codes))
            layer.replace("qzeros", packing.pack_cols(zeros))
            # The decode kernel's split-K arrival counters: zero between calls (the kernel resets them).
            layer.register_buffer("split_k_counters", torch.zeros(
                2 * -(-layer.out_features // 32), dtype=torch.int32, device=codes.device), persistent=False)

    @staticmethod
    def _act_order_perm(layer: QuantizedLinear, g_idx: torch.Tensor) -> torch.Tensor:
        perm = torch.argsort(g_idx, stable=True)
        expected = packing.group_index(layer.in_features, layer.group_size, g_idx.device).long()
        if not torch.equal(g_idx[perm], expected):
            raise ModelLoadError("GPTQ g_idx does not assign group_size input rows to each group.",
                                 param="quantization")
        return perm

    def dequantized_weight(self, layer: QuantizedLinear, dtype: torch.dtype) -> torch.Tensor:
        """The layer's weights ``[K, N]`` in ``dtype`` (rows in the order ``apply`` multiplies them)."""
        return packing.dequantize_internal(layer.qweight, layer.qzeros, layer.scales, layer.group_size, dtype)

    def apply(self, layer: QuantizedLinear, x: torch.Tensor) -> torch.Tensor:
        if use_triton_layers(x):
            from .triton_w4a16 import w4a16_matmul
            return w4a16_matmul(x, layer.qweight, layer.scales, layer.qzeros, layer.group_size, perm=layer.perm,
                                bias=layer.bias, counters=layer.split_k_counters)
        if layer.perm is not None:
            x = x.index_select(1, layer.perm)
        out = torch.matmul(x, self.dequantized_weight(layer, x.dtype))
        return out if layer.bias is None else out + layer.bias.to(out.dtype)
