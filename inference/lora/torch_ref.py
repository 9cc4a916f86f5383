"""The batched LoRA matmuls in PyTorch: the CPU path and the oracle of :mod:`.triton_lora`.

A step's token rows are grouped by adapter slot (Punica's segments, Chen et al., "Punica:
Multi-Tenant LoRA Serving", 2023): slot ``s`` owns rows ``sorted_rows[slot_starts[s]:slot_starts[s + 1]]``;
rows of requests without an adapter are in no segment and are left alone.

* shrink: ``s[t] = A[slot(t)] x[t]`` for every stacked slice of the layer at once
  (``A [S, n_slices * r_max, K]``), into float32;
* expand: ``out[t, slice k] += B[slot(t), slice k rows] s[t, k * r_max:(k + 1) * r_max]``
  (``B [S, N, r_max]``, already scaled), in place.
"""
from __future__ import annotations

import torch


def lora_shrink_ref(x: torch.Tensor, a: torch.Tensor, sorted_rows: torch.Tensor,
                    slot_starts: torch.Tensor) -> torch.Tensor:
    """``[T, R]`` float32 low-rank activations (zero in rows without an adapter).

    Args:
        x: ``[T, K]`` inputs; a: ``[S, R, K]`` stacked ``A`` of every slot.
        sorted_rows: ``[>= T]`` int32 token rows grouped by slot; slot_starts: ``[S + 1]`` int32 offsets.
    """
    out = torch.zeros((x.shape[0], a.shape[1]), dtype=torch.float32, device=x.device)
    starts = slot_starts.tolist()
    for slot in range(a.shape[0]):
        if starts[slot + 1] > starts[slot]:
            rows = sorted_rows[starts[slot]:starts[slot + 1]].long()
            out[rows] = x[rows].float() @ a[slot].float().t()
    return out


def lora_expand_ref(out: torch.Tensor, s: torch.Tensor, b: torch.Tensor, sorted_rows: torch.Tensor,
                    slot_starts: torch.Tensor, slice_starts: tuple[int, ...], r_max: int) -> None:
    """``out[t, n] += sum_j B[slot(t), n, j] * s[t, k(n) * r_max + j]`` in place, ``k(n)`` the slice of column ``n``.

    Args:
        out: ``[T, N]`` the base layer's output; s: ``[T, n_slices * r_max]`` float32 (from the shrink);
        b: ``[S, N, r_max]``; slice_starts: ``n_slices + 1`` column offsets of the slices in ``out``.
    """
    starts = slot_starts.tolist()
    for slot in range(b.shape[0]):
        if starts[slot + 1] <= starts[slot]:
            continue
        rows = sorted_rows[starts[slot]:starts[slot + 1]].long()
        for k in range(len(slice_starts) - 1):
            n0, n1 = slice_starts[k], slice_starts[k + 1]
            delta = s[rows, k * r_max:(k + 1) * r_max] @ b[slot, n0:n1].float().t()
            out[rows, n0:n1] += delta.to(out.dtype)
