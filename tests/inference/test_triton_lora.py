"""The Triton LoRA shrink and expand kernels against their PyTorch reference.

Without a CUDA device the kernels run in Triton's interpreter on small shapes (and the module's
kernels are compiled for sm_90 at its end, see conftest); on a GPU the same tests run on CUDA tensors.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from .triton_interpreter import HAS_CUDA  # noqa: E402  (sets TRITON_INTERPRET=1 without a GPU)

triton = pytest.importorskip("triton")

from inference.lora.torch_ref import lora_expand_ref, lora_shrink_ref  # noqa: E402
from inference.lora.tiles import max_tiles, segment_tiles  # noqa: E402
from inference.lora.triton_lora import (lora_expand_, lora_expand_all_slots, lora_shrink,  # noqa: E402
                                        lora_shrink_all_slots)

DEVICE = "cuda" if HAS_CUDA else "cpu"


def _segments(token_slots: list[int], num_slots: int):
    """``sorted_rows``, ``slot_starts`` and the kernels' row tiles of a batch whose row ``t`` uses slot
    ``token_slots[t]`` (-1: none)."""
    rows = sorted((slot, t) for t, slot in enumerate(token_slots) if slot >= 0)
    counts = [sum(1 for s in token_slots if s == slot) for slot in range(num_slots)]
    starts = [0]
    for count in counts:
        starts.append(starts[-1] + count)
    sorted_rows = [t for _, t in rows] + [0] * (len(token_slots) - len(rows))
    tiles = segment_tiles(np.asarray(starts), max_tiles(len(token_slots), num_slots))
    return (torch.tensor(sorted_rows, dtype=torch.int32, device=DEVICE),
            torch.tensor(starts, dtype=torch.int32, device=DEVICE), torch.from_numpy(tiles).to(DEVICE))


# 37 rows over three slots and rows without an adapter; K 96 leaves a partial K tile; rank 8 and 16 slots.
@pytest.mark.parametrize("num_tokens, token_pattern", [(1, [1]), (5, [-1, 0, 2, -1, 0]), (37, None)],
                         ids=["one-decode", "mixed-5", "prefill-37"])
@pytest.mark.parametrize("r_max, slices", [(8, (40, 24, 24)), (16, (96,))], ids=["qkv-r8", "single-r16"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_shrink_and_expand_equal_the_reference(num_tokens, token_pattern, r_max, slices, dtype):
    g = torch.Generator(device=DEVICE).manual_seed(num_tokens * 7 + r_max)
    num_slots, k = 3, 96
    token_slots = token_pattern or [(t * 5) % 4 - 1 for t in range(num_tokens)]
    sorted_rows, slot_starts, tiles = _segments(token_slots, num_slots)
    num_slices, n = len(slices), sum(slices)
    x = torch.randn(num_tokens, k, generator=g, device=DEVICE).to(dtype)
    a = (torch.randn(num_slots, num_slices * r_max, k, generator=g, device=DEVICE) * 0.1).to(dtype)
    b = (torch.randn(num_slots, n, r_max, generator=g, device=DEVICE) * 0.1).to(dtype)
    base = torch.randn(num_tokens, n, generator=g, device=DEVICE).to(dtype)
    starts = [0]
    for width in slices:
        starts.append(starts[-1] + width)

    s = lora_shrink(x, a, sorted_rows, tiles)
    s_ref = lora_shrink_ref(x, a, sorted_rows, slot_starts)
    used = torch.tensor([slot >= 0 for slot in token_slots], device=DEVICE)
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 and not HAS_CUDA else dict(atol=3e-2, rtol=2e-2)
    torch.testing.assert_close(s[used], s_ref[used], **tol)

    out = base.clone()
    lora_expand_(out, s_ref, b, sorted_rows, tiles, torch.tensor(starts, dtype=torch.int32, device=DEVICE),
                 r_max, max(slices))
    expected = base.clone()
    lora_expand_ref(expected, s_ref, b, sorted_rows, slot_starts, tuple(starts), r_max)
    torch.testing.assert_close(out.float(), expected.float(), **tol)
    assert torch.equal(out[~used], base[~used])  # rows without an adapter are untouched
    # a small batch's shrink: every row against every slot in one matmul, the expand picking each row's slot
    s_all = lora_shrink_all_slots(x.float(), a.float())
    every = base.clone()
    lora_expand_(every, s_all, b, sorted_rows, tiles, torch.tensor(starts, dtype=torch.int32, device=DEVICE),
                 r_max, max(slices), slot_stride=num_slices * r_max)
    torch.testing.assert_close(every.float(), expected.float(), **tol)
    assert torch.equal(every[~used], base[~used])
    if any(slot >= 0 for slot in token_slots):
        assert not torch.equal(out[used], base[used])

    # the one-GEMM path of a dense layer: its weight with every slot's A stacked below, then the expand that
    # adds each row's own slot to the base columns (and the bias)
    weight = (torch.randn(n, k, generator=g, device=DEVICE) * 0.1).to(dtype)
    bias = torch.randn(n, generator=g, device=DEVICE).to(dtype)
    y = x @ torch.cat([weight, a.reshape(-1, k)]).t()
    row_slots = torch.tensor(token_slots, dtype=torch.int32, device=DEVICE)
    fused = lora_expand_all_slots(y, b, bias, row_slots, torch.tensor(starts, dtype=torch.int32, device=DEVICE),
                                  max(slices))
    expected = (x.float() @ weight.float().t() + bias.float()).to(dtype)
    lora_expand_ref(expected, lora_shrink_ref(x, a, sorted_rows, slot_starts), b, sorted_rows, slot_starts,
                    tuple(starts), r_max)
    torch.testing.assert_close(fused.float(), expected.float(), **tol)


def test_segment_tiles_cover_every_row_once_within_its_slot():
    """Segments of 0, 1, 16, 17 and 40 rows: every position of ``sorted_rows`` in exactly one tile of its slot,
    tiles of at most 16 rows, the rest of the grid empty; more tiles than the grid is an error."""
    starts = np.cumsum([0, 0, 1, 16, 17, 40])
    tiles = segment_tiles(starts, max_tiles(int(starts[-1]), 5))
    covered = []
    for slot, first, end in tiles.tolist():
        if first == end:
            continue
        assert starts[slot] <= first < end == starts[slot + 1]
        covered += list(range(first, min(first + 16, end)))
    assert covered == list(range(int(starts[-1])))
    assert (tiles[len([t for t in tiles if t[1] < t[2]]):] == 0).all()
    with pytest.raises(ValueError, match="row tiles"):
        segment_tiles(starts, 3)


@pytest.mark.parametrize("num_slots, r_max, dtype", [(3, 8, torch.float32), (3, 8, torch.bfloat16),
                                                     (5, 64, torch.float32)],
                         ids=["one-gemm-fp32", "one-gemm-bf16", "wide-slots-fallback"])
def test_lora_linear_gpu_paths_equal_the_pytorch_path(num_slots, r_max, dtype, monkeypatch):
    """A wrapped qkv layer (with bias) on the GPU paths (forced here, the kernels in the interpreter without a GPU)
    against its PyTorch path: the one-GEMM path while slots x rank fit the expand's tile, the every-slot shrink and
    the segmented expand above it; rows of no adapter, ranks below r_max, and the row slots of a longer step before."""
    import types

    import inference.lora.layers as layers
    import inference.lora.triton_lora as triton_lora
    from inference.models.parallel_layers import QKVParallelLinear

    g = torch.Generator().manual_seed(num_slots * r_max)
    base = QKVParallelLinear(32, 8, 4, 2, bias=True).to(dtype).to(DEVICE)
    with torch.no_grad():
        for param in base.parameters():
            param.copy_(torch.randn(param.shape, generator=g) * 0.1)
    weight = base.weight.detach().clone()
    batch = layers.LoRABatch(64, num_slots, DEVICE)
    batch.uses_tiles = True  # the kernels' row tiles, which the CPU path does not build
    layer = layers.LoRALinear(base, 0, "qkv_proj", num_slots, r_max, dtype, DEVICE, batch)
    assert torch.equal(base.weight, weight)  # the weight now lives in the stacked tensor, unchanged
    widths = {"q_proj": 32, "k_proj": 16, "v_proj": 16}
    for slot in range(num_slots):
        rank = r_max - slot  # ranks below r_max too
        weights = {(0, name): (torch.randn(rank, 32, generator=g) * 0.1, torch.randn(n, rank, generator=g) * 0.1)
                   for name, n in widths.items()}
        layer.load_slot(slot, types.SimpleNamespace(weights=weights))
    used = []
    monkeypatch.setattr(triton_lora, "lora_expand_all_slots",
                        lambda *a, _f=triton_lora.lora_expand_all_slots: used.append(1) or _f(*a))
    one_gemm = num_slots * r_max <= layers.EXPAND_ALL_SLOTS_MAX_COLUMNS
    for num_tokens in (7, 5):  # the second step is shorter: its rows past 5 must not keep the first step's slots
        x = torch.randn(num_tokens, 32, generator=g).to(dtype).to(DEVICE)
        batch.prepare(np.array([t % (num_slots + 1) - 1 for t in range(num_tokens)], dtype=np.int32))
        monkeypatch.setattr(layers, "use_triton_layers", lambda _x: False)
        expected = layer(x)
        monkeypatch.setattr(layers, "use_triton_layers", lambda _x: True)
        out = layer(x)
        tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=3e-2, rtol=2e-2)
        torch.testing.assert_close(out.float(), expected.float(), **tol)
        assert not torch.equal(expected, base(x))  # the adapters changed the output
    assert bool(used) == one_gemm
    assert batch.row_slots[5:7].tolist() == [-1, -1]
