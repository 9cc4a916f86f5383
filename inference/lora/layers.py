"""LoRA on the model's projections: a wrapper around each linear layer, and the step's slot segments.

``LoRALinear`` keeps the base layer and adds ``B (A x)`` per token with the adapter of the token's
slot. Its weights are stacked over the ``max_loras`` slots, each padded to ``max_lora_rank``:

* ``lora_a`` ``[S, n_slices * r_max, in_local]``: one ``A`` per fused projection (``q, k, v`` in
  ``qkv_proj``, ``gate, up`` in ``gate_up_proj``), stacked, so one shrink serves them all;
* ``lora_b`` ``[S, out_local, r_max]``: each output row reads its own projection's ``r_max`` columns of
  the shrink.

A dense base layer keeps its weight in the first rows of ``stacked_weight [N + S * n_slices * r_max, in_local]``
and ``lora_a`` in the rows below: a small batch (a decode step) runs one GEMM for the base output and every slot's
shrink, then one expand that adds each row's own slot (:func:`.triton_lora.lora_expand_all_slots`); a large batch
runs the base layer and the segmented kernels, which read only each row's own slot.

Tensor parallelism (Megatron's split, as the base layers): a column-parallel layer keeps its output
rows of ``B`` and all of ``A``; a row-parallel layer keeps its input columns of ``A`` and all of ``B``,
and all-reduces the shrink's ``[T, R]`` partial sums before the expand (one small all-reduce; in the one-GEMM
path the all-reduce of the base output carries them).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from ..host_to_device import to_device
from ..triton_utils import use_triton_layers
from .checkpoint import LoRAAdapter
from .tiles import max_tiles, segment_tiles
from .torch_ref import lora_expand_ref, lora_shrink_ref


class LoRABatch:
    """Which token rows use which slot in the current step, in static device buffers (a CUDA graph
    replays with whatever they hold).

    Attributes:
        sorted_rows: ``[max_tokens]`` int32, the rows of the step's tokens that use an adapter, grouped by slot.
        slot_starts: ``[max_loras + 1]`` int32, slot ``s``'s rows are ``sorted_rows[slot_starts[s]:slot_starts[s + 1]]``.
        tiles: ``[max_tiles(max_tokens, max_loras), 3]`` int32, the segments' row tiles the Triton kernels take
            (:func:`.tiles.segment_tiles`; on the CPU unused).
        row_slots: ``[max_tokens]`` int32, each row's slot in row order (-1: none), for the small-batch expand
            (:func:`.triton_lora.lora_expand_all_slots`).
        num_lora_rows: host count of those rows (0: the PyTorch path skips LoRA in the step).
        static: run the kernels even in a step without adapters (set while CUDA graphs are used: a graph
            must see the same launches in every step).
    """

    def __init__(self, max_tokens: int, max_loras: int, device: str) -> None:
        self.device = device
        self.max_loras = max_loras
        self.sorted_rows = torch.zeros(max_tokens, dtype=torch.int32, device=device)
        self.slot_starts = torch.zeros(max_loras + 1, dtype=torch.int32, device=device)
        self.num_tiles = max_tiles(max_tokens, max_loras)
        self.tiles = torch.zeros(self.num_tiles, 3, dtype=torch.int32, device=device)
        self.row_slots = torch.full((max_tokens,), -1, dtype=torch.int32, device=device)
        self._row_slots_written = 0  # rows of row_slots that may hold a slot (the rest are -1)
        self.num_lora_rows = 0
        self.static = False
        self.uses_tiles = torch.device(device).type == "cuda"  # the Triton kernels' row tiles (not on the CPU path)

    def prepare(self, token_slots: np.ndarray) -> None:
        """Fill the buffers for a step whose row ``t`` uses slot ``token_slots[t]`` (``[T]`` int32, -1: none)."""
        used = token_slots >= 0
        rows = np.flatnonzero(used)
        rows = rows[np.argsort(token_slots[rows], kind="stable")].astype(np.int32)
        counts = np.bincount(token_slots[used], minlength=self.max_loras)
        starts = np.zeros(self.max_loras + 1, dtype=np.int32)
        np.cumsum(counts, out=starts[1:])
        self.num_lora_rows = int(rows.size)
        if not rows.size and not self.static:
            return
        # row_slots: this step's rows, and -1 over the rows an earlier step wrote beyond them
        row_slots = np.full(max(token_slots.size, self._row_slots_written), -1, dtype=np.int32)
        row_slots[:token_slots.size] = token_slots
        self._row_slots_written = token_slots.size
        arrays = [rows, starts, row_slots]
        if self.uses_tiles:
            arrays.append(segment_tiles(starts, self.num_tiles))
        sorted_rows, slot_starts, row_slots_d, *tiles = to_device(arrays, self.device)
        self.sorted_rows[:rows.size].copy_(sorted_rows)
        self.slot_starts.copy_(slot_starts)
        self.row_slots[:row_slots.size].copy_(row_slots_d)
        if tiles:
            self.tiles.copy_(tiles[0])

    @property
    def active(self) -> bool:
        return self.static or self.num_lora_rows > 0


@dataclass(frozen=True)
class LoRASlice:
    """One Hugging Face projection inside a (possibly fused) layer on this rank.

    Attributes:
        name: the projection (``"q_proj"``).
        out_start, out_end: its rows in the layer's local output.
        full_rows: ``[start, end)`` of those rows within the projection's full output (``B``'s rows kept).
    """

    name: str
    out_start: int
    out_end: int
    full_rows: tuple[int, int]


def _slices(base: nn.Module, name: str) -> tuple[tuple[LoRASlice, ...], tuple[int, int], bool, object]:
    """The slices of ``base``, its input columns of the full layer, whether it all-reduces, and its group."""
    part = base.linear_partition() if hasattr(base, "linear_partition") else base.partition
    if part.shard_ranges:
        slices, start = [], 0
        for shard, (lo, hi) in part.shard_ranges.items():
            slices.append(LoRASlice(shard, start, start + hi - lo, (lo, hi)))
            start += hi - lo
    else:
        (lo, hi), = part.out_ranges  # an unfused layer keeps one run of rows
        slices = [LoRASlice(name, 0, hi - lo, (lo, hi))]
    return tuple(slices), part.in_range, part.reduce, part.tp


# Rows times slots up to which a GPU step computes every row's shrink against every slot (in the base GEMM, or
# :func:`.triton_lora.lora_shrink_all_slots` beyond the expand's columns): decode batches up to 512 rows over 8
# slots. Above it, the segmented shrink, which reads each row against its own slot only.
ALL_SLOTS_MAX_ROWS = 4096
# Slots times rank up to which the one-GEMM path's expand runs (:func:`.triton_lora.lora_expand_all_slots`
# holds every slot's B for a column tile: 256 columns keep it within registers and shared memory; 2,048 would
# not fit an H100's shared memory). Above it, the base layer, the every-slot shrink and the segmented expand.
EXPAND_ALL_SLOTS_MAX_COLUMNS = 256


def _stack_below_weight(base: nn.Module, rows: int, in_local: int, dtype: torch.dtype) -> torch.Tensor | None:
    """For a dense layer (``weight [N, K]`` of the model dtype): ``[N + rows, K]`` holding the weight, then zeros, with
    the layer's weight replaced by a view of its first ``N`` rows (the old tensor is freed). The rows below hold
    every slot's ``A``, so that one GEMM computes the base output and the shrink of every slot. None for layers
    that keep their own weight format (quantized)."""
    weight = getattr(base, "weight", None)
    if not (isinstance(base, nn.Linear) and isinstance(weight, torch.Tensor) and weight.dtype == dtype
            and weight.dim() == 2 and weight.shape[1] == in_local and weight.is_contiguous()):
        return None
    stacked = torch.zeros(weight.shape[0] + rows, in_local, dtype=dtype, device=weight.device)
    with torch.no_grad():
        stacked[:weight.shape[0]].copy_(weight)
    base.weight = nn.Parameter(stacked[:weight.shape[0]], requires_grad=weight.requires_grad)
    return stacked


class LoRALinear(nn.Module):
    """``forward(x [T, in_local]) -> base(x) + B[slot] A[slot] x`` per token (see the module docstring).

    Args:
        base: the layer to wrap (a parallel linear layer or a quantized one).
        layer_index: the decoder layer it belongs to; name: its attribute name (``"o_proj"``).
        batch: the step's slot segments, shared by every wrapped layer.
    """

    takes_fp8_activations = False  # the LoRA shrink reads x itself: the base layer gets plain activations

    def __init__(self, base: nn.Module, layer_index: int, name: str, max_loras: int, r_max: int,
                 dtype: torch.dtype, device: str, batch: LoRABatch) -> None:
        super().__init__()
        self.base = base
        self.layer_index = layer_index
        self.slices, self.in_range, self.reduce, self.tp = _slices(base, name)
        self.r_max = r_max
        in_local = self.in_range[1] - self.in_range[0]
        out_local = self.slices[-1].out_end
        self.stacked_weight = _stack_below_weight(base, max_loras * len(self.slices) * r_max, in_local, dtype)
        if self.stacked_weight is not None:
            self.lora_a = self.stacked_weight[base.weight.shape[0]:].view(max_loras, len(self.slices) * r_max, in_local)
        else:
            self.lora_a = torch.zeros(max_loras, len(self.slices) * r_max, in_local, dtype=dtype, device=device)
        self.lora_b = torch.zeros(max_loras, out_local, r_max, dtype=dtype, device=device)
        starts = [s.out_start for s in self.slices] + [out_local]
        self.slice_starts = tuple(starts)
        self.slice_starts_t = torch.tensor(starts, dtype=torch.int32, device=device)
        self.max_slice_width = max(s.out_end - s.out_start for s in self.slices)
        self.batch = batch

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            base = self.__dict__["_modules"].get("base")
            if base is None:
                raise
            return getattr(base, name)  # the base layer's attributes (partition, shard_ranges)

    def load_slot(self, slot: int, adapter: LoRAAdapter | None) -> None:
        """Copy this rank's part of ``adapter``'s weights for this layer into ``slot`` (zeros where the
        adapter does not target a projection; ``None`` clears the slot)."""
        a = torch.zeros(self.lora_a.shape[1:], dtype=torch.float32)
        b = torch.zeros(self.lora_b.shape[1:], dtype=torch.float32)
        lo, hi = self.in_range
        for k, piece in enumerate(self.slices):
            weights = None if adapter is None else adapter.weights.get((self.layer_index, piece.name))
            if weights is None:
                continue
            full_a, full_b = weights
            r = full_a.shape[0]
            a[k * self.r_max:k * self.r_max + r] = full_a[:, lo:hi]
            b[piece.out_start:piece.out_end, :r] = full_b[piece.full_rows[0]:piece.full_rows[1]]
        self.lora_a[slot].copy_(a.to(self.lora_a.dtype))
        self.lora_b[slot].copy_(b.to(self.lora_b.dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch = self.batch
        if not batch.active:
            return self.base(x)
        flat = x.reshape(-1, x.shape[-1])
        small = flat.shape[0] * self.lora_a.shape[0] <= ALL_SLOTS_MAX_ROWS
        if (small and self.stacked_weight is not None and use_triton_layers(x)
                and self.lora_a.shape[0] * self.r_max <= EXPAND_ALL_SLOTS_MAX_COLUMNS):
            from .triton_lora import lora_expand_all_slots  # noqa: PLC0415
            # one GEMM gives the base output and every slot's shrink; the expand adds each row's own slot
            y = flat @ self.stacked_weight.t()
            if self.reduce and self.tp.world_size > 1:
                y = self.tp.all_reduce(y)
            out = lora_expand_all_slots(y, self.lora_b, self.base.bias, batch.row_slots, self.slice_starts_t,
                                        self.max_slice_width)
            return out.view(*x.shape[:-1], out.shape[-1])
        out = self.base(x)
        out2 = out.view(-1, out.shape[-1])
        if use_triton_layers(x):
            from .triton_lora import lora_expand_, lora_shrink, lora_shrink_all_slots  # noqa: PLC0415
            slot_stride = 0
            if small:
                s = lora_shrink_all_slots(flat, self.lora_a)
                slot_stride = self.lora_a.shape[1]
            else:
                s = lora_shrink(flat.contiguous(), self.lora_a, batch.sorted_rows, batch.tiles)
            if self.reduce and self.tp.world_size > 1:
                s = self.tp.all_reduce(s)
            lora_expand_(out2, s, self.lora_b, batch.sorted_rows, batch.tiles, self.slice_starts_t,
                         self.r_max, self.max_slice_width, slot_stride)
            return out
        s = lora_shrink_ref(flat, self.lora_a, batch.sorted_rows, batch.slot_starts)
        if self.reduce and self.tp.world_size > 1:
            s = self.tp.all_reduce(s)
        lora_expand_ref(out2, s, self.lora_b, batch.sorted_rows, batch.slot_starts, self.slice_starts, self.r_max)
        return out


_WRAPPED = (("self_attn", "qkv_proj"), ("self_attn", "o_proj"), ("mlp", "gate_up_proj"), ("mlp", "down_proj"))


class LoRAModel:
    """The LoRA state of a model on one rank: its wrapped layers and the step's slot segments.

    Args:
        model: a Llama-family model (``model.model.layers``); its projections are wrapped in place.
        max_tokens: the most token rows of one step.
    """

    def __init__(self, model: nn.Module, max_loras: int, max_lora_rank: int, max_tokens: int,
                 dtype: torch.dtype, device: str) -> None:
        self.batch = LoRABatch(max_tokens, max_loras, device)
        self.layers: list[LoRALinear] = []
        for index, layer in enumerate(model.model.layers):
            for block_name, attr in _WRAPPED:
                block = getattr(layer, block_name)
                wrapped = LoRALinear(getattr(block, attr), index, attr, max_loras, max_lora_rank, dtype, device,
                                     self.batch)
                setattr(block, attr, wrapped)
                self.layers.append(wrapped)

    @property
    def num_bytes(self) -> int:
        """Device memory of the slot weights (bytes)."""
        return sum(l.lora_a.numel() * l.lora_a.element_size() + l.lora_b.numel() * l.lora_b.element_size()
                   for l in self.layers)

    def load(self, loads: list[tuple[int, LoRAAdapter]]) -> None:
        """Copy each ``(slot, adapter)``'s weights into the slot tensors of every wrapped layer."""
        for slot, adapter in loads:
            for layer in self.layers:
                layer.load_slot(slot, adapter)

    def prepare(self, token_slots: np.ndarray | None) -> None:
        """Set the step's slot of each token row (``[T]`` int32, -1: no adapter; None: no row uses one)."""
        if token_slots is None:
            token_slots = np.zeros(0, dtype=np.int32)
        self.batch.prepare(token_slots)
