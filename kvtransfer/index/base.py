"""Which serving nodes hold which KV blocks, keyed by chained block hash.

The router asks the index how long a prefix of a request's block hashes each node
already holds, and routes by that and by load. Nodes feed it from their block pool's
stored/evicted events.
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tandem.engine.block_hash import BlockHash

# Where a node holds a block: its device cache, or its host tier (copied back on a hit).
TIERS = ("device", "host")


class BlockIndex(ABC):
    """node -> the block hashes it holds and in which tier, queried by longest held
    prefix.

    Invariants every implementation keeps:
    - hashes are chained (`engine.block_hash`), so only leading runs matter: `lookup`
      counts, per node, the blocks of `hashes` it holds *before its first missing one*;
      a node whose prefix is 0 is left out, so "no cache anywhere" is `{}`;
    - `publish`, `evict` and `drop` are idempotent, and evicting or dropping what was
      never published is a no-op; a publish records the block's tier, replacing the one
      published before (a block moves between a node's tiers);
    - the index is advisory and never raises on backend failure: a lost write or a
      failed lookup only costs a cache miss, the router falls back to load;
    - safe to call from several threads at once.
    """

    @abstractmethod
    def publish(self, node: str, hashes: Sequence[BlockHash], tier: str = "device") -> None:
        """Record that `node` holds every block in `hashes`, in `tier` (TIERS)."""

    @abstractmethod
    def evict(self, node: str, hashes: Sequence[BlockHash]) -> None:
        """Record that `node` no longer holds the blocks in `hashes` (in any tier)."""

    def lookup(self, hashes: Sequence[BlockHash]) -> dict[str, int]:
        """node -> number of leading blocks of `hashes` it holds, in either tier; nodes
        with 0 omitted."""
        return {node: held.blocks for node, held in self.lookup_tiers(hashes).items()}

    @abstractmethod
    def lookup_tiers(self, hashes: Sequence[BlockHash]) -> dict[str, Held]:
        """node -> its leading blocks of `hashes`, and how many of them lead on its
        device (the rest of the run is in its host tier, or its device after one there);
        nodes with 0 omitted."""

    @abstractmethod
    def drop(self, node: str) -> None:
        """Forget everything `node` published (it died or left)."""

    @abstractmethod
    def close(self) -> None:
        """Release connections; the index must not be used afterwards."""


@dataclass(frozen=True)
class Held:
    blocks: int  # leading blocks held, in either tier
    device_blocks: int  # of them, leading ones on the device


def check_tier(tier: str) -> str:
    if tier not in TIERS:
        raise ValueError(f"unknown tier {tier!r}; one of {TIERS}")
    return tier


def get_index(url_or_name: str | None, model: str, **options: Any) -> BlockIndex:
    """The index backend named by `url_or_name`, imported only when asked for.

    None or "memory" -> MemoryIndex held in this process;
    "redis://host:port/db" (or rediss://, unix://) -> RedisIndex shared by all routers.
    `model` namespaces the keys so models sharing one Redis never see each other's blocks.
    """
    if url_or_name is None or url_or_name == "memory":
        from tandem.kvtransfer.index.memory import MemoryIndex

        return MemoryIndex(**options)
    scheme, sep, _ = url_or_name.partition("://")
    if sep and scheme in ("redis", "rediss", "unix"):
        module = importlib.import_module("tandem.kvtransfer.index.redis_index")
        return module.RedisIndex(url_or_name, model, **options)
    raise ValueError(f"unknown block index {url_or_name!r}; use 'memory' or a redis:// URL")
