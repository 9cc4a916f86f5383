"""AWQ and GPTQ 4-bit weights (W4A16): loaded in their published layouts, repacked once into the
internal layout of ``packing``, multiplied by the Triton W4A16 kernel on CUDA and, elsewhere, by
dequantize-then-matmul (the reference), with the dequantized weights kept from load on a CPU.
"""
from __future__ import annotations

import torch

from ..errors import ModelLoadError
from ..triton_utils import use_triton_layers
from . import packing
from .config import QuantizationConfig
from .linear import LinearMethodBase, QuantizedLinear

_DUMMY_SCALE = 0.0045  # random codes 0..15 around zero point 8: weights of std ~0.02, like the bf16 dummies


class Int4LinearMethod(LinearMethodBase):
    """4-bit weights with per-group float16 scales and 4-bit zero points (AWQ GEMM or GPTQ v1 on disk).

    After loading, the layer holds ``qweight [K_pad/8, N]`` int32 in the K-tiled layout of ``packing``,
    ``qzeros [G, N/8]`` int32 (true zero points), ``scales [G, N]`` float16, ``perm [K]`` int64 when
    act-order scattered the groups (rows are then sorted by group and ``x`` is permuted the same way),
    and the decode kernel's ``split_k_counters`` int32 buffer. On a CPU the layer also keeps
    ``dense_weight [K, N]`` in its parameters' dtype, dequantized once at load: the CPU has no int4
    kernel here (torch's ``_weight_int4pack_mm_for_cpu`` took 10-40x float32's time at 1-512 rows on
    the 0.5B shape's gate_up), and dequantizing every weight at every step made a decode step about 15x
    slower than the unquantized model's, so int4 saves disk and GPU memory, not CPU memory.

    Tensor parallelism (``K``, ``N``: this rank's features): a column-parallel rank holds its output
    columns of every tensor. A row-parallel rank holds its input rows of ``qweight`` and the groups
    they form: ``K`` is a multiple of the group size (checked at start-up), so its ``G = K / group``
    groups of scales and zero points are a slice too. Two cases keep the full ``[G_full, N]`` scales
    and zero points instead, as vLLM does: per-channel quantization (``group_size=-1``: one group
    spans every rank) and GPTQ act-order, whose ``g_idx [K]`` sends a rank's rows to groups all over
    the full input; the rank then keeps its rows in checkpoint order with their group indices
    (``row_groups [K]`` int32) and dequantizes each row with its own group's scale and zero point
    (no permutation of ``x``, which each rank holds only in part).
    """

    def __init__(self, config: QuantizationConfig) -> None:
        self.config = config
        self.is_awq = config.method == "awq"

    def create_weights(self, layer: QuantizedLinear, params_dtype: torch.dtype) -> None:
        K, N = layer.in_features, layer.out_features
        part = layer.partition
        group = K if self.config.group_size == -1 else self.config.group_size
        if K % group or group % 16 or K % 8 or N % 8:
            raise ModelLoadError(
                f"{self.config.method.upper()} group_size={self.config.group_size} does not fit a linear layer of "
                f"{K} input and {N} output features{' on this tensor-parallel rank' if part.tp.world_size > 1 else ''}"
                ": in_features must be a multiple of the group size, the group size a multiple of 16, and both "
                "feature counts multiples of 8 (try group_size 32, 64 or -1).", param="quantization")
        layer.group_size = group
        layer.keep_full_groups = part.splits_input and (self.config.group_size == -1
                                                        or (not self.is_awq and self.config.scattered_groups))
        num_groups = K // group
        if layer.keep_full_groups and self.config.group_size != -1:
            num_groups = part.full_in_features // group
        if self.is_awq:
            layer.register("qweight", (K, N // 8), torch.int32)
        else:
            layer.register("qweight", (K // 8, N), torch.int32)
            layer.register("g_idx", (K,), torch.int32)
        layer.register("qzeros", (num_groups, N // 8), torch.int32)
        layer.register("scales", (num_groups, N), torch.float16)
        layer.perm = None
        layer.row_groups = None

    def output_dim(self, param_name: str) -> tuple[int, int] | None:
        if param_name == "g_idx":
            return None
        if param_name == "scales" or (param_name == "qweight" and not self.is_awq):
            return (1, 1)
        return (1, 8)  # qzeros, AWQ's qweight

    def input_dim(self, layer: QuantizedLinear, param_name: str) -> tuple[int, int] | None:
        if param_name == "g_idx":
            return (0, 1)
        if param_name == "qweight":
            return (0, 1) if self.is_awq else (0, 8)
        return None if layer.keep_full_groups else (0, layer.group_size)  # scales, qzeros

    def dummy_checkpoint(self, layer: QuantizedLinear, generator: torch.Generator) -> dict[str, torch.Tensor]:
        K, N = layer.partition.full_in_features, layer.partition.full_out_features
        group = K if self.config.group_size == -1 else self.config.group_size
        device = layer.qweight.device
        shape = (K, N // 8) if self.is_awq else (K // 8, N)
        qweight = torch.empty(shape, dtype=torch.int32, device=device).random_(-2 ** 31, 2 ** 31 - 1,
                                                                              generator=generator)
        eights = torch.full((8,), 8 - (not self.is_awq), dtype=torch.int32, device=device)
        tensors = {"qweight": qweight,
                   "qzeros": packing.pack_cols(eights[None, :]).expand(K // group, N // 8).contiguous(),
                   "scales": torch.full((K // group, N), _DUMMY_SCALE, dtype=torch.float16, device=device)}
        if not self.is_awq:
            tensors["g_idx"] = packing.group_index(K, group, device)
        return tensors

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
                if layer.keep_full_groups and self.config.group_size != -1:
                    layer.row_groups = g_idx.to(torch.int32)
                else:
                    if not layer.keep_full_groups:  # this rank's groups start at its first row's
                        g_idx = g_idx - layer.partition.in_range[0] // layer.group_size
                    if not torch.equal(g_idx, packing.group_index(layer.in_features, layer.group_size,
                                                                  g_idx.device).long()):
                        layer.perm = self._act_order_perm(layer, g_idx)
                        codes = codes[layer.perm]
            layer.replace("qweight", packing.pack_ktiled(codes))
            layer.replace("qzeros", packing.pack_cols(zeros))
            # The decode kernel's split-K arrival counters: zero between calls (the kernel resets them).
            layer.register_buffer("split_k_counters", torch.zeros(
                packing.counters_size(layer.out_features), dtype=torch.int32, device=codes.device), persistent=False)
            dense = self.dequantized_weight(layer, layer.params_dtype) if codes.device.type == "cpu" else None
            layer.register_buffer("dense_weight", dense, persistent=False)

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
        if layer.row_groups is not None:
            return packing.dequantize(packing.unpack_ktiled(layer.qweight, layer.in_features), layer.scales,
                                      packing.unpack_cols(layer.qzeros), layer.row_groups, dtype)
        return packing.dequantize_internal(layer.qweight, layer.qzeros, layer.scales, layer.group_size, dtype)

    def apply(self, layer: QuantizedLinear, x: torch.Tensor) -> torch.Tensor:
        if use_triton_layers(x):
            from .triton_w4a16 import w4a16_matmul
            return w4a16_matmul(x, layer.qweight, layer.scales, layer.qzeros, layer.group_size, perm=layer.perm,
                                bias=layer.fused_bias, counters=layer.split_k_counters, row_groups=layer.row_groups)
        if layer.perm is not None:
            x = x.index_select(1, layer.perm)
        weight = layer.dense_weight
        if weight is None or weight.dtype != x.dtype or weight.device != x.device:
            weight = self.dequantized_weight(layer, x.dtype)
        out = torch.matmul(x, weight)
        return out if layer.fused_bias is None else out + layer.fused_bias.to(out.dtype)
