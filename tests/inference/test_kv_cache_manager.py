"""The KV manager on CPU, with exact block ids: reference counts, LRU eviction, prefix hits."""
from __future__ import annotations

import pytest

from inference.kv_cache import BlockPool, KVCacheManager
from inference.request import Request
from inference.sampling_params import SamplingParams

BS = 4  # tokens per block


def make_request(rid: str, tokens: list[int], salt: str | None = None, **params) -> Request:
    sp = SamplingParams(max_tokens=8, **params)
    return Request(rid, rid, 0, list(tokens), sp, 8, cache_salt=salt)


def compute(kv: KVCacheManager, request: Request, num_tokens: int | None = None) -> None:
    """What a step does to the bookkeeping: hold slots, compute the tokens, register full blocks."""
    hit = kv.get_computed_blocks(request) if request.num_computed_tokens == 0 else None
    start = request.num_computed_tokens + (hit.num_tokens if hit else 0)
    num_new = (num_tokens if num_tokens is not None else request.num_tokens) - start
    assert kv.allocate_slots(request, num_new, hit)
    request.num_computed_tokens += num_new
    kv.cache_blocks(request)


def test_pool_allocates_in_order_and_reuses_least_recently_freed():
    pool = BlockPool(6)
    assert pool.allocate(3) == [0, 1, 2]
    pool.free([1, 0])
    assert pool.num_free_blocks == 5
    assert pool.allocate(4) == [3, 4, 5, 1]  # never-used blocks first, then in the order freed
    with pytest.raises(RuntimeError, match="freed twice"):
        pool.free([2, 2])
    with pytest.raises(RuntimeError, match="only 2 free"):
        pool.allocate(3)


def test_shared_block_is_free_only_when_its_last_holder_lets_go():
    pool = BlockPool(4)
    [block] = pool.allocate(1)
    pool.touch([block])
    pool.free([block])
    assert pool.num_free_blocks == 3 and pool.ref_cnt[block] == 1
    pool.free([block])
    assert pool.num_free_blocks == 4 and pool.ref_cnt[block] == 0


def test_prefix_hit_reuses_full_blocks_and_computes_the_rest():
    kv = KVCacheManager(num_blocks=10, block_size=BS, enable_prefix_caching=True)
    a = make_request("a", list(range(10)))  # blocks: [0 1 2 3] [4 5 6 7] [8 9]
    compute(kv, a)
    assert a.block_ids == [0, 1, 2] and kv.pool.num_cached_blocks == 2  # the partial block is not cached
    kv.free(a)
    assert kv.num_free_blocks == 10
    b = make_request("b", list(range(8)) + [50, 51, 52])
    hit = kv.get_computed_blocks(b)
    assert hit.block_ids == [0, 1] and hit.num_tokens == 8
    assert kv.allocate_slots(b, b.num_tokens - hit.num_tokens, hit)
    # Free queue after a's release: 3..9 (never used), then a's blocks last first: 2, 1, 0.
    assert b.block_ids == [0, 1, 3] and b.num_computed_tokens == 8 and b.num_cached_tokens == 8
    assert kv.num_free_blocks == 7 and kv.pool.ref_cnt[:4] == [1, 1, 0, 1]
    assert (kv.prefix_cache_queries, kv.prefix_cache_hits) == (10 + 11, 8)


def test_running_requests_share_cached_blocks_by_reference():
    kv = KVCacheManager(num_blocks=10, block_size=BS, enable_prefix_caching=True)
    a = make_request("a", list(range(9)))
    compute(kv, a)
    b = make_request("b", list(range(9)))
    compute(kv, b)
    assert a.block_ids == [0, 1, 2] and b.block_ids == [0, 1, 3]
    assert kv.pool.ref_cnt[:4] == [2, 2, 1, 1] and kv.num_free_blocks == 6
    kv.free(a)
    assert kv.pool.ref_cnt[:4] == [1, 1, 0, 1] and kv.num_free_blocks == 7
    kv.free(b)
    assert kv.num_free_blocks == 10


def test_last_token_is_always_computed():
    kv = KVCacheManager(num_blocks=10, block_size=BS, enable_prefix_caching=True)
    compute(kv, make_request("a", list(range(8))))
    same = make_request("b", list(range(8)))  # two full blocks, both cached: only the first is a hit
    assert kv.get_computed_blocks(same).num_tokens == 4


def test_cache_salt_separates_caches():
    kv = KVCacheManager(num_blocks=10, block_size=BS, enable_prefix_caching=True)
    compute(kv, make_request("a", list(range(9)), salt="tenant-a"))
    assert kv.get_computed_blocks(make_request("b", list(range(9)), salt="tenant-b")).num_tokens == 0
    assert kv.get_computed_blocks(make_request("c", list(range(9)))).num_tokens == 0
    assert kv.get_computed_blocks(make_request("d", list(range(9)), salt="tenant-a")).num_tokens == 8


def test_chained_hash_needs_the_whole_prefix():
    kv = KVCacheManager(num_blocks=10, block_size=BS, enable_prefix_caching=True)
    compute(kv, make_request("a", list(range(13))))
    # Same second block, different first block: no hit at all.
    other = make_request("b", [99, 1, 2, 3] + list(range(4, 13)))
    assert kv.get_computed_blocks(other).num_tokens == 0


def test_no_hits_when_disabled_or_prompt_logprobs_asked():
    kv = KVCacheManager(num_blocks=10, block_size=BS, enable_prefix_caching=False)
    compute(kv, make_request("a", list(range(9))))
    assert kv.get_computed_blocks(make_request("b", list(range(9)))).num_tokens == 0
    assert kv.pool.num_cached_blocks == 0
    kv = KVCacheManager(num_blocks=10, block_size=BS, enable_prefix_caching=True)
    compute(kv, make_request("a", list(range(9))))
    assert kv.get_computed_blocks(make_request("b", list(range(9)), prompt_logprobs=1)).num_tokens == 0


def test_unheld_cached_blocks_are_evicted_least_recently_used_first():
    kv = KVCacheManager(num_blocks=6, block_size=BS, enable_prefix_caching=True)
    a = make_request("a", list(range(100, 109)))  # 2 full blocks + 1 partial
    compute(kv, a)
    b = make_request("b", list(range(200, 209)))
    compute(kv, b)
    assert a.block_ids == [0, 1, 2] and b.block_ids == [3, 4, 5]
    kv.free(a)  # queue: 2, 1, 0
    kv.free(b)  # queue: 2, 1, 0, 5, 4, 3
    c = make_request("c", list(range(300, 305)))  # needs 2 new blocks: evicts a's partial and a's 2nd block
    compute(kv, c)
    assert c.block_ids == [2, 1]
    assert kv.get_computed_blocks(make_request("a2", list(range(100, 109)))).block_ids == [0]
    assert kv.get_computed_blocks(make_request("b2", list(range(200, 209)))).block_ids == [3, 4]
    # A hit moves its blocks out of the free queue: the next allocation evicts around it.
    b2 = make_request("b2", list(range(200, 209)))
    compute(kv, b2)
    assert b2.block_ids == [3, 4, 0]
    assert kv.get_computed_blocks(make_request("a3", list(range(100, 109)))).num_tokens == 0
    assert kv.num_free_blocks == 1  # block 5: b's partial block, uncached


def test_a_hit_that_does_not_fit_holds_nothing():
    kv = KVCacheManager(num_blocks=4, block_size=BS, enable_prefix_caching=True)
    a = make_request("a", list(range(9)))
    compute(kv, a)
    kv.free(a)
    filler = make_request("f", list(range(500, 503)))
    compute(kv, filler)  # takes block 3 (never used)
    big = make_request("b", list(range(8)) + list(range(600, 612)))  # hit 2 blocks, needs 3 more
    hit = kv.get_computed_blocks(big)
    assert hit.block_ids == [0, 1]
    assert not kv.allocate_slots(big, big.num_tokens - hit.num_tokens, hit)
    assert big.block_ids == [] and big.num_computed_tokens == 0 and kv.num_free_blocks == 3
    assert (kv.prefix_cache_queries, kv.prefix_cache_hits) == (12, 0)  # a and f admitted; b not
