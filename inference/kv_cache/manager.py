"""Maps requests to KV blocks: prefix hits, on-demand allocation as tokens arrive, release on finish."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from ..request import Request
from .block_hash import extend_block_hashes
from .block_pool import BlockPool


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class ComputedBlocks:
    """A prefix hit: cached blocks holding the first ``num_tokens`` tokens of a request.

    Attributes:
        block_ids: physical ids of the hit blocks, in order (all full).
        num_tokens: ``len(block_ids) * block_size``.
    """

    block_ids: list[int] = field(default_factory=list)
    num_tokens: int = 0


NO_HIT = ComputedBlocks()


class BlockOps(NamedTuple):
    """The block copies a step's scheduling decided, as ``(source, destination)`` block id pairs,
    made by the runner before the forward pass in this order: swap_out (GPU -> CPU swap space),
    copy (within the KV cache, copy on write), swap_in (CPU -> GPU)."""

    swap_out: list[tuple[int, int]]
    copy: list[tuple[int, int]]
    swap_in: list[tuple[int, int]]


class KVCacheManager:
    """Allocates each request's block table.

    With ``enable_prefix_caching``, every full, computed block is remembered by its chained
    content hash (see :mod:`.block_hash`); a new request starts from the longest run of cached
    blocks matching its tokens, always leaving its last token to compute (that step's logits are
    what it samples from). Only full blocks are shared, and a shared block is never written:
    parallel samples of one prompt (:meth:`fork`) share its partly filled last block too, and the
    first one to append to it while others hold it gets a copy (copy on write).

    Args:
        num_blocks: blocks in the pool.
        block_size: tokens per block.
        enable_prefix_caching: share full blocks between requests by content hash.
        num_cpu_blocks: blocks of the CPU swap space (0: no swapping).
    Attributes:
        prefix_cache_queries, prefix_cache_hits: tokens looked up / found in the prefix cache
            by admitted requests (vLLM's ``prefix_cache_queries`` / ``prefix_cache_hits``).
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False,
                 num_cpu_blocks: int = 0) -> None:
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks)
        self.cpu_pool = BlockPool(num_cpu_blocks) if num_cpu_blocks else None
        self.num_swapped = 0  # requests whose KV is in the CPU swap space now
        self.num_swapped_out_total = 0
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self._num_cached_blocks: dict[str, int] = {}  # request id -> its blocks registered in the cache
        self._ops = BlockOps([], [], [])  # this step's block copies

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests, 0..1 (cached blocks nobody holds count as free)."""
        return 1.0 - self.pool.num_free_blocks / self.pool.num_blocks

    @property
    def num_cpu_blocks(self) -> int:
        return self.cpu_pool.num_blocks if self.cpu_pool else 0

    @property
    def num_free_cpu_blocks(self) -> int:
        return self.cpu_pool.num_free_blocks if self.cpu_pool else 0

    @property
    def cpu_usage(self) -> float:
        """Fraction of the CPU swap space in use, 0..1 (0 without one)."""
        return 1.0 - self.num_free_cpu_blocks / self.num_cpu_blocks if self.cpu_pool else 0.0

    # ---- prefix caching ----------------------------------------------------------------
    def get_computed_blocks(self, request: Request) -> ComputedBlocks:
        """The cached blocks a waiting request can start from (nothing is held until
        :meth:`allocate_slots`). No hit when caching is off, when the request already has
        computed tokens, or when it asks for prompt logprobs (those need every position's logits)."""
        max_blocks = self.hash_prompt(request)
        if not max_blocks:
            return NO_HIT
        hits: list[int] = []
        for block_hash in request.block_hashes[:max_blocks]:
            block_id = self.pool.cached_block(block_hash)
            if block_id is None:
                break
            hits.append(block_id)
        return ComputedBlocks(hits, len(hits) * self.block_size) if hits else NO_HIT

    def cache_blocks(self, request: Request, num_tokens: int | None = None) -> None:
        """Register in the prefix cache the request's full blocks among its first ``num_tokens`` tokens
        (default ``num_computed_tokens``) whose token ids are known. Blocks a launched step computes may
        be registered at once (steps run in order on the device: any later step reads them written);
        a step scheduled ahead advances ``num_computed_tokens`` before the tokens of its multi-step
        window are appended, and their blocks are registered once they are (the scheduler calls this
        again after appending)."""
        if not self.enable_prefix_caching:
            return
        computed = request.num_computed_tokens if num_tokens is None else num_tokens
        num_full = min(computed, len(request.all_token_ids)) // self.block_size
        start = self._num_cached_blocks.get(request.request_id, 0)
        if num_full <= start:
            return
        self._hash_blocks(request, num_full)
        for index in range(start, num_full):
            self.pool.cache_block(request.block_ids[index], request.block_hashes[index])
        self._num_cached_blocks[request.request_id] = num_full

    def cache_blocks_of(self, requests: list[Request]) -> None:
        """:meth:`cache_blocks` of each request (up to its ``num_computed_tokens``), in order. The check that
        no new block is full is made here without a call: in a decode step or window most requests complete
        no block (the scheduler's hot path)."""
        if not self.enable_prefix_caching:
            return
        block_size, num_cached = self.block_size, self._num_cached_blocks
        for request in requests:
            computed, num_tokens = request.num_computed_tokens, len(request.all_token_ids)
            if (computed if computed < num_tokens else num_tokens) // block_size > num_cached.get(request.request_id, 0):
                self.cache_blocks(request)

    def hash_prompt(self, request: Request) -> int:
        """Compute the block hashes :meth:`get_computed_blocks` looks up for a waiting request (also ahead of its
        admission, while the device runs a step); returns how many blocks may hit: 0 when caching is off, the
        request has computed tokens or asks for prompt logprobs; the last token is always computed."""
        if (not self.enable_prefix_caching or request.num_computed_tokens
                or request.sampling_params.prompt_logprobs is not None):
            return 0
        max_blocks = (request.num_tokens - 1) // self.block_size
        self._hash_blocks(request, max_blocks)
        return max_blocks

    def _hash_blocks(self, request: Request, num_blocks: int) -> None:
        extend_block_hashes(request.block_hashes, request.all_token_ids, self.block_size, num_blocks,
                            request.cache_salt, request.lora_key)

    # ---- allocation ----------------------------------------------------------------------
    def blocks_needed(self, request: Request, num_new_tokens: int) -> int:
        total = cdiv(request.num_computed_tokens + num_new_tokens, self.block_size)
        return max(0, total - len(request.block_ids))

    def allocate_slots(self, request: Request, num_new_tokens: int, computed: ComputedBlocks | None = None) -> bool:
        """Grow ``request.block_ids`` so that ``num_new_tokens`` more tokens fit.

        Args:
            computed: for a request being admitted with nothing computed: its prefix hit (from
                :meth:`get_computed_blocks`, counted in the prefix-cache metrics); the hit blocks
                become the start of its block table and its ``num_computed_tokens``.
                ``num_new_tokens`` counts the tokens after the hit.
        Returns:
            False (and changes nothing) when the pool has too few free blocks.
        """
        hit = computed or NO_HIT
        total = cdiv(request.num_computed_tokens + hit.num_tokens + num_new_tokens, self.block_size)
        needed = max(0, total - len(request.block_ids) - len(hit.block_ids))
        reclaimed = sum(1 for b in hit.block_ids if self.pool.ref_cnt[b] == 0)  # hits now in the free queue
        shared = self._shared_write_block(request)
        if needed + reclaimed + (shared is not None) > self.pool.num_free_blocks:
            return False
        if computed is not None and request.num_computed_tokens == 0:
            self._admit(request, hit)
        if shared is not None:
            self._copy_on_write(request, shared)
        if needed:
            request.block_ids.extend(self.pool.allocate(needed))
        return True

    def allocate_window_slots(self, requests: list[Request], num_new_tokens: int) -> bool:
        """``allocate_slots(request, num_new_tokens)`` for every request, or for none when the pool has fewer
        free blocks than they need together (:meth:`blocks_needed`; a multi-step window, all or nothing).
        Returns whether they were allocated. A request whose next block to write it alone holds (the common
        case) is grown here without a call."""
        block_size, ref_cnt = self.block_size, self.pool.ref_cnt
        needed = 0
        for request in requests:  # sum(blocks_needed(request, num_new_tokens)), inlined
            missing = -(-(request.num_computed_tokens + num_new_tokens) // block_size) - len(request.block_ids)
            if missing > 0:
                needed += missing
        if needed > self.pool.num_free_blocks:
            return False
        for request in requests:
            position, block_ids = request.num_computed_tokens, request.block_ids
            index = position // block_size
            if index < len(block_ids) and ref_cnt[block_ids[index]] > 1:  # shared: copy on write, the full path
                if not self.allocate_slots(request, num_new_tokens):  # cannot fail: the blocks were counted above
                    raise AssertionError("KV pool changed while reserving a multi-step window")
                continue
            missing = -(-(position + num_new_tokens) // block_size) - len(block_ids)
            if missing > 0:
                block_ids.extend(self.pool.allocate(missing))
        return True

    def allocate_decode_slots(self, requests: list[Request]) -> bool:
        """``allocate_slots(request, 1)`` for each request in order (a decode step), stopping at
        the first that fails; those before it keep their slots. Returns whether all succeeded.
        A request whose next token fits in a last block that it alone holds needs nothing (the
        common case, checked without a call)."""
        block_size, ref_cnt = self.block_size, self.pool.ref_cnt
        for request in requests:
            position, block_ids = request.num_computed_tokens, request.block_ids
            if position < len(block_ids) * block_size and ref_cnt[block_ids[position // block_size]] == 1:
                continue
            if not self.allocate_slots(request, 1):
                return False
        return True

    def _admit(self, request: Request, hit: ComputedBlocks) -> None:
        if hit.block_ids:
            self.pool.touch(hit.block_ids)
            request.block_ids = list(hit.block_ids)
            request.num_computed_tokens = hit.num_tokens
            self._num_cached_blocks[request.request_id] = len(hit.block_ids)
        if request.num_cached_tokens is None:
            request.num_cached_tokens = hit.num_tokens
        if self.enable_prefix_caching:
            self.prefix_cache_queries += request.num_tokens
            self.prefix_cache_hits += hit.num_tokens

    # ---- parallel sampling ---------------------------------------------------------------
    def fork(self, parent: Request, child: Request) -> None:
        """Give ``child`` (with no blocks) the parent's block table, adding a holder to each block."""
        child.block_ids = list(parent.block_ids)
        self.pool.touch(child.block_ids)
        if parent.request_id in self._num_cached_blocks:
            self._num_cached_blocks[child.request_id] = self._num_cached_blocks[parent.request_id]

    def _shared_write_block(self, request: Request) -> int | None:
        """Index in the block table of the block the request writes next, when others hold it too."""
        index = request.num_computed_tokens // self.block_size
        if index < len(request.block_ids) and self.pool.ref_cnt[request.block_ids[index]] > 1:
            return index
        return None

    def _copy_on_write(self, request: Request, index: int) -> None:
        [copy] = self.pool.allocate(1)
        self._ops.copy.append((request.block_ids[index], copy))
        self.pool.free([request.block_ids[index]])
        request.block_ids[index] = copy

    # ---- swap preemption ------------------------------------------------------------------
    def swap_out(self, request: Request) -> bool:
        """Move a preempted request's computed blocks to the CPU swap space: the copies are made
        before this step's forward, and its GPU blocks are released now (``num_computed_tokens``
        stays). Returns False, changing nothing, when the swap space lacks room (or is absent)."""
        num = cdiv(request.num_computed_tokens, self.block_size)
        if self.cpu_pool is None or num == 0 or num > self.cpu_pool.num_free_blocks:
            return False
        request.cpu_block_ids = self.cpu_pool.allocate(num)
        self._ops.swap_out.extend(zip(request.block_ids[:num], request.cpu_block_ids))
        self._release(request)
        self.num_swapped += 1
        self.num_swapped_out_total += 1
        return True

    def swap_in(self, request: Request, num_new_tokens: int) -> bool:
        """Bring a swapped-out request back: GPU blocks for its KV (copied back before this step's
        forward) and for ``num_new_tokens`` more. Returns False, changing nothing, without room.

        Raises:
            RuntimeError: blocks were swapped out in the same step (the scheduler never does both).
        """
        if self._ops.swap_out:
            raise RuntimeError("swap-in and swap-out in one step")
        total = cdiv(request.num_computed_tokens + num_new_tokens, self.block_size)
        if total > self.pool.num_free_blocks:
            return False
        request.block_ids = self.pool.allocate(total)
        self._ops.swap_in.extend(zip(request.cpu_block_ids, request.block_ids))
        self._release_cpu(request)
        return True

    def take_block_ops(self) -> BlockOps:
        """This step's block copies, for the scheduler output (and forget them here)."""
        ops, self._ops = self._ops, BlockOps([], [], [])
        return ops

    def free(self, request: Request) -> None:
        """Drop the request's hold on its blocks, GPU and CPU (finish, abort or preemption); cached
        ones stay reusable until the pool needs them, the request's last blocks evicted first."""
        self._release(request)
        self._release_cpu(request)

    def _release(self, request: Request) -> None:
        if request.block_ids:
            self.pool.free(reversed(request.block_ids))
            request.block_ids = []
        self._num_cached_blocks.pop(request.request_id, None)

    def _release_cpu(self, request: Request) -> None:
        if request.cpu_block_ids:
            self.cpu_pool.free(request.cpu_block_ids)
            request.cpu_block_ids = []
            self.num_swapped -= 1
