"""In-process index: held by the router, fed by the nodes' block events."""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence

from tandem.engine.block_hash import BlockHash
from tandem.kvtransfer.index.base import BlockIndex, Held, check_tier


class MemoryIndex(BlockIndex):
    def __init__(self) -> None:
        self._holders: dict[BlockHash, dict[str, str]] = {}  # hash -> {node: tier}
        self._by_node: dict[str, set[BlockHash]] = {}  # node -> its hashes, so drop is O(own)
        self._lock = threading.Lock()

    def publish(self, node: str, hashes: Sequence[BlockHash], tier: str = "device") -> None:
        check_tier(tier)
        with self._lock:
            for h in hashes:
                self._holders.setdefault(h, {})[node] = tier
            self._by_node.setdefault(node, set()).update(hashes)

    def evict(self, node: str, hashes: Sequence[BlockHash]) -> None:
        with self._lock:
            self._forget(node, hashes)
            owned = self._by_node.get(node)
            if owned is not None:
                owned.difference_update(hashes)
                if not owned:
                    del self._by_node[node]

    def drop(self, node: str) -> None:
        with self._lock:
            self._forget(node, self._by_node.pop(node, ()))

    def lookup_tiers(self, hashes: Sequence[BlockHash]) -> dict[str, Held]:
        matched: dict[str, int] = {}
        on_device: dict[str, int] = {}  # nodes whose run has been on the device so far
        with self._lock:
            # Nodes still matching: a node leaves at its first missing hash, and once
            # none is left no longer prefix can match, so the walk stops.
            alive: set[str] | None = None
            for i, h in enumerate(hashes):
                holders = self._holders.get(h, {})
                alive = set(holders) if alive is None else alive & holders.keys()
                if not alive:
                    break
                for node in alive:
                    matched[node] = i + 1
                    if holders[node] == "device" and on_device.get(node, 0) == i:
                        on_device[node] = i + 1
        return {node: Held(n, on_device.get(node, 0)) for node, n in matched.items()}

    def close(self) -> None:
        pass  # nothing held outside this object

    def _forget(self, node: str, hashes: Iterable[BlockHash]) -> None:
        for h in hashes:
            holders = self._holders.get(h)
            if holders is not None and holders.pop(node, None) is not None and not holders:
                del self._holders[h]
