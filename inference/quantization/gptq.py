"""GPTQ: Hessian-based rounding (Frantar et al., 2022, "GPTQ: Accurate Post-Training Quantization for
Generative Pre-trained Transformers", arXiv:2210.17323).

Each linear layer's weights are rounded one input column at a time; the rounding error of a column is
spread over the columns not yet quantized through the inverse Hessian ``H = 2 X^T X`` of the layer's
calibration inputs (Optimal Brain Quantization), computed once as an upper Cholesky factor. Updates
are applied lazily in blocks of 128 columns (the paper's "lazy batch updates"). With act-order
(``desc_act``) columns are visited by decreasing ``diag(H)`` and the groups are formed in that order,
so ``g_idx`` maps each input row to its group. Symmetric quantization puts the zero point at 8.
"""
from __future__ import annotations

import torch

from . import packing

BLOCK_SIZE = 128
DAMP_PERCENT = 0.1  # of the mean diagonal: transformers' GPTQConfig default, robust to a small calibration set


def hessian(x: torch.Tensor) -> torch.Tensor:
    """``H = 2/T X^T X`` float32 ``[K, K]`` of the inputs ``x [T, K]``."""
    x = x.float()
    return 2.0 / x.shape[0] * (x.t() @ x)


@torch.no_grad()
def gptq_quantize(weight: torch.Tensor, H: torch.Tensor, group_size: int, sym: bool = True,
                  desc_act: bool = False, static_groups: bool = False):
    """Quantize ``weight [N, K]`` with Hessian ``H [K, K]``.

    ``static_groups`` (with ``desc_act``; AutoGPTQ's option of that name): each group's scale and zero point
    come from the unquantized weights of its input rows in their own order, before any column is rounded;
    columns are still visited by decreasing ``diag(H)``. ``g_idx`` then stays ``row // group_size``: the
    layout of a checkpoint without act-order, which the kernels read without a permutation.

    Returns ``(codes [K, N] int32, scales [G, N] float32, zeros [G, N] int32, g_idx [K] int32)``; the
    dequantized weights are ``packing.dequantize(codes, scales, zeros, g_idx)`` (``[K, N]``).
    """
    W = weight.float().clone()
    N, K = W.shape
    size = K if group_size == -1 else group_size
    H = H.clone()
    dead = torch.diag(H) == 0
    H[dead, dead] = 1
    W[:, dead] = 0
    static = None
    if static_groups and group_size != -1:  # params per original group, from the weights as they are
        static = [packing.minmax_params(W[:, g:g + size].t(), sym) for g in range(0, K, size)]
    perm = torch.argsort(torch.diag(H), descending=True) if desc_act else torch.arange(K, device=W.device)
    group_of = (perm // size).tolist() if static is not None else None  # original group of each visited column
    W, H = W[:, perm], H[perm][:, perm]
    H += DAMP_PERCENT * torch.mean(torch.diag(H)) * torch.eye(K, device=W.device)
    Hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(H)), upper=True)

    Q = torch.zeros_like(W)
    scales, zeros = [], []
    params = packing.minmax_params(W.t(), sym) if group_size == -1 else None
    for i1 in range(0, K, BLOCK_SIZE):
        i2 = min(i1 + BLOCK_SIZE, K)
        W1, Hinv1 = W[:, i1:i2].clone(), Hinv[i1:i2, i1:i2]
        Err1 = torch.zeros_like(W1)
        for i in range(i2 - i1):
            col = i1 + i
            if static is not None:
                params = static[group_of[col]]
            elif col % size == 0:
                # The group's params from its columns as updated so far (those beyond this block
                # carry the lazy updates of all earlier blocks).
                cols = W1[:, i:i + size]
                if cols.shape[1] < size:
                    cols = torch.cat([cols, W[:, i2:i2 + size - cols.shape[1]]], dim=1)
                params = packing.minmax_params(cols.t(), sym)
                scales.append(params[0])
                zeros.append(params[1])
            s, z = params
            w = W1[:, i]
            q = (torch.clamp(torch.round(w / s) + z, 0, 15) - z) * s
            Q[:, col] = q
            err = (w - q) / Hinv1[i, i]
            W1[:, i:] -= err[:, None] @ Hinv1[i, i:][None, :]
            Err1[:, i] = err
        W[:, i2:] -= Err1 @ Hinv[i1:i2, i2:]

    inverse = torch.argsort(perm)
    if static is not None:  # groups of consecutive original rows
        g_idx = (torch.arange(K, device=W.device) // size).to(torch.int32)
        scales_t, zeros_t = torch.stack([p[0] for p in static]), torch.stack([p[1] for p in static])
    else:
        g_idx = (inverse // size).to(torch.int32)                    # group of each original input row
        scales_t, zeros_t = torch.stack(scales), torch.stack(zeros)  # groups in visiting order
    codes = packing.quantize_codes(Q[:, inverse].t(), scales_t, zeros_t, g_idx)
    return codes, scales_t, zeros_t, g_idx
