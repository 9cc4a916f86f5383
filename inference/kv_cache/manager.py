"""Maps requests to KV blocks: on-demand allocation as tokens arrive, release on finish."""
from __future__ import annotations

from ..request import Request
from .block_pool import BlockPool


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    """Allocates each request's block table.

    Args:
        num_blocks: blocks in the pool.
        block_size: tokens per block.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def usage(self) -> float:
        """Fraction of blocks in use, 0..1."""
        return 1.0 - self.pool.num_free_blocks / self.pool.num_blocks

    def blocks_needed(self, request: Request, num_new_tokens: int) -> int:
        total = cdiv(request.num_computed_tokens + num_new_tokens, self.block_size)
        return max(0, total - len(request.block_ids))

    def allocate_slots(self, request: Request, num_new_tokens: int) -> bool:
        """Grow ``request.block_ids`` so that ``num_new_tokens`` more tokens fit.

        Returns:
            False (and allocates nothing) when the pool has too few free blocks.
        """
        needed = self.blocks_needed(request, num_new_tokens)
        if needed > self.pool.num_free_blocks:
            return False
        if needed:
            request.block_ids.extend(self.pool.allocate(needed))
        return True

    def free(self, request: Request) -> None:
        """Return all of the request's blocks to the pool (finish, abort or preemption)."""
        if request.block_ids:
            self.pool.free(request.block_ids)
            request.block_ids = []
