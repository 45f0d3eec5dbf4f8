"""Maps requests onto pool blocks: prefix-cache lookup, slot allocation, caching, free."""

from __future__ import annotations

from tandem.engine.block_hash import BlockHash, extend_hashes
from tandem.engine.block_pool import Block, BlockPool
from tandem.engine.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(
        self, pool: BlockPool, block_size: int, root: BlockHash, enable_prefix_caching: bool
    ) -> None:
        self.pool = pool
        self.block_size = block_size
        self.root = root
        self.enable_prefix_caching = enable_prefix_caching
        # request id -> how many of its leading blocks are registered in the cache.
        self._num_cached_blocks: dict[str, int] = {}

    def find_cached_blocks(self, req: Request) -> list[Block]:
        """Longest cached prefix of the request's tokens, in whole blocks. At least one
        token is always left to compute, since sampling needs the last token's logits."""
        if not self.enable_prefix_caching:
            return []
        tokens = req.all_token_ids
        self._update_hashes(req, tokens)
        max_blocks = (len(tokens) - 1) // self.block_size
        hits: list[Block] = []
        bs = self.block_size
        for i, h in enumerate(req.block_hashes[:max_blocks]):
            block = self.pool.lookup(h, tokens[i * bs : (i + 1) * bs])
            if block is None:
                break
            hits.append(block)
        return hits

    def allocate(self, req: Request, num_new_tokens: int, hits: list[Block] = (),
                 keep_free: int = 0) -> bool:
        """Give `req` blocks for `num_new_tokens` more tokens (after its `hits`, which
        become its first blocks). False, with nothing changed, when blocks run out, or
        when fewer than `keep_free` would be left."""
        total = req.num_computed_tokens + len(hits) * self.block_size + num_new_tokens
        need = cdiv(total, self.block_size) - len(req.block_ids) - len(hits)
        if need <= 0 and not hits:
            return True  # most decode steps: the last block has room
        # Free cache hits count as free blocks; taking them does not make new room.
        free_hits = sum(1 for b in hits if b.ref_cnt == 0)
        if need > self.pool.num_free_blocks - free_hits - keep_free:
            return False
        if hits:
            self.pool.acquire(hits)
            req.block_ids.extend(b.block_id for b in hits)
            req.num_computed_tokens += len(hits) * self.block_size
            if req.num_preemptions == 0:
                req.num_cached_tokens = len(hits) * self.block_size
            self._num_cached_blocks[req.request_id] = len(hits)
        if need > 0:
            req.block_ids.extend(b.block_id for b in self.pool.allocate(need))
        return True

    def cache_computed_blocks(self, req: Request) -> None:
        """Register the request's newly full, computed blocks in the prefix cache."""
        if not self.enable_prefix_caching:
            return
        num_full = min(req.num_computed_tokens, req.num_tokens) // self.block_size
        start = self._num_cached_blocks.get(req.request_id, 0)
        if num_full <= start:
            return  # every step of a decode lands here: nothing is copied
        bs = self.block_size
        # Computed tokens only: the newest output may still be pending on the device.
        tokens = req.all_token_ids[: num_full * bs]
        self._update_hashes(req, tokens)
        for i in range(start, num_full):
            block = self.pool.blocks[req.block_ids[i]]
            self.pool.cache(block, req.block_hashes[i], tokens[i * bs : (i + 1) * bs])
        self._num_cached_blocks[req.request_id] = num_full

    def free(self, req: Request) -> None:
        self.pool.free(self.pool.blocks[i] for i in reversed(req.block_ids))
        req.block_ids.clear()
        req.num_computed_tokens = 0
        self._num_cached_blocks.pop(req.request_id, None)

    def _update_hashes(self, req: Request, tokens: list[int]) -> None:
        extend_hashes(req.block_hashes, tokens, self.block_size, self.root, req.cache_salt)
