"""Refcounted KV blocks, an LRU queue of free blocks, and the prefix-cache map.

Invariants:
- a block is free iff its ref_cnt is 0: never taken yet (made when first taken, lowest id
  first, so a pool of millions of blocks costs nothing until they are used), or queued;
- never-taken blocks come before every queued one (they were queued first);
- a free block keeps its hash (and so stays a cache hit) until it is reallocated;
- the free queue pops least-recently-freed first, so cached blocks are evicted LRU.
Events go to the `on_event` hook; the pool itself knows nothing of who listens. A cached
block about to be reused goes to the `on_reuse` hook first (the host tier copies it out);
with one, the node still holds what leaves the device: "offloaded" names what moved to
the host, and "evicted" what the hook says it dropped, unless the device holds it (again).
A block copied back from the host and cached is "stored" again.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from tandem.engine.block_hash import BlockHash
from tandem.engine.host_tier import Evicted


@dataclass(eq=False)
class Block:
    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None
    # The tokens the block holds once cached; a hit re-checks them, so a hash
    # collision can never hand out the wrong KV.
    token_ids: tuple[int, ...] | None = None


@dataclass(frozen=True)
class BlockEvent:
    kind: str  # "stored" (on the device) | "offloaded" (device -> host tier) | "evicted"
    block_hashes: tuple[BlockHash, ...]


EventHook = Callable[[BlockEvent], None]
ReuseHook = Callable[[list[Evicted]], list[BlockHash]]  # -> the hashes it dropped


class BlockPool:
    def __init__(self, num_blocks: int, on_event: EventHook | None = None) -> None:
        self._num_blocks = num_blocks
        self.blocks: list[Block] = []  # those taken at least once: block_id is the index
        self._free: OrderedDict[int, Block] = OrderedDict()  # taken, then freed: LRU first
        self._cached: dict[BlockHash, Block] = {}
        # Where stored/evicted events go; a node sets it once it knows who listens.
        self.on_event = on_event
        # Cached blocks about to be given new contents, before they are (the host tier).
        self.on_reuse: ReuseHook | None = None

    @property
    def num_blocks(self) -> int:
        return self._num_blocks

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be allocated now, cached-but-unused ones included."""
        return len(self._free) + self._num_blocks - len(self.blocks)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def allocate(self, n: int) -> list[Block]:
        if n > self.num_free_blocks:
            raise RuntimeError(f"asked for {n} blocks, {self.num_free_blocks} free")
        blocks = [self._take() for _ in range(n)]
        dropped: list[BlockHash] = []
        if self.on_reuse is not None:
            reused = [Evicted(b.block_id, b.block_hash, b.token_ids) for b in blocks
                      if b.block_hash is not None]
            if reused:
                dropped = self.on_reuse(reused)
        evicted = [h for b in blocks if (h := self._uncache(b)) is not None]
        offloaded: list[BlockHash] = []
        if self.on_reuse is not None:  # what left the device is on the host
            gone = set(dropped)
            offloaded = [h for h in evicted if h not in gone and h not in self._cached]
            evicted = [h for h in dropped if h not in self._cached]
        for b in blocks:
            b.ref_cnt = 1
        if offloaded:
            self._emit("offloaded", offloaded)
        if evicted:
            self._emit("evicted", evicted)
        return blocks

    def _take(self) -> Block:
        if len(self.blocks) < self._num_blocks:
            block = Block(len(self.blocks))
            self.blocks.append(block)
            return block
        return self._free.popitem(last=False)[1]

    def lookup(self, block_hash: BlockHash, token_ids: Sequence[int]) -> Block | None:
        block = self._cached.get(block_hash)
        if block is None or block.token_ids != tuple(token_ids):
            return None
        return block

    def acquire(self, blocks: Iterable[Block]) -> None:
        """Take a reference on cache hits; a free hit leaves the free queue."""
        for b in blocks:
            if b.ref_cnt == 0:
                del self._free[b.block_id]
            b.ref_cnt += 1

    def free(self, blocks: Iterable[Block]) -> None:
        """Drop a reference on each block; pass a request's blocks tail first so its
        last blocks, the least likely to be shared, are evicted first."""
        for b in blocks:
            assert b.ref_cnt > 0, f"double free of block {b.block_id}"
            b.ref_cnt -= 1
            if b.ref_cnt == 0:
                self._free[b.block_id] = b

    def cache(self, block: Block, block_hash: BlockHash, token_ids: Sequence[int]) -> None:
        """Register a full, computed block under its hash (first writer wins)."""
        if block.block_hash is not None or block_hash in self._cached:
            return
        block.block_hash, block.token_ids = block_hash, tuple(token_ids)
        self._cached[block_hash] = block
        self._emit("stored", [block_hash])

    def cached_hashes(self) -> list[BlockHash]:
        """Every block hash held now (in use or free but still cached)."""
        return list(self._cached)

    def reset_prefix_cache(self) -> None:
        evicted = [h for b in self.blocks if b.ref_cnt == 0 and (h := self._uncache(b))]
        if evicted:
            self._emit("evicted", evicted)

    def _uncache(self, block: Block) -> BlockHash | None:
        h = block.block_hash
        if h is None:
            return None
        del self._cached[h]
        block.block_hash = block.token_ids = None
        return h

    def _emit(self, kind: str, hashes: list[BlockHash]) -> None:
        if self.on_event is not None:
            self.on_event(BlockEvent(kind, tuple(hashes)))
