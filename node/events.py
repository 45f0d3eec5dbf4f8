"""A node's KV block events (the engine's block pool: stored, offloaded, evicted), fanned
out to the routers that follow them (`BlockEvents` streams, each with its own queue) and,
given a shared index (`redis://...`), published there, with their tier, by a background
thread. The engine's loop
thread only enqueues: nothing here blocks a step."""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable

from tandem.engine.block_pool import BlockEvent
from tandem.kvtransfer.index.base import BlockIndex

log = logging.getLogger(__name__)


class BlockEvents:
    def __init__(self, node_id: str, index: BlockIndex | None = None) -> None:
        self.node_id, self.index = node_id, index
        self._subscribers: set[Callable[[BlockEvent], None]] = set()
        self._lock = threading.Lock()
        self._to_index: queue.SimpleQueue[BlockEvent | None] = queue.SimpleQueue()
        self._publisher = None
        if index is not None:
            self._publisher = threading.Thread(target=self._publish, name="index-publish",
                                               daemon=True)
            self._publisher.start()

    def on_event(self, event: BlockEvent) -> None:
        """The block pool's hook (on the engine loop's thread)."""
        with self._lock:
            subscribers = list(self._subscribers)
        for subscriber in subscribers:
            subscriber(event)
        if self._publisher is not None:
            self._to_index.put(event)

    def subscribe(self, subscriber: Callable[[BlockEvent], None]) -> None:
        """`subscriber(event)` on the engine loop's thread for each event: must not block."""
        with self._lock:
            self._subscribers.add(subscriber)

    def unsubscribe(self, subscriber: Callable[[BlockEvent], None]) -> None:
        with self._lock:
            self._subscribers.discard(subscriber)

    def close(self) -> None:
        """Stop publishing and take this node's blocks out of the shared index."""
        if self._publisher is not None and self.index is not None:
            self._to_index.put(None)
            self._publisher.join(timeout=10)
            self.index.drop(self.node_id)
            self.index.close()

    def _publish(self) -> None:
        assert self.index is not None
        while (event := self._to_index.get()) is not None:
            if event.kind == "evicted":
                self.index.evict(self.node_id, event.block_hashes)
            else:
                tier = "host" if event.kind == "offloaded" else "device"
                self.index.publish(self.node_id, event.block_hashes, tier)
