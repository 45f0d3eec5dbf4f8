"""The router's block-hash index: which node holds which KV blocks, asked how much of a
prompt each node has cached before a prefill node is picked.

- `memory` (the default): held here and fed by every node's `BlockEvents` stream (a
  snapshot, then each block stored on the device, offloaded to the host tier, or
  evicted, in order); a node whose stream breaks is dropped until it is back.
- `redis://...`: shared by every router; the nodes publish to it themselves
  (`tandem node --index`), the router only looks up. Redis down: lookups find nothing
  and routing goes by load alone (the index never raises).

Prompts are hashed as the nodes hash their blocks (`engine/block_hash.py`), rooted in
the layout the nodes report: model id, dtype, block size.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

import grpc

from tandem.engine.block_hash import hash_prompt, root_hash
from tandem.kvtransfer.index import get_index
from tandem.kvtransfer.index.base import BlockIndex
from tandem.protos import node_pb2 as pb
from tandem.router.pool import Cached, NodeClient, Pool

log = logging.getLogger(__name__)

RESUBSCRIBE_S = 1.0


class RouterIndex:
    def __init__(self, url: str | None, pool: Pool, model: str) -> None:
        self.url = url or "memory"
        self.shared = self.url != "memory"
        self.pool, self.model = pool, model
        self.index: BlockIndex | None = None
        self._tasks: dict[NodeClient, asyncio.Task] = {}
        self.lookups = 0
        self.hit_blocks = 0

    async def start(self) -> None:
        """After the pool's first poll: the nodes' layout names the model's keys."""
        layout = self._layout()
        self.index = await asyncio.to_thread(get_index, self.url,
                                             layout.model_id if layout else self.model)
        if not self.shared:
            for node in self.pool.nodes:
                self.added(node)
            self.pool.listeners.append(self)

    def added(self, node: NodeClient) -> None:
        self._tasks[node] = asyncio.create_task(self._follow(node))

    def removed(self, node: NodeClient) -> None:
        task = self._tasks.pop(node, None)
        if task is not None:
            task.cancel()
        if self.index is not None:
            self.index.drop(node.address)

    async def close(self) -> None:
        for task in self._tasks.values():
            task.cancel()
        if self.index is not None:
            await asyncio.to_thread(self.index.close)

    async def cached_tokens(self, prompt: Sequence[int]) -> dict[str, Cached]:
        """node address -> how many leading tokens of `prompt` it holds KV for, and how
        many of them lead on its device."""
        layout = self._layout()
        if self.index is None or layout is None:
            return {}
        root = root_hash(layout.model_id, layout.dtype, layout.block_size)
        hashes = hash_prompt(prompt, layout.block_size, root)
        if not hashes:
            return {}
        if self.shared:
            found = await asyncio.to_thread(self.index.lookup_tiers, hashes)
        else:
            found = self.index.lookup_tiers(hashes)
        self.lookups += 1
        self.hit_blocks += max((held.blocks for held in found.values()), default=0)
        bs = layout.block_size
        return {node: Cached(held.blocks * bs, held.device_blocks * bs)
                for node, held in found.items()}

    def _layout(self) -> pb.KVLayout | None:
        for node in self.pool.nodes:
            if node.health is not None and node.health.layout.block_size:
                return node.health.layout
        return None

    async def _follow(self, node: NodeClient) -> None:
        """Feed the in-memory index from `node`'s block events, for as long as we run."""
        assert self.index is not None
        while True:
            try:
                async for batch in node.stub.BlockEvents(pb.BlockEventsRequest()):
                    if batch.snapshot:
                        self.index.drop(node.address)
                    if batch.stored:
                        self.index.publish(node.address, list(batch.stored))
                    if batch.offloaded:  # (a snapshot: the blocks only in the host tier)
                        self.index.publish(node.address, list(batch.offloaded), "host")
                    if batch.evicted:
                        self.index.evict(node.address, list(batch.evicted))
            except grpc.aio.AioRpcError as exc:
                log.debug("block events of %s: %s", node.name, exc.details())
            self.index.drop(node.address)  # what it holds is unknown until it is back
            await asyncio.sleep(RESUBSCRIBE_S)
