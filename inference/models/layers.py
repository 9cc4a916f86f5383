"""Building blocks shared by the decoder models: RMSNorm, rotary embedding, gated MLP activation."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from ..errors import ModelLoadError
from ..triton_utils import use_triton_layers


class RMSNorm(nn.Module):
    """Root-mean-square layer norm (Zhang & Sennrich, 2019), computed in float32.

    ``forward(x [T, H]) -> [T, H]``; with ``residual`` given, adds it first and returns
    ``(normed, new_residual)`` (the pre-norm residual stream of Llama-style blocks).
    """

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True).add_(self.eps))
        return self.weight * xf.to(dtype)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None, fp8_out: bool = False):
        """``fp8_out``: on the Triton path, return the normed rows quantized per token for an FP8 linear
        layer (``Fp8Activation``, made in the same kernel); the PyTorch path ignores it (the layer quantizes)."""
        if use_triton_layers(x):
            from . import triton_layers
            if residual is None:
                return triton_layers.rms_norm(x, self.weight, self.eps, fp8_out)
            return triton_layers.fused_add_rms_norm(x, residual, self.weight, self.eps, fp8_out)
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x


def silu_and_mul(gate_up: torch.Tensor, fp8_out: bool = False):
    """SwiGLU activation (Shazeer, 2020): ``[T, 2I] -> [T, I]``, ``silu(gate) * up``; ``fp8_out`` as in
    ``RMSNorm.forward``."""
    if use_triton_layers(gate_up):
        from . import triton_layers
        return triton_layers.silu_and_mul(gate_up, fp8_out)
    gate, up = gate_up.chunk(2, dim=-1)
    return nn.functional.silu(gate) * up


def _rope_parameters(config) -> dict:
    params = dict(getattr(config, "rope_parameters", None) or {})
    scaling = getattr(config, "rope_scaling", None) or {}
    for key, value in scaling.items():
        params.setdefault(key, value)
    if "rope_theta" not in params:
        params["rope_theta"] = getattr(config, "rope_theta", 10000.0)
    params.setdefault("rope_type", params.get("type", "default"))
    return params


def rope_inv_freq(config, head_dim: int) -> torch.Tensor:
    """Inverse frequencies ``[head_dim // 2]`` float32 of rotary embedding (Su et al., RoFormer, 2021).

    Supports the ``default``, ``linear`` and ``llama3`` rope types (Llama 3.1's frequency-dependent
    scaling, from Meta's reference implementation).

    Raises:
        ModelLoadError: for another rope type.
    """
    params = _rope_parameters(config)
    base = float(params["rope_theta"])
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
    inv_freq = 1.0 / (base ** exponents)
    rope_type = params["rope_type"]
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / float(params["factor"])
    if rope_type == "llama3":
        factor = float(params["factor"])
        low, high = float(params["low_freq_factor"]), float(params["high_freq_factor"])
        old_len = float(params["original_max_position_embeddings"])
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, smoothed, scaled)
    raise ModelLoadError(f"rope type {rope_type!r} is not supported (supported: default, linear, llama3).")


@dataclass
class RotaryPositions:
    """The step's token positions and, on the PyTorch path, their rows of the rotary tables, gathered once
    for all layers (``RotaryEmbedding.at``).

    Attributes:
        positions: ``[T]`` int64.
        cos: ``[T, 1, D]`` in the model dtype; None on the Triton path (its kernel reads the tables).
        sin_rotated: ``[T, 1, D]``, ``sin`` with its first half negated: ``x.roll(D // 2, -1) * sin_rotated``
            is ``rotate_half(x) * sin`` exactly (a negation commutes with the product), in one copy less.
    """

    positions: torch.Tensor
    cos: torch.Tensor | None = None
    sin_rotated: torch.Tensor | None = None


class RotaryEmbedding(nn.Module):
    """Applies rotary position embedding (rotate-half / GPT-NeoX layout, as in HF Llama).

    ``forward(positions [T] int64 or RotaryPositions, q [T, Hq, D], k [T, Hk, D]) -> (q, k)`` rotated,
    same dtype. The cos/sin table ``[max_position, D]`` is built once in float32.
    """

    def __init__(self, config, head_dim: int, max_position: int) -> None:
        super().__init__()
        self.inv_freq = rope_inv_freq(config, head_dim).to("cpu")
        self.max_position = max_position
        self.register_buffer("cos", torch.empty(max_position, head_dim, dtype=torch.float32), persistent=False)
        self.register_buffer("sin", torch.empty(max_position, head_dim, dtype=torch.float32), persistent=False)

    def reset_buffers(self) -> None:
        """(Re)compute the cos/sin table on the module's device (after construction on ``meta``)."""
        freqs = torch.arange(self.max_position, dtype=torch.float32, device="cpu")[:, None] * self.inv_freq[None, :]
        emb = torch.cat([freqs, freqs], dim=-1)
        self.cos = emb.cos().to(self.cos.device)
        self.sin = emb.sin().to(self.sin.device)

    def at(self, positions: torch.Tensor, dtype: torch.dtype) -> RotaryPositions:
        """The rows of ``positions [T]`` int64 in the tables, cast to ``dtype``, for every layer of a step
        (on the Triton path, the positions alone)."""
        if use_triton_layers(positions):
            return RotaryPositions(positions)
        sin = self.sin[positions].unsqueeze(1).to(dtype)
        half = sin.shape[-1] // 2
        sin[..., :half].neg_()
        return RotaryPositions(positions, self.cos[positions].unsqueeze(1).to(dtype), sin)

    def forward(self, positions: torch.Tensor | RotaryPositions, q: torch.Tensor, k: torch.Tensor,
                cache_write: tuple | None = None):
        """``cache_write``: ``(v, kv_cache, slot_mapping[, k_scale, v_scale])``, also store the rotated keys and
        ``v`` in the paged cache (one kernel on the Triton path; negative slots are skipped; the scales of an
        FP8 cache, :mod:`inference.attention.kv_quant`)."""
        rows = positions if isinstance(positions, RotaryPositions) else None
        if use_triton_layers(q):
            from . import triton_layers
            return triton_layers.rotary_embedding(rows.positions if rows else positions, q, k, self.cos, self.sin,
                                                  cache_write)
        if rows is None:
            rows = self.at(positions, q.dtype)
        half = q.shape[-1] // 2
        q = q * rows.cos + q.roll(half, -1) * rows.sin_rotated
        k = k * rows.cos + k.roll(half, -1) * rows.sin_rotated
        if cache_write is not None:
            from ..attention.torch_ref import store_kv
            v, kv_cache, slots, *scales = cache_write
            k_scale, v_scale = scales or (1.0, 1.0)
            keep = slots >= 0
            store_kv(k[keep], v[keep], kv_cache, slots[keep], k_scale, v_scale)
        return q, k
