"""The BlockIndex contract, run against every backend (memory here, redis via a real
redis-server), plus what only the memory backend promises."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest
from redis_server import RedisServer

from tandem.engine.block_hash import hash_prompt, root_hash
from tandem.kvtransfer.index import BlockIndex, get_index
from tandem.kvtransfer.index.base import Held
from tandem.kvtransfer.index.memory import MemoryIndex

ROOT = root_hash("test-model", "float32", 4)
PROMPT = hash_prompt(list(range(40)), 4, ROOT)  # 10 chained block hashes
# Shares PROMPT's first 3 blocks, then diverges: a different continuation of one prefix.
BRANCH = hash_prompt(list(range(12)) + [999] * 16, 4, ROOT)


@pytest.fixture(params=["memory", "redis"])
def index(request: pytest.FixtureRequest) -> Iterator[BlockIndex]:
    if request.param == "memory":
        idx = get_index(None, "test-model")
        yield idx
        idx.close()
        return
    with RedisServer() as server:
        idx = get_index(server.url, "test-model")
        yield idx
        idx.close()


def test_branch_shares_only_the_common_prefix():
    assert BRANCH[:3] == PROMPT[:3] and BRANCH[3] != PROMPT[3]


def test_lookup_counts_each_nodes_leading_blocks(index: BlockIndex):
    index.publish("a", PROMPT[:6])
    index.publish("b", PROMPT[:3])
    assert index.lookup(PROMPT) == {"a": 6, "b": 3}
    assert index.lookup(PROMPT[:2]) == {"a": 2, "b": 2}
    assert index.lookup(PROMPT[:5]) == {"a": 5, "b": 3}
    index.publish("b", BRANCH[3:7])
    assert index.lookup(BRANCH) == {"a": 3, "b": 7}


def test_lookup_of_nothing_held_is_empty(index: BlockIndex):
    assert index.lookup(PROMPT) == {}
    assert index.lookup([]) == {}
    index.publish("a", PROMPT[:4])
    assert index.lookup(BRANCH[3:]) == {}


def test_a_node_prefix_ends_at_its_first_missing_block(index: BlockIndex):
    index.publish("a", PROMPT)
    index.publish("b", PROMPT[1:])  # lacks block 0, so it matches nothing
    assert index.lookup(PROMPT) == {"a": 10}
    index.evict("a", [PROMPT[4]])  # a hole: blocks 5.. no longer count
    assert index.lookup(PROMPT) == {"a": 4}
    index.publish("a", [PROMPT[4]])
    assert index.lookup(PROMPT) == {"a": 10}


def test_evict_removes_only_that_nodes_blocks(index: BlockIndex):
    index.publish("a", PROMPT[:6])
    index.publish("b", PROMPT[:3])
    index.evict("b", PROMPT[:3])
    assert index.lookup(PROMPT) == {"a": 6}
    index.evict("a", PROMPT[3:6])
    assert index.lookup(PROMPT) == {"a": 3}
    index.evict("a", PROMPT[:3])
    assert index.lookup(PROMPT) == {}


def test_drop_forgets_everything_a_node_published(index: BlockIndex):
    index.publish("a", PROMPT[:6])
    index.publish("b", PROMPT[:3])
    index.publish("b", BRANCH[3:5])
    index.drop("b")
    assert index.lookup(PROMPT) == {"a": 6}
    assert index.lookup(BRANCH) == {"a": 3}
    index.publish("b", PROMPT[:2])  # a node that comes back starts from nothing
    assert index.lookup(PROMPT) == {"a": 6, "b": 2}


def test_writes_are_idempotent_and_unknowns_are_noops(index: BlockIndex):
    index.publish("a", PROMPT[:4])
    index.publish("a", PROMPT[:4])
    index.evict("a", BRANCH[3:])  # never published
    index.evict("ghost", PROMPT)
    index.drop("ghost")
    index.publish("a", [])
    index.evict("a", [])
    assert index.lookup(PROMPT) == {"a": 4}
    index.evict("a", PROMPT[2:4])
    index.evict("a", PROMPT[2:4])
    assert index.lookup(PROMPT) == {"a": 2}
    index.drop("a")
    index.drop("a")
    assert index.lookup(PROMPT) == {}


def test_tiers_a_block_moves_between_and_the_device_run_leading_a_prefix(index: BlockIndex):
    """A publish records the tier, replacing the last one; `lookup_tiers` gives each
    node's leading run and how much of it leads on the device; `lookup` counts both."""
    index.publish("a", PROMPT[:6])
    index.publish("a", PROMPT[3:5], "host")  # blocks 3 and 4 moved to a's host tier
    index.publish("b", PROMPT[:2], "host")
    index.publish("b", PROMPT[2:4])  # device after host: the device run is 0
    assert index.lookup_tiers(PROMPT) == {"a": Held(6, 3), "b": Held(4, 0)}
    assert index.lookup(PROMPT) == {"a": 6, "b": 4}
    index.publish("a", PROMPT[3:5])  # copied back to the device
    assert index.lookup_tiers(PROMPT)["a"] == Held(6, 6)
    index.evict("a", PROMPT[4:5])  # gone from every tier
    assert index.lookup_tiers(PROMPT)["a"] == Held(4, 4)
    with pytest.raises(ValueError, match="unknown tier"):
        index.publish("a", PROMPT[:1], "disk")


def test_concurrent_publishers(index: BlockIndex):
    def feed(node: str, n: int) -> None:
        for i in range(n):
            index.publish(node, [PROMPT[i]])

    threads = [threading.Thread(target=feed, args=(f"n{k}", k + 1)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert index.lookup(PROMPT) == {f"n{k}": k + 1 for k in range(8)}


def test_memory_drop_and_evict_leave_no_residue():
    index = MemoryIndex()
    index.publish("a", PROMPT)
    index.publish("b", PROMPT[:3])
    index.evict("b", PROMPT[:3])
    index.drop("a")
    assert index._holders == {} and index._by_node == {}


def test_get_index_picks_backend_by_name():
    assert isinstance(get_index(None, "m"), MemoryIndex)
    assert isinstance(get_index("memory", "m"), MemoryIndex)
    for bad in ("", "redis", "etcd://host:2379", "Memory"):
        with pytest.raises(ValueError, match="unknown block index"):
            get_index(bad, "m")
