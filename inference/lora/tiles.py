"""The row tiles of a LoRA step: the token rows that use an adapter, grouped by slot, cut into tiles of
``TILE_ROWS`` rows of one slot, which the Triton kernels (:mod:`.triton_lora`) take one per program. Host side
(numpy), built once a step."""
from __future__ import annotations

import numpy as np

TILE_ROWS = 16  # the kernels' BLOCK_M


def max_tiles(num_tokens: int, num_slots: int) -> int:
    """Row tiles a step of ``num_tokens`` rows over ``num_slots`` slots can have: each segment's last tile
    may be partial."""
    return -(-num_tokens // TILE_ROWS) + num_slots


def segment_tiles(slot_starts: np.ndarray, num_tiles: int) -> np.ndarray:
    """``[num_tiles, 3]`` int32 rows ``(slot, first, end)``: the ``TILE_ROWS``-row tiles of each slot's segment
    ``sorted_rows[slot_starts[s]:slot_starts[s + 1]]`` (``first`` a position in ``sorted_rows``, ``end`` its
    segment's end), then empty rows ``(0, 0, 0)``. ``slot_starts``: ``[S + 1]`` int32 on the host.

    Raises:
        ValueError: more tiles than ``num_tiles``.
    """
    starts = np.asarray(slot_starts, dtype=np.int64)
    per_slot = -(-np.diff(starts) // TILE_ROWS)
    total = int(per_slot.sum())
    if total > num_tiles:
        raise ValueError(f"{total} LoRA row tiles do not fit the {num_tiles} of the launch grid")
    slot = np.repeat(np.arange(per_slot.size), per_slot)
    first_tile = np.repeat(np.cumsum(per_slot) - per_slot, per_slot)
    out = np.zeros((num_tiles, 3), dtype=np.int32)
    out[:total, 0] = slot
    out[:total, 1] = starts[slot] + TILE_ROWS * (np.arange(total) - first_tile)
    out[:total, 2] = starts[slot + 1]
    return out
