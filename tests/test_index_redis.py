"""What only the Redis backend promises: key scheme and TTL, lookups that stop at the
first miss, and staying harmless while Redis is dead or hung, then recovering by itself.
The shared BlockIndex contract runs against Redis in test_index_memory.py."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from typing import TypeVar

import pytest
from redis_server import RedisServer

from tandem.engine.block_hash import hash_prompt, root_hash
from tandem.kvtransfer.index import get_index
from tandem.kvtransfer.index.redis_index import RedisIndex

ROOT = root_hash("test-model", "float32", 4)
LONG = hash_prompt(list(range(4000)), 4, ROOT)  # 1000 chained block hashes
T = TypeVar("T")
MAX_CALL_S = 2.0  # a dead Redis must never stall the router longer than this


@pytest.fixture
def server() -> Iterator[RedisServer]:
    with RedisServer() as s:
        yield s


def make_index(server: RedisServer, **options: object) -> RedisIndex:
    index = get_index(server.url, "test-model", **options)
    assert isinstance(index, RedisIndex)
    return index


def timed(fn: Callable[..., T], *args: object) -> tuple[T, float]:
    t0 = time.monotonic()
    result = fn(*args)
    return result, time.monotonic() - t0


def test_lookup_stops_after_the_chunk_with_the_first_miss(server: RedisServer):
    index = make_index(server)  # 32 hashes per round trip
    index.publish("a", LONG[:10])
    assert index.lookup(LONG) == {"a": 10}
    assert index.hashes_queried == 32  # not 1000
    index.publish("a", LONG[10:32])  # the miss is now the first hash of chunk 2
    assert index.lookup(LONG) == {"a": 32}
    assert index.hashes_queried == 32 + 64
    index.publish("b", LONG[:40])
    assert index.lookup(LONG) == {"a": 32, "b": 40}
    assert index.hashes_queried == 32 + 64 + 64


def test_lookup_stops_when_no_node_continues_even_if_hashes_exist_later(server: RedisServer):
    index = make_index(server, lookup_chunk=8)
    index.publish("a", LONG[:5])
    index.publish("b", LONG[6:500])  # lacks block 5 (and 0): never a match
    assert index.lookup(LONG) == {"a": 5}
    assert index.hashes_queried == 8
    assert index.lookup(LONG[6:]) == {"b": 494}


def test_key_scheme_and_ttl(server: RedisServer):
    index = make_index(server, ttl_s=600)
    raw = server.client()
    index.publish("a", LONG[:3])
    index.publish("b", LONG[:1])
    blocks = [f"tandem:test-model:{h.hex()}" for h in LONG[:3]]
    assert set(raw.keys("*")) == {*blocks, "tandem:test-model:node:a", "tandem:test-model:node:b"}
    assert raw.hgetall(blocks[0]).keys() == {"a", "b"}
    assert raw.hgetall(blocks[2]).keys() == {"a"}
    published, tier = raw.hget(blocks[2], "a").split()
    assert abs(float(published) - time.time()) < 5 and tier == "device"
    assert raw.smembers("tandem:test-model:node:a") == {h.hex() for h in LONG[:3]}
    for key in raw.keys("*"):
        assert 0 < raw.ttl(key) <= 600
    raw.expire(blocks[0], 5)
    raw.expire("tandem:test-model:node:a", 5)
    index.publish("a", LONG[:1])  # publishing again refreshes both TTLs
    assert raw.ttl(blocks[0]) > 500 and raw.ttl("tandem:test-model:node:a") > 500
    index.evict("b", LONG[:1])
    index.drop("a")
    assert raw.keys("*") == []  # emptied hashes and sets leave no keys behind


def test_models_do_not_see_each_others_blocks(server: RedisServer):
    index = make_index(server)
    other = get_index(server.url, "other-model")
    index.publish("a", LONG[:4])
    assert other.lookup(LONG) == {}
    other.drop("a")
    assert index.lookup(LONG) == {"a": 4}


def test_entries_older_than_the_ttl_are_ignored(server: RedisServer):
    # A block key stays alive while any node republishes it; a field left by a node
    # that vanished without drop must still age out.
    index = make_index(server, ttl_s=600)
    index.publish("a", LONG[:3])
    raw = server.client()
    for h in LONG[:3]:
        raw.hset(f"tandem:test-model:{h.hex()}", "gone", time.time() - 601)
    assert index.lookup(LONG) == {"a": 3}


def test_killed_redis_degrades_then_recovers_without_a_new_client(
    server: RedisServer, caplog: pytest.LogCaptureFixture
):
    index = make_index(server, backoff_s=0.05, backoff_max_s=0.2)
    index.publish("a", LONG[:5])
    assert index.lookup(LONG) == {"a": 5}

    server.kill()
    with caplog.at_level(logging.INFO, logger="tandem.kvtransfer.index.redis_index"):
        for round_ in range(3):  # in and out of the backoff window
            for call, args, expected in [
                (index.lookup, (LONG,), {}),
                (index.publish, ("a", LONG[:8]), None),
                (index.evict, ("a", LONG[:1]), None),
                (index.drop, ("a",), None),
            ]:
                result, elapsed = timed(call, *args)
                assert result == expected and elapsed < MAX_CALL_S
            time.sleep(0.1 * round_)
        assert index.failed_lookups == 3 and index.dropped_writes == 9
        warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warnings) == 1  # rate-limited, not one per failed call
        assert f"127.0.0.1:{server.port}" in warnings[0].getMessage()

        server.start()  # same port, empty (no persistence)
        time.sleep(0.25)  # past the longest backoff window
        index.publish("a", LONG[:7])
        assert index.lookup(LONG) == {"a": 7}
        assert any("is back" in r.getMessage() for r in caplog.records)
    assert index.failed_lookups == 3 and index.dropped_writes == 9


def test_hung_redis_costs_one_timeout_then_is_skipped_until_backoff_ends(server: RedisServer):
    index = make_index(server, timeout_s=0.3, backoff_s=0.5, backoff_max_s=0.5)
    index.publish("a", LONG[:5])
    server.pause()  # accepts connections, answers nothing
    try:
        result, elapsed = timed(index.lookup, LONG)
        assert result == {} and 0.2 < elapsed < MAX_CALL_S
        result, elapsed = timed(index.lookup, LONG)  # inside the backoff window
        assert result == {} and elapsed < 0.05
        _, elapsed = timed(index.publish, "a", LONG[:6])
        assert elapsed < 0.05
    finally:
        server.resume()
    assert index.failed_lookups == 2 and index.dropped_writes == 1
    time.sleep(0.6)
    assert index.lookup(LONG) == {"a": 5}


def test_unreachable_redis_at_startup_never_raises(server: RedisServer):
    server.kill()
    index = make_index(server)
    result, elapsed = timed(index.lookup, LONG)
    assert result == {} and elapsed < MAX_CALL_S
    index.publish("a", LONG[:2])
    index.drop("a")
    assert index.failed_lookups == 1 and index.dropped_writes == 2
