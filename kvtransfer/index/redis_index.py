"""Shared index in Redis, so every router sees every node's blocks.

Keys, namespaced by model so models sharing one Redis never see each other's blocks:
  tandem:{model}:{hash_hex}     Redis hash: node -> "publish time (unix seconds) tier"
                                (a time alone: on the device)
  tandem:{model}:node:{node}    Redis set: hash_hex of every block the node published
Both carry a TTL refreshed on publish, so a node that vanishes without `drop` ages out.
Fields older than the TTL are ignored by `lookup` as well, since a block key can be kept
alive by other nodes' publishes. A live node must republish blocks it keeps longer than
the TTL.

Redis being down must never stall or fail routing: short socket timeouts, no client-side
retries, and after a failure Redis is skipped for a growing backoff window; skipped or
failed writes are dropped and counted, lookups return {} and are counted.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import redis
from redis.backoff import NoBackoff
from redis.client import Pipeline
from redis.retry import Retry

from tandem.engine.block_hash import BlockHash
from tandem.kvtransfer.index.base import BlockIndex, Held, check_tier

log = logging.getLogger(__name__)

_WARN_EVERY_S = 10.0  # while Redis stays down, repeat the warning at most this often
_DROP_CHUNK = 1024  # commands per round trip when dropping a node's (possibly many) blocks


class RedisIndex(BlockIndex):
    def __init__(
        self,
        url: str,
        model: str,
        *,
        ttl_s: int = 3600,
        timeout_s: float = 0.5,
        lookup_chunk: int = 32,
        backoff_s: float = 0.5,
        backoff_max_s: float = 5.0,
    ) -> None:
        # No retries inside redis-py: its default retries with backoff would multiply the
        # timeout on every call while Redis is down; our own backoff window replaces them.
        self._client = redis.Redis.from_url(
            url,
            decode_responses=True,
            socket_connect_timeout=timeout_s,
            socket_timeout=timeout_s,
            retry=Retry(NoBackoff(), 0),
        )
        self._prefix = f"tandem:{model}:"
        self.ttl_s = ttl_s
        self.lookup_chunk = lookup_chunk
        self.backoff_s = backoff_s
        self.backoff_max_s = backoff_max_s
        # Counters, read by metrics and tests.
        self.dropped_writes = 0
        self.failed_lookups = 0
        self.hashes_queried = 0  # hashes whose lookup round trip completed
        self._lock = threading.Lock()
        self._failures = 0  # consecutive; sets the backoff window
        self._down_until = 0.0  # time.monotonic() before which Redis is not tried
        self._last_warning = float("-inf")
        kw = self._client.connection_pool.connection_kwargs
        self._where = kw.get("path") or f"{kw.get('host')}:{kw.get('port')}/{kw.get('db', 0)}"

    def block_key(self, h: BlockHash) -> str:
        return self._prefix + h.hex()

    def node_key(self, node: str) -> str:
        return f"{self._prefix}node:{node}"

    def publish(self, node: str, hashes: Sequence[BlockHash], tier: str = "device") -> None:
        check_tier(tier)
        if not hashes:
            return
        value = f"{time.time()} {tier}"

        def fill(pipe: Pipeline) -> None:
            for h in hashes:
                pipe.hset(self.block_key(h), node, value)
                pipe.expire(self.block_key(h), self.ttl_s)
            pipe.sadd(self.node_key(node), *(h.hex() for h in hashes))
            pipe.expire(self.node_key(node), self.ttl_s)

        self._write("publish", fill)

    def evict(self, node: str, hashes: Sequence[BlockHash]) -> None:
        if not hashes:
            return

        def fill(pipe: Pipeline) -> None:
            for h in hashes:
                pipe.hdel(self.block_key(h), node)  # Redis deletes a hash left empty
            pipe.srem(self.node_key(node), *(h.hex() for h in hashes))

        self._write("evict", fill)

    def drop(self, node: str) -> None:
        got = self._pipeline("drop", lambda pipe: pipe.smembers(self.node_key(node)))
        if got is None:
            self._count_dropped_write()
            return
        hexes = list(got[0])
        for start in range(0, len(hexes), _DROP_CHUNK):
            chunk = hexes[start : start + _DROP_CHUNK]
            # SREM only what was read (not DEL), so a concurrent publish by a restarted
            # node of the same name keeps its new entries.
            if self._pipeline("drop", lambda pipe, c=chunk: self._fill_drop(pipe, node, c)) is None:
                self._count_dropped_write()  # what is left ages out with the TTL
                return

    def lookup_tiers(self, hashes: Sequence[BlockHash]) -> dict[str, Held]:
        matched: dict[str, int] = {}
        on_device: dict[str, int] = {}  # nodes whose run has been on the device so far
        alive: set[str] | None = None  # nodes whose prefix has not ended yet
        fresh_after = time.time() - self.ttl_s
        # Chunked so a short match costs one round trip instead of len(hashes) lookups:
        # once no node holds hash i, no longer prefix can match and later chunks are
        # never sent.
        for start in range(0, len(hashes), self.lookup_chunk):
            if alive is not None and not alive:
                break
            chunk = hashes[start : start + self.lookup_chunk]
            rows = self._pipeline("lookup", lambda pipe, c=chunk: self._fill_lookup(pipe, c))
            if rows is None:
                with self._lock:
                    self.failed_lookups += 1
                return {}
            with self._lock:
                self.hashes_queried += len(chunk)
            for i, row in enumerate(rows, start):
                holders = {node: tier for node, (ts, tier) in map(_parse, row.items())
                           if ts > fresh_after}
                alive = set(holders) if alive is None else alive & holders.keys()
                if not alive:
                    break
                for node in alive:
                    matched[node] = i + 1
                    if holders[node] == "device" and on_device.get(node, 0) == i:
                        on_device[node] = i + 1
        return {node: Held(n, on_device.get(node, 0)) for node, n in matched.items()}

    def close(self) -> None:
        self._client.close()

    def _fill_lookup(self, pipe: Pipeline, chunk: Sequence[BlockHash]) -> None:
        for h in chunk:
            pipe.hgetall(self.block_key(h))

    def _fill_drop(self, pipe: Pipeline, node: str, hexes: list[str]) -> None:
        for x in hexes:
            pipe.hdel(self._prefix + x, node)
        pipe.srem(self.node_key(node), *hexes)

    def _write(self, op: str, fill: Callable[[Pipeline], Any]) -> None:
        if self._pipeline(op, fill) is None:
            self._count_dropped_write()

    def _count_dropped_write(self) -> None:
        with self._lock:
            self.dropped_writes += 1

    def _pipeline(self, op: str, fill: Callable[[Pipeline], Any]) -> list[Any] | None:
        """Send the commands `fill` queues in one round trip; None if Redis is down."""
        if time.monotonic() < self._down_until:
            return None
        try:
            # The context manager resets the pipeline, returning its connection to the
            # pool; a connection that failed is disconnected and reconnects on next use.
            with self._client.pipeline(transaction=False) as pipe:
                fill(pipe)
                result = pipe.execute()
        except (redis.RedisError, OSError) as exc:
            self._mark_down(op, exc)
            return None
        if self._failures:
            self._mark_up()
        return result

    def _mark_down(self, op: str, exc: Exception) -> None:
        now = time.monotonic()
        with self._lock:
            self._failures += 1
            backoff = min(self.backoff_max_s, self.backoff_s * 2 ** (self._failures - 1))
            self._down_until = now + backoff
            warn = now - self._last_warning >= _WARN_EVERY_S
            if warn:
                self._last_warning = now
        if warn:
            log.warning(
                "block index: Redis at %s failed on %s (%s: %s); skipping it for %.1fs, "
                "routing by load meanwhile",
                self._where,
                op,
                type(exc).__name__,
                exc,
                backoff,
            )

    def _mark_up(self) -> None:
        with self._lock:
            recovered, self._failures, self._down_until = self._failures > 0, 0, 0.0
            self._last_warning = float("-inf")  # warn at once if it goes down again
        if recovered:
            log.info("block index: Redis at %s is back", self._where)


def _parse(item: tuple[str, str]) -> tuple[str, tuple[float, str]]:
    """A block key's field: node -> (publish time, tier)."""
    node, value = item
    ts, _, tier = value.partition(" ")
    return node, (float(ts), tier or "device")
