from __future__ import annotations

from tandem.engine.block_hash import hash_prompt, root_hash
from tandem.engine.block_pool import BlockEvent, BlockPool
from tandem.engine.kv_cache_manager import KVCacheManager
from tandem.engine.request import Request
from tandem.engine.sampling_params import SamplingParams

ROOT = root_hash("test-model", "float32", 4)


def ids(blocks):
    return [b.block_id for b in blocks]


def test_allocate_hands_out_lowest_ids_first_and_free_appends_lru():
    pool = BlockPool(6)
    a = pool.allocate(2)
    b = pool.allocate(3)
    assert ids(a) == [0, 1] and ids(b) == [2, 3, 4]
    assert pool.num_free_blocks == 1
    pool.free(a)
    # Free queue is now [5, 0, 1]: the never-used block first, then freed ones in order.
    assert ids(pool.allocate(3)) == [5, 0, 1]
    assert pool.num_free_blocks == 0


def test_a_pool_of_a_billion_blocks_makes_only_those_taken():
    # A tiny model's KV on a large card: tens of millions of blocks (61.8 M for the GPU
    # families test's Mistral on an H200), which made one object each took 100 s to build.
    pool = BlockPool(10**9)
    assert pool.num_free_blocks == 10**9 and pool.blocks == []
    a = pool.allocate(3)
    assert ids(a) == [0, 1, 2] and len(pool.blocks) == 3
    pool.free(a[1:])
    assert pool.num_free_blocks == 10**9 - 1
    assert ids(pool.allocate(2)) == [3, 4]  # the never-taken first, as in a queue
    assert pool.blocks[1].ref_cnt == 0 and pool.blocks[4].ref_cnt == 1


def test_cache_hit_rechecks_tokens_and_refcounts():
    events: list[BlockEvent] = []
    pool = BlockPool(4, on_event=events.append)
    [blk] = pool.allocate(1)
    h = hash_prompt([1, 2, 3, 4], 4, ROOT)[0]
    pool.cache(blk, h, [1, 2, 3, 4])
    assert events == [BlockEvent("stored", (h,))]
    assert pool.lookup(h, [1, 2, 3, 4]) is blk
    assert pool.lookup(h, [1, 2, 3, 5]) is None  # same hash, other tokens: no hit
    pool.acquire([blk])
    assert blk.ref_cnt == 2
    pool.free([blk])
    assert blk.ref_cnt == 1 and pool.num_free_blocks == 3
    pool.free([blk])
    assert pool.num_free_blocks == 4
    # A free cached block is still a hit, and acquiring it takes it off the free queue.
    assert pool.lookup(h, [1, 2, 3, 4]) is blk
    pool.acquire([blk])
    assert pool.num_free_blocks == 3
    assert ids(pool.allocate(3)) == [1, 2, 3]


def test_eviction_order_is_least_recently_freed_and_emits_events():
    events: list[BlockEvent] = []
    pool = BlockPool(3, on_event=events.append)
    blocks = pool.allocate(3)
    hashes = hash_prompt(list(range(12)), 4, ROOT)
    for blk, h, i in zip(blocks, hashes, range(3)):
        pool.cache(blk, h, list(range(4 * i, 4 * i + 4)))
    pool.free([blocks[2]])
    pool.free([blocks[0]])
    pool.free([blocks[1]])
    events.clear()
    first = pool.allocate(1)
    assert ids(first) == [2]
    assert events == [BlockEvent("evicted", (hashes[2],))]
    assert pool.lookup(hashes[2], [8, 9, 10, 11]) is None
    assert ids(pool.allocate(2)) == [0, 1]
    assert events[1] == BlockEvent("evicted", (hashes[0], hashes[1]))
    assert pool.num_cached_blocks == 0


def _req(rid: str, tokens: list[int]) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=4))


def test_manager_prefix_hit_reuses_exact_blocks_and_frees_tail_first():
    pool = BlockPool(8)
    kv = KVCacheManager(pool, 4, ROOT, enable_prefix_caching=True)
    a = _req("a", list(range(10)))  # 2 full blocks + 2 tokens
    assert kv.find_cached_blocks(a) == []
    assert kv.allocate(a, 10)
    assert a.block_ids == [0, 1, 2]
    a.num_computed_tokens = 10
    kv.cache_computed_blocks(a)
    assert pool.num_cached_blocks == 2

    b = _req("b", list(range(8)) + [99, 98, 97])
    hits = kv.find_cached_blocks(b)
    assert ids(hits) == [0, 1]
    assert kv.allocate(b, b.num_tokens - 8, hits)
    assert b.block_ids == [0, 1, 3]
    assert b.num_computed_tokens == 8 and b.num_cached_tokens == 8
    assert pool.blocks[0].ref_cnt == 2

    kv.free(a)  # tail first: block 2, then 1, then 0 (0 and 1 still held by b)
    kv.free(b)  # block 3, then 1, then 0
    assert pool.num_free_blocks == 8
    # LRU order: never-used 4..7, then 2, 3, 1, 0.
    assert ids(pool.allocate(8)) == [4, 5, 6, 7, 2, 3, 1, 0]


def test_manager_leaves_last_token_to_compute_and_refuses_when_full():
    pool = BlockPool(3)
    kv = KVCacheManager(pool, 4, ROOT, enable_prefix_caching=True)
    a = _req("a", list(range(8)))
    assert kv.allocate(a, 8)
    a.num_computed_tokens = 8
    kv.cache_computed_blocks(a)
    kv.free(a)
    again = _req("a2", list(range(8)))
    # Both blocks are cached, but the last token must be recomputed for its logits.
    assert ids(kv.find_cached_blocks(again)) == [0]
    big = _req("big", list(range(100, 113)))  # needs 4 blocks, the pool has 3
    assert not kv.allocate(big, 13)
    assert big.block_ids == [] and pool.num_free_blocks == 3


def test_cache_salt_changes_hashes():
    a = hash_prompt([1, 2, 3, 4], 4, ROOT)
    b = hash_prompt([1, 2, 3, 4], 4, ROOT, extra="tenant-b")
    assert a != b and len(a[0]) == 16
    assert hash_prompt([1, 2, 3, 4, 5], 4, ROOT) == a  # partial blocks are not hashed
