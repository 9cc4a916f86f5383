"""A pool of fixed-size KV cache blocks, identified by integer ids, reference-counted and
(optionally) remembered by content hash after their last holder lets go."""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

from .block_hash import BlockHash


class BlockPool:
    """Physical KV block ids ``0 .. num_blocks-1`` with reference counts and a free queue.

    A block with reference count 0 is *free*: it sits in the free queue, least recently freed
    first. A free block may still hold a cached prefix (it keeps its hash); it is reused only
    when the pool needs it, and then it loses its hash (eviction, LRU). Allocation, free, hit
    and eviction are O(1) per block (the queue is an ``OrderedDict``, a doubly-linked list).
    The pool never touches tensors; the model runner owns the cache tensors of shape
    ``[num_blocks, block_size, num_kv_heads, head_dim]``.

    Raises:
        ValueError: ``num_blocks < 1``.
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be at least 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.ref_cnt = [0] * num_blocks
        self.block_hash: list[BlockHash | None] = [None] * num_blocks
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._cached: dict[BlockHash, int] = {}
        self.num_evicted_blocks = 0  # cached blocks whose content was dropped for reuse

    @property
    def num_free_blocks(self) -> int:
        """Blocks nobody holds, cached ones included (they are evicted on demand)."""
        return len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def allocate(self, count: int) -> list[int]:
        """Take ``count`` free blocks, least recently freed first, evicting their cached content.

        Raises:
            RuntimeError: fewer than ``count`` blocks are free (callers check first).
        """
        if count > len(self._free):
            raise RuntimeError(f"Asked for {count} KV blocks with only {len(self._free)} free")
        ids = []
        for _ in range(count):
            block_id, _ = self._free.popitem(last=False)
            self._evict(block_id)
            self.ref_cnt[block_id] = 1
            ids.append(block_id)
        return ids

    def touch(self, block_ids: Iterable[int]) -> None:
        """Add a holder to each block (a prefix hit, or a fork sharing a parent's blocks)."""
        for block_id in block_ids:
            if self.ref_cnt[block_id] == 0:
                del self._free[block_id]
            self.ref_cnt[block_id] += 1

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop one holder of each block; blocks nobody holds go to the end of the free queue
        (so pass a request's blocks last first: its tail is then evicted before its prefix).

        Raises:
            RuntimeError: a block is freed more often than it was held (a bookkeeping bug,
                never silently ignored).
        """
        for block_id in block_ids:
            if self.ref_cnt[block_id] <= 0:
                raise RuntimeError(f"KV block {block_id} freed twice")
            self.ref_cnt[block_id] -= 1
            if self.ref_cnt[block_id] == 0:
                self._free[block_id] = None

    def cached_block(self, block_hash: BlockHash) -> int | None:
        """The block holding the content with this hash, if any (held or free)."""
        return self._cached.get(block_hash)

    def cache_block(self, block_id: int, block_hash: BlockHash) -> None:
        """Remember a held, fully computed block by its hash. When another block already holds
        the same content, that one stays the cached copy and this one stays anonymous."""
        if block_hash not in self._cached and self.block_hash[block_id] is None:
            self._cached[block_hash] = block_id
            self.block_hash[block_id] = block_hash

    def _evict(self, block_id: int) -> None:
        block_hash = self.block_hash[block_id]
        if block_hash is not None:
            del self._cached[block_hash]
            self.block_hash[block_id] = None
            self.num_evicted_blocks += 1
