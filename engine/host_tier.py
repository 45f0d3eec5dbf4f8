"""The host tier: KV blocks evicted from the device cache, kept in host memory (pinned on
CUDA) so a prompt that meets them again copies them back instead of computing them.

    tier = HostTier(num_blocks, kv_caches)     # kv_caches: the runner's, one per layer
    pool.on_reuse = tier.save                  # before a cached device block is reused
    slot = tier.lookup(block_hash, token_ids)  # a hit re-checks the tokens
    tier.load([slot], [block_id])              # into a device block, before the step

Each layer's host tensor is slot-major, `[slots, 2, block_size, kv_heads, head_dim]`, so a
slot is one contiguous piece of (pinned) memory that a block, gathered on the device,
copies into with one asynchronous copy. `save` copies out the blocks about to be reused; a hash
the tier holds already is only touched, so nothing is copied twice. The tier evicts its
own least recently used slot when full. Copies run on the engine thread's current
stream: on CUDA a save gathers the blocks on the device and copies each into its slot without
blocking, ordered after the steps that wrote the blocks and before the step that reuses
them (a load of a slot whose save may still be in flight waits for it); a load gathers
on the host and lands in stream order. On the CPU both copy at once.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tandem.engine.block_hash import BlockHash


@dataclass(frozen=True)
class Evicted:
    """A cached device block about to be reused: what the host tier may keep of it."""

    block_id: int
    block_hash: BlockHash
    token_ids: tuple[int, ...]


def block_bytes(kv_caches: Sequence[torch.Tensor]) -> int:
    """The bytes of one block across every layer (keys and values)."""
    return sum(c[:, 0].numel() * c.element_size() for c in kv_caches)


class HostTier:
    def __init__(self, num_blocks: int, kv_caches: Sequence[torch.Tensor]) -> None:
        if num_blocks < 1:
            raise ValueError(f"the host tier needs at least one block, got {num_blocks}")
        self.kv_caches = list(kv_caches)
        self.num_blocks = num_blocks
        pin = self.kv_caches[0].device.type == "cuda"
        self.host = [torch.empty((num_blocks, c.shape[0], *c.shape[2:]), dtype=c.dtype,
                                 pin_memory=pin) for c in self.kv_caches]
        # hash -> (slot, token ids), least recently used first.
        self._held: OrderedDict[BlockHash, tuple[int, tuple[int, ...]]] = OrderedDict()
        self._free = list(range(num_blocks - 1, -1, -1))  # pop() takes slot 0 first
        self._on_cuda = pin
        self._in_flight: set[int] = set()  # slots whose save may not have landed
        self._saved: torch.cuda.Event | None = None  # recorded after the last save
        self.blocks_saved = 0  # copies out, over the tier's life
        self.blocks_loaded = 0  # copies back

    @property
    def num_used(self) -> int:
        return len(self._held)

    @property
    def usage(self) -> float:
        return len(self._held) / self.num_blocks

    def lookup(self, block_hash: BlockHash, token_ids: Sequence[int]) -> int | None:
        """The slot holding `block_hash` with exactly `token_ids`, marked used now."""
        held = self._held.get(block_hash)
        if held is None or held[1] != tuple(token_ids):
            return None
        self._held.move_to_end(block_hash)
        return held[0]

    def hashes(self) -> list[BlockHash]:
        return list(self._held)

    def save(self, blocks: Sequence[Evicted]) -> list[BlockHash]:
        """Copy out the cached blocks about to be reused (the pool's `on_reuse`); the
        hashes the tier dropped to make room, oldest first."""
        ids, slots, dropped = [], [], []
        for b in blocks:
            if b.block_hash in self._held:  # copied out before and loaded back since
                self._held.move_to_end(b.block_hash)
                continue
            if self._free:
                slot = self._free.pop()
            else:
                old, (slot, _) = self._held.popitem(last=False)
                dropped.append(old)
            self._held[b.block_hash] = (slot, b.token_ids)
            ids.append(b.block_id)
            slots.append(slot)
        if not ids:
            return dropped
        index = torch.tensor(ids, device=self.kv_caches[0].device)
        for src, dst in zip(self.kv_caches, self.host):
            blocks = src.index_select(1, index).transpose(0, 1)  # [n, 2, ...]
            if not self._on_cuda:
                dst.index_copy_(0, torch.tensor(slots), blocks)
                continue
            blocks = blocks.contiguous()
            for j, slot in enumerate(slots):
                dst[slot].copy_(blocks[j], non_blocking=True)
        if self._on_cuda:
            self._in_flight.update(slots)
            self._saved = torch.cuda.Event()
            self._saved.record()
        self.blocks_saved += len(ids)
        return dropped

    def load(self, slots: Sequence[int], block_ids: Sequence[int]) -> None:
        """Copy host slots back into device blocks (which the caller owns)."""
        if not slots:
            return
        if self._saved is not None and self._in_flight:
            if self._saved.query():  # every save so far has landed
                self._in_flight.clear()
            elif self._in_flight.intersection(slots):
                self._saved.synchronize()  # saved this step, not yet on the host
                self._in_flight.clear()
        slots_t = torch.tensor(list(slots))
        index = torch.tensor(list(block_ids), device=self.kv_caches[0].device)
        for src, dst in zip(self.host, self.kv_caches):
            blocks = src.index_select(0, slots_t).to(dst.device)  # [n, 2, ...]
            dst.index_copy_(1, index, blocks.transpose(0, 1))
        self.blocks_loaded += len(slots)
