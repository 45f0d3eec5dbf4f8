"""The host tier: KV blocks evicted from the device cache, kept in host memory (pinned on
CUDA) so a prompt that meets them again copies them back instead of computing them.

    tier = HostTier(num_blocks, kv_caches)     # kv_caches: the runner's, one per layer
    pool.on_reuse = tier.save                  # before a cached device block is reused
    slot = tier.lookup(block_hash, token_ids)  # a hit re-checks the tokens
    tier.load([slot], [block_id])              # into a device block, before the step

Each layer's host tensor mirrors the device cache's `[2, blocks, block_size, kv_heads,
head_dim]` over the tier's slots. `save` copies out the blocks about to be reused; a hash
the tier holds already is only touched, so nothing is copied twice. The tier evicts its
own least recently used slot when full. Copies run on the engine thread's current
stream: on CUDA a save is non-blocking, block by block into pinned memory, ordered after
the steps that wrote the blocks and before the step that reuses them (a load of a slot
whose save may still be in flight waits for it); a load stages through the host at once
and lands in stream order. On the CPU both copy at once.
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
        self.host = [torch.empty((c.shape[0], num_blocks, *c.shape[2:]), dtype=c.dtype,
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
        if not self._on_cuda:
            self._gather_scatter(self.kv_caches, ids, self.host, slots)
        else:
            for src, dst in zip(self.kv_caches, self.host):
                for block_id, slot in zip(ids, slots):
                    dst[:, slot].copy_(src[:, block_id], non_blocking=True)
            self._in_flight.update(slots)
            self._saved = torch.cuda.Event()
            self._saved.record()
        self.blocks_saved += len(ids)
        return dropped

    def load(self, slots: Sequence[int], block_ids: Sequence[int]) -> None:
        """Copy host slots back into device blocks (which the caller owns)."""
        if not slots:
            return
        if self._saved is not None and self._in_flight.intersection(slots):
            self._saved.synchronize()  # saved this step, not yet on the host
            self._in_flight.clear()
        self._gather_scatter(self.host, list(slots), self.kv_caches, list(block_ids))
        self.blocks_loaded += len(slots)

    def clear(self) -> None:
        self._held.clear()
        self._free = list(range(self.num_blocks - 1, -1, -1))

    @staticmethod
    def _gather_scatter(src: list[torch.Tensor], src_ids: list[int], dst: list[torch.Tensor],
                        dst_ids: list[int]) -> None:
        """dst[:, dst_ids] = src[:, src_ids], layer by layer; the source on the host or
        on the destination's device (the gather is made there, then copied)."""
        src_index = torch.tensor(src_ids, device=src[0].device)
        dst_index = torch.tensor(dst_ids, device=dst[0].device)
        for s, d in zip(src, dst):
            d.index_copy_(1, dst_index, s.index_select(1, src_index).to(d.device))
