"""A pool of fixed-size KV cache blocks, identified by integer ids."""
from __future__ import annotations

from collections import deque


class BlockPool:
    """Free list of physical KV block ids ``0 .. num_blocks-1``.

    Allocation and free are O(1) per block. The pool never touches tensors; the model
    runner owns the cache tensors of shape ``[num_blocks, block_size, num_kv_heads, head_dim]``.
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be at least 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._allocated = bytearray(num_blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def allocate(self, count: int) -> list[int]:
        """Take ``count`` free blocks.

        Raises:
            RuntimeError: fewer than ``count`` blocks are free (callers check first).
        """
        if count > len(self._free):
            raise RuntimeError(f"Asked for {count} KV blocks with only {len(self._free)} free")
        ids = [self._free.popleft() for _ in range(count)]
        for block_id in ids:
            self._allocated[block_id] = 1
        return ids

    def free(self, block_ids: list[int]) -> None:
        """Return blocks to the pool.

        Raises:
            RuntimeError: a block is freed twice (a bookkeeping bug, never silently ignored).
        """
        for block_id in block_ids:
            if not self._allocated[block_id]:
                raise RuntimeError(f"KV block {block_id} freed twice")
            self._allocated[block_id] = 0
            self._free.append(block_id)
