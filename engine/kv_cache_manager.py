"""Maps requests onto pool blocks: prefix-cache lookup, slot allocation, caching, free.

With a host tier (`host`), the lookup goes on past the device cache's hits into the
tier: `find_cached_blocks(req, promote=True)` copies the blocks it finds there back into
free device blocks and caches them, so they are hits like any other (never computed
again), and the request's `num_host_cached_tokens` says how many came from the host."""

from __future__ import annotations

from tandem.engine.block_hash import BlockHash, extend_hashes
from tandem.engine.block_pool import Block, BlockPool
from tandem.engine.host_tier import HostTier
from tandem.engine.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(
        self, pool: BlockPool, block_size: int, root: BlockHash, enable_prefix_caching: bool,
        window: int = 0,
    ) -> None:
        self.pool = pool
        self.block_size = block_size
        # Every layer sees only the last `window` keys (0: not so): blocks behind it are
        # given back as a request decodes (`release_behind`).
        self.window = window
        self.root = root
        self.enable_prefix_caching = enable_prefix_caching
        # request id -> how many of its leading blocks are registered in the cache.
        self._num_cached_blocks: dict[str, int] = {}
        self.host: HostTier | None = None  # set with the pool's on_reuse hook
        self._promoted: dict[str, int] = {}  # request id -> blocks it brought back

    def attach_host_tier(self, host: HostTier) -> None:
        self.host = host
        self.pool.on_reuse = host.save

    def find_cached_blocks(self, req: Request, promote: bool = False,
                           whole: bool = False) -> list[Block]:
        """Longest cached prefix of the request's tokens, in whole blocks. At least one
        token is always left to compute, since sampling needs the last token's logits;
        `whole`: not (a peer's pull reads blocks, it computes nothing). With `promote`,
        blocks past the device's hits that the host tier holds are copied into free
        device blocks first, while any are free."""
        if not self.enable_prefix_caching:
            return []
        tokens = req.all_token_ids
        self._update_hashes(req, tokens)
        max_blocks = (len(tokens) - (0 if whole else 1)) // self.block_size
        hits: list[Block] = []
        bs = self.block_size
        for i, h in enumerate(req.block_hashes[:max_blocks]):
            block = self.pool.lookup(h, tokens[i * bs : (i + 1) * bs])
            if block is None:
                break
            hits.append(block)
        if promote and self.host is not None and len(hits) < max_blocks:
            hits += self._promote(req, hits, max_blocks)
        return hits

    def cached_tokens(self, req: Request) -> int:
        """Prompt tokens the device cache and then the host tier hold (nothing moves)."""
        hits = len(self.find_cached_blocks(req))
        if self.host is not None and self.enable_prefix_caching:
            hits += len(self._host_slots(req, hits, (len(req.all_token_ids) - 1)
                                         // self.block_size))
        return hits * self.block_size

    def _host_slots(self, req: Request, start: int, stop: int) -> list[int]:
        """The host tier's slots of `req`'s blocks start.. (before `stop`), up to the
        first it lacks."""
        tokens, bs = req.all_token_ids, self.block_size
        found = []
        for i in range(start, stop):
            slot = self.host.lookup(req.block_hashes[i], tokens[i * bs:(i + 1) * bs])
            if slot is None:
                break
            found.append(slot)
        return found

    def _promote(self, req: Request, hits: list[Block], stop: int) -> list[Block]:
        """Blocks len(hits).. of `req` from the host tier into free device blocks, cached
        (and free, like any cached block no request holds). `hits` are held meanwhile so
        the allocation cannot reuse them; the slots are looked up again after it, since
        the copies out it makes may take the tier's oldest."""
        tokens, bs, start = req.all_token_ids, self.block_size, len(hits)

        def slots(most: int) -> list[int]:  # for up to `most` blocks
            return self._host_slots(req, start, min(stop, start + most))

        if not slots(self.pool.num_free_blocks):
            return []
        self.pool.acquire(hits)  # held hits are not free: count what is left
        try:
            want = len(slots(self.pool.num_free_blocks))
            blocks = self.pool.allocate(want) if want else []
            found = slots(want)
            self.host.load(found, [b.block_id for b in blocks[:len(found)]])
            for i, block in enumerate(blocks[:len(found)]):
                self.pool.cache(block, req.block_hashes[start + i],
                                tokens[(start + i) * bs:(start + i + 1) * bs])
            self.pool.free(reversed(blocks))  # the ones not loaded go back uncached
        finally:
            self.pool.free(reversed(hits))
        if found:
            self._promoted[req.request_id] = self._promoted.get(req.request_id, 0) + len(found)
        return blocks[:len(found)]

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
                promoted = min(self._promoted.get(req.request_id, 0), len(hits))
                req.num_host_cached_tokens = promoted * self.block_size
            self._promoted.pop(req.request_id, None)
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

    def release_behind(self, req: Request) -> None:
        """Where every layer slides: give back a decoding request's blocks that its next
        query no longer sees (it is at position num_computed_tokens and sees keys from
        num_computed_tokens + 1 - window on). They go back as a finished request's do,
        cached, so another prompt may still hit them; `req.block_ids` keeps their ids,
        the first `req.num_released_blocks` of it. Not while the prompt is computed: a
        prefill node pushes the prompt's blocks once it is."""
        if not self.window or req.num_computed_tokens < req.num_prompt_tokens:
            return
        behind = (req.num_computed_tokens + 1 - self.window) // self.block_size
        if behind > req.num_released_blocks:
            ids = req.block_ids[req.num_released_blocks:behind]
            self.pool.free(self.pool.blocks[i] for i in reversed(ids))
            req.num_released_blocks = behind

    def free(self, req: Request) -> None:
        held = req.block_ids[req.num_released_blocks:]
        self.pool.free(self.pool.blocks[i] for i in reversed(held))
        req.block_ids.clear()
        req.num_released_blocks = 0
        req.num_computed_tokens = 0
        self._num_cached_blocks.pop(req.request_id, None)
        self._promoted.pop(req.request_id, None)

    def _update_hashes(self, req: Request, tokens: list[int]) -> None:
        extend_hashes(req.block_hashes, tokens, self.block_size, self.root, req.cache_salt)
