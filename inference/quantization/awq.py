"""AWQ: activation-aware weight quantization (Lin et al., 2023, "AWQ: Activation-aware Weight
Quantization for LLM Compression and Acceleration", arXiv:2306.00978).

For each group of linear layers that read the same input (Q/K/V after the input norm, gate/up after
the post-attention norm, down after up, O after V when their shapes match), AWQ searches a per-input-
channel scale ``s = mean|x|^alpha`` (alpha on a grid of ``n_grid`` points in [0, 1)) that minimises
``|| Q(W diag(s)) (diag(s)^-1 X) - W X ||^2`` on calibration activations, folds ``1/s`` into the
previous operation (norm weight, or the previous linear's output rows) so the float model is
unchanged, then searches per-group clipping of the weights' range (section 3.3 of the paper,
AutoAWQ's ``auto_clip``) for the layers other than Q/K. Weights are then rounded to 4 bits with
asymmetric min-max zero points per group.
"""
from __future__ import annotations

import torch
from torch import nn

from . import packing

N_GRID = 20               # the paper's grid of alpha values (and of clipping ratios down to 0.5)
MAX_SEARCH_TOKENS = 512   # activations used by the scale search
MAX_CLIP_TOKENS = 128     # and by the clip search
# Linears reading another's input: after ``quantize_layer``, ``inputs[SHARED_INPUTS.get(name, name)]`` is what
# ``name`` reads once the scales are folded.
SHARED_INPUTS = {"k_proj": "q_proj", "v_proj": "q_proj", "up_proj": "gate_proj"}


def fake_quantize(w: torch.Tensor, group_size: int, sym: bool = False) -> torch.Tensor:
    """Round ``w [N, K]`` to 4 bits per group of ``group_size`` input channels and back (float32)."""
    N, K = w.shape
    size = K if group_size == -1 else group_size
    grouped = w.float().reshape(N, K // size, size)
    scales, zeros = packing.minmax_params(grouped, sym, dim=-1)       # [N, G]
    scales, zeros = scales[..., None], zeros[..., None]
    q = torch.clamp(torch.round(grouped / scales) + zeros, 0, 15)
    return ((q - zeros) * scales).reshape(N, K)


def round_to_nearest(w: torch.Tensor, group_size: int, sym: bool = False):
    """4-bit codes of ``w [N, K]`` with min-max params per group.

    Returns ``(codes [K, N] int32, scales [G, N] float32, zeros [G, N] int32, g_idx [K] int32)``.
    """
    N, K = w.shape
    g_idx = packing.group_index(K, group_size, w.device)
    num_groups = int(g_idx[-1]) + 1
    size = K // num_groups
    w_t = w.float().t()
    params = [packing.minmax_params(w_t[g * size:(g + 1) * size], sym) for g in range(num_groups)]
    scales = torch.stack([p[0] for p in params])
    zeros = torch.stack([p[1] for p in params])
    return packing.quantize_codes(w_t, scales, zeros, g_idx), scales, zeros, g_idx


def _subsample(x: torch.Tensor, n: int) -> torch.Tensor:
    if x.shape[0] <= n:
        return x
    return x[torch.linspace(0, x.shape[0] - 1, n).long()]


@torch.no_grad()
def search_scales(x: torch.Tensor, linears: list[nn.Linear], group_size: int, n_grid: int = N_GRID) -> torch.Tensor:
    """The best per-input-channel scale ``s [K]`` for ``linears`` reading ``x [T, K]`` (paper, eq. 5)."""
    x = _subsample(x.float(), MAX_SEARCH_TOKENS)
    weight = torch.cat([lin.weight.float() for lin in linears])
    reference = x @ weight.t()
    x_mean = x.abs().mean(0)
    best, best_loss = torch.ones_like(x_mean), float("inf")
    for i in range(n_grid):
        s = x_mean.pow(i / n_grid).clamp(min=1e-4)
        s = s / (s.max() * s.min()).sqrt()
        w_q = fake_quantize(weight * s, group_size) / s
        loss = (x @ w_q.t() - reference).pow(2).mean().item()
        if loss < best_loss:
            best, best_loss = s, loss
    return best


@torch.no_grad()
def apply_scales(s: torch.Tensor, previous: nn.Module, linears: list[nn.Linear]) -> None:
    """Fold ``s`` into the layers: ``linears`` columns times ``s``, ``previous``'s output (an RMSNorm's
    weight, or a linear's rows and bias) divided by ``s``, which leaves the float model's output unchanged."""
    for lin in linears:
        lin.weight.mul_(s.to(lin.weight.dtype))
    if isinstance(previous, nn.Linear):
        previous.weight.div_(s[:, None].to(previous.weight.dtype))
        if previous.bias is not None:
            previous.bias.div_(s.to(previous.bias.dtype))
    else:
        previous.weight.div_(s.to(previous.weight.dtype))


@torch.no_grad()
def search_clip(x: torch.Tensor, linear: nn.Linear, group_size: int, n_grid: int = N_GRID) -> torch.Tensor:
    """Per-(row, group) clipping bound ``[N, G]`` minimising each group's partial output error
    ``|| X_g Q(clip(W_g))^T - X_g W_g^T ||^2`` over a grid of shrink factors down to 0.5."""
    x = _subsample(x.float(), MAX_CLIP_TOKENS)
    w = linear.weight.float()
    N, K = w.shape
    size = K if group_size == -1 else group_size
    num_groups = K // size
    xg = x.reshape(x.shape[0], num_groups, size).transpose(0, 1)       # [G, T, size]
    wg = w.reshape(N, num_groups, size)                                 # [N, G, size]
    reference = torch.bmm(xg, wg.permute(1, 2, 0))                      # [G, T, N]
    original_max = wg.abs().amax(-1)                                    # [N, G]
    best_max, best_err = original_max.clone(), torch.full_like(original_max, float("inf"))
    for i in range(n_grid // 2):
        max_val = original_max * (1 - i / n_grid)
        clipped = torch.maximum(torch.minimum(wg, max_val[..., None]), -max_val[..., None])
        q = fake_quantize(clipped.reshape(N * num_groups, size), size).reshape(N, num_groups, size)
        err = (torch.bmm(xg, q.permute(1, 2, 0)) - reference).pow(2).mean(1).t()   # [N, G]
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best_max = torch.where(better, max_val, best_max)
    return best_max


@torch.no_grad()
def apply_clip(linear: nn.Linear, bounds: torch.Tensor, group_size: int) -> None:
    N, K = linear.weight.shape
    size = K if group_size == -1 else group_size
    w = linear.weight.view(N, K // size, size)
    b = bounds[..., None].to(w.dtype)
    w.copy_(torch.maximum(torch.minimum(w, b), -b))


@torch.no_grad()
def quantize_layer(layer: nn.Module, inputs: dict[str, torch.Tensor], group_size: int,
                   n_grid: int = N_GRID, scaled_weights: dict[str, torch.Tensor] | None = None) -> dict[str, tuple]:
    """AWQ one Llama-style decoder layer of transformers in place (scales folded, weights clipped and
    replaced by their 4-bit values) from the recorded inputs of its linears (``inputs["q_proj"]`` ...,
    each ``[T, in_features]``), searching ``n_grid`` scale exponents and ``n_grid // 2`` clipping ratios.
    ``inputs`` is updated to what the scaled linears read; ``scaled_weights``, when given, receives each
    linear's float weight once the scales are folded, before clipping and rounding (the float model it equals).
    Returns ``{linear name: round_to_nearest(...)}``."""
    attn, mlp = layer.self_attn, layer.mlp
    groups = [(layer.input_layernorm, [attn.q_proj, attn.k_proj, attn.v_proj], "q_proj"),
              (layer.post_attention_layernorm, [mlp.gate_proj, mlp.up_proj], "gate_proj"),
              (mlp.up_proj, [mlp.down_proj], "down_proj")]
    if attn.v_proj.weight.shape == attn.o_proj.weight.shape:  # no grouped-query attention
        groups.append((attn.v_proj, [attn.o_proj], "o_proj"))
    for previous, linears, input_name in groups:
        x = inputs[input_name]
        s = search_scales(x, linears, group_size, n_grid)
        apply_scales(s, previous, linears)
        inputs[input_name] = x / s        # what the scaled linears now read
    names = {"q_proj": attn.q_proj, "k_proj": attn.k_proj, "v_proj": attn.v_proj, "o_proj": attn.o_proj,
             "gate_proj": mlp.gate_proj, "up_proj": mlp.up_proj, "down_proj": mlp.down_proj}
    if scaled_weights is not None:
        scaled_weights.update({name: linear.weight.detach().clone() for name, linear in names.items()})
    result = {}
    for name, linear in names.items():
        if name not in ("q_proj", "k_proj"):  # clipping Q/K hurts attention scores (AWQ)
            apply_clip(linear, search_clip(inputs[SHARED_INPUTS.get(name, name)], linear, group_size, n_grid),
                       group_size)
        codes, scales, zeros, g_idx = round_to_nearest(linear.weight, group_size)
        result[name] = (codes, scales, zeros, g_idx)
        linear.weight.copy_(packing.dequantize(codes, scales, zeros, g_idx).t().to(linear.weight.dtype))
    return result
