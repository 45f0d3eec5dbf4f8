"""The host tier: KV blocks evicted from the device cache, kept in host memory (pinned on
CUDA) so a prompt that meets them again copies them back instead of computing them.

    tier = HostTier(num_blocks, kv_caches)     # kv_caches: the runner's, one per layer
    pool.on_reuse = tier.save                  # before a cached device block is reused
    slot = tier.lookup(block_hash, token_ids)  # a hit re-checks the tokens
    tier.load([slot], [block_id])              # into a device block, before the step

A slot holds one block of every layer, contiguous: the host tensor is
`[slots, layers, 2, block_size, kv_heads, head_dim]`, so a block moves in one copy of its
whole KV (2 MiB at Llama-3-8B's shape) and a run of consecutive slots in one copy, at the
link's rate rather than a small copy's. `save` gathers the blocks about to be reused on
the device (one kernel when the layers are views of one tensor, as the runner's are) and
copies them out; `load` copies slots into a device buffer and scatters it into the
blocks. A hash the tier holds already is only touched, so nothing is copied twice; the
tier evicts its own least recently used slot when full. On CUDA every copy is
asynchronous on the engine thread's current stream, so a save lands after the steps that
wrote its blocks and before the step that reuses them, and a load of a slot lands after
its save; on the CPU both copy at once.
"""

from __future__ import annotations

import time
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
        first = self.kv_caches[0]  # [2, device blocks, block_size, kv_heads, head_dim]
        assert all(c.shape == first.shape and c.dtype == first.dtype for c in self.kv_caches)
        self.num_blocks = num_blocks
        self.device = first.device
        self._layers = _one_tensor(self.kv_caches)
        pin = self.device.type == "cuda"
        self.host = torch.empty((num_blocks, len(self.kv_caches), 2, *first.shape[2:]),
                                dtype=first.dtype, pin_memory=pin)
        # hash -> (slot, token ids), least recently used first.
        self._held: OrderedDict[BlockHash, tuple[int, tuple[int, ...]]] = OrderedDict()
        self._free = list(range(num_blocks - 1, -1, -1))  # pop() takes slot 0 first
        self.blocks_saved = 0  # copies out, over the tier's life
        self.blocks_loaded = 0  # copies back
        # Measured loads (their rate prices a host hit against computing the tokens):
        # blocks and seconds of the loads known to have ended; on CUDA, the events
        # around each load still in flight.
        self.timed_blocks, self.timed_seconds = 0, 0.0
        self._timing: list[tuple[torch.cuda.Event, torch.cuda.Event, int]] = []

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
        if ids:
            staged = self._gather(self._index(ids))
            for at, to, n in _runs(slots):
                self.host[to:to + n].copy_(staged[at:at + n], non_blocking=True)
            self.blocks_saved += len(ids)
        return dropped

    def load(self, slots: Sequence[int], block_ids: Sequence[int]) -> None:
        """Copy host slots back into device blocks (which the caller owns), timed."""
        if not slots:
            return
        began, started = time.perf_counter(), self._event()
        staged = torch.empty((len(slots), *self.host.shape[1:]), dtype=self.host.dtype,
                             device=self.device)
        for at, first, n in _runs(slots):
            staged[at:at + n].copy_(self.host[first:first + n], non_blocking=True)
        self._scatter(self._index(block_ids), staged)
        self.blocks_loaded += len(slots)
        if started is None:
            self.timed_blocks += len(slots)
            self.timed_seconds += time.perf_counter() - began
        else:
            self._timing.append((started, self._event(), len(slots)))
        self.settle()

    def settle(self) -> None:
        """Count the timed loads that have ended (never waits): the engine settles before
        each step, so the rates that Stats report lag a step at most."""
        while self._timing and self._timing[0][1].query():
            start, end, blocks = self._timing.pop(0)
            self.timed_blocks += blocks
            self.timed_seconds += start.elapsed_time(end) / 1e3

    def _event(self) -> torch.cuda.Event | None:
        if self.device.type != "cuda":
            return None
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def _index(self, ids: Sequence[int]) -> torch.Tensor:
        return torch.tensor(list(ids), dtype=torch.int64, device=self.device)

    def _gather(self, ids: torch.Tensor) -> torch.Tensor:
        """Device blocks `ids` of every layer: [n, layers, 2, block_size, H, D], contiguous."""
        if self._layers is not None:  # one kernel, writing the blocks in slot order
            return self._layers.permute(2, 0, 1, 3, 4, 5).index_select(0, ids)
        blocks = torch.stack([c.index_select(1, ids) for c in self.kv_caches])
        return blocks.permute(2, 0, 1, 3, 4, 5).contiguous()

    def _scatter(self, ids: torch.Tensor, blocks: torch.Tensor) -> None:
        """`blocks` ([n, layers, 2, ...]) into device blocks `ids` of every layer."""
        blocks = _bytes(blocks)
        if self._layers is not None:
            _bytes(self._layers).permute(2, 0, 1, 3, 4, 5).index_copy_(0, ids, blocks)
            return
        for layer, cache in enumerate(self.kv_caches):
            _bytes(cache).index_copy_(1, ids, blocks[:, layer].transpose(0, 1))


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """An FP8 cache as its bytes: the CPU has no index_copy_ for FP8."""
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def _one_tensor(caches: list[torch.Tensor]) -> torch.Tensor | None:
    """The layers as one `[layers, 2, blocks, ...]` tensor when they are its slices in
    order (the runner's caches), so a gather or scatter is one kernel; else None."""
    base = caches[0]._base
    if base is None or base.dim() != caches[0].dim() + 1 or base.shape[0] != len(caches):
        return None
    if not all(c._base is base and c.data_ptr() == base[i].data_ptr()
               for i, c in enumerate(caches)):
        return None
    return base


def _runs(slots: Sequence[int]) -> list[tuple[int, int, int]]:
    """Runs of consecutive slots: (index of the run's first in `slots`, its first slot,
    its length)."""
    runs: list[tuple[int, int, int]] = []
    for i, slot in enumerate(slots):
        if runs and slot == runs[-1][1] + runs[-1][2]:
            at, start, n = runs[-1]
            runs[-1] = (at, start, n + 1)
        else:
            runs.append((i, slot, 1))
    return runs
