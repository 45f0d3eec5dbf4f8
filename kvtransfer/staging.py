"""Gather a request's scattered KV blocks into one contiguous staging buffer, and scatter
a received one back into the sink's block ids: a run of layers in one kernel
(`kernels/block_copy.py`) when the caches are views of one tensor, as the engine
allocates them, else one per layer. Either way a message carries whole layers, however
many blocks they have. Works on any device.

Staging shapes: one layer `[2, n, bs, H, D]`; a run of k layers `[k, 2, n, bs, H, D]`.
"""

from __future__ import annotations

import array
import threading
from collections.abc import Sequence
from dataclasses import replace

import torch

from tandem.kernels.block_copy import copy_blocks
from tandem.kvtransfer.layout import KVLayout


def _index(block_ids: Sequence[int] | torch.Tensor, device: torch.device) -> torch.Tensor:
    return torch.as_tensor(block_ids, dtype=torch.long, device=device)


def device_ids(*id_lists: Sequence[int], device: torch.device) -> torch.Tensor:
    """The lists of block ids (of one length) as one `[k, n]` int64 tensor on `device`,
    in one copy. On CUDA it goes from pinned memory (`_PinnedSlots`), enqueued on the
    current stream: the caller neither waits for the work queued there (a prefill's
    layers) nor for the copy."""
    if len({len(ids) for ids in id_lists}) > 1:
        raise ValueError(f"id lists of different lengths: {[len(ids) for ids in id_lists]}")
    flat = array.array("q", [b for ids in id_lists for b in ids])  # 3x torch.tensor's speed
    host = (torch.frombuffer(flat, dtype=torch.long) if flat
            else torch.empty(0, dtype=torch.long)).view(len(id_lists), -1)
    if device.type != "cuda":
        return host
    slots = _pinned.__dict__.setdefault("by_device", {})
    if device not in slots:
        slots[device] = _PinnedSlots()
    return slots[device].to(host, device)


_pinned = threading.local()  # each thread's _PinnedSlots, by device


class _PinnedSlots:
    """One thread's pinned host memory for `device_ids`: `SLOTS` slots of `IDS` ids,
    taken in turn, each written again only once the copy out of it the last time is done
    (its event). `Tensor.pin_memory` for each push's ids took a fresh pinned allocation
    whenever the caching host allocator had no free block, and its blocks free up only as
    their copies run, queued behind the GPU's work: under a 1P1D burst on an H200 the
    prefill node's push threads spent most of their time in it."""

    SLOTS = 32
    IDS = 1024  # ids a slot holds at first: a push's source and sink ids, 512 blocks each
    # The most a slot grows to (8 B each): a step's pushes moved together
    # (`sender.write_together`) are source, sink and ticket of every block of the step's
    # prompts. A longer list is pinned on its own.
    MAX_IDS = 1 << 16

    def __init__(self) -> None:
        self._host = torch.empty((self.SLOTS, self.IDS), dtype=torch.long, pin_memory=True)
        self._copied: list[torch.cuda.Event | None] = [None] * self.SLOTS
        self._next = 0

    def to(self, host: torch.Tensor, device: torch.device) -> torch.Tensor:
        if host.numel() > self._host.shape[1]:
            if host.numel() > self.MAX_IDS:
                return host.pin_memory().to(device, non_blocking=True)
            self._grow(host.numel())
        i, self._next = self._next, (self._next + 1) % self.SLOTS
        copied = self._copied[i]
        if copied is None:
            copied = self._copied[i] = torch.cuda.Event()
        else:
            copied.synchronize()  # done long since, unless SLOTS copies are still queued
        slot = self._host[i, :host.numel()]
        slot.copy_(host.view(-1))
        out = slot.view(host.shape).to(device, non_blocking=True)
        copied.record(torch.cuda.current_stream(device))
        return out

    def _grow(self, ids: int) -> None:
        """Slots of the next power of two that holds `ids`, once every copy out of the
        old ones is done."""
        for copied in self._copied:
            if copied is not None:
                copied.synchronize()
        width = 1 << (ids - 1).bit_length()
        self._host = torch.empty((self.SLOTS, width), dtype=torch.long, pin_memory=True)
        self._next = 0


def _rows(t: torch.Tensor) -> torch.Tensor:
    """[..., 2, blocks, bs, H, D] -> [rows, blocks, E]: each block E contiguous elements."""
    return t.flatten(-3).flatten(0, -3)


def stack_layers(caches: Sequence[torch.Tensor], first: int, count: int) -> torch.Tensor | None:
    """caches[first : first + count] as one `[count, 2, N, bs, H, D]` view, if they lie
    back to back in one storage (the engine allocates them so); else None."""
    head = caches[first]
    if count == 1:
        return head.unsqueeze(0)
    if not head.is_contiguous():
        return None
    step = head.numel() * head.element_size()
    storage = head.untyped_storage().data_ptr()
    for i in range(1, count):
        c = caches[first + i]
        if (not c.is_contiguous() or c.untyped_storage().data_ptr() != storage
                or c.data_ptr() != head.data_ptr() + i * step):
            return None
    return head.as_strided((count, *head.shape), (head.numel(), *head.stride()))


class KVRows:
    """Per-layer caches `[2, N, bs, H, D]` seen as rows of blocks: `[2L, N, E]` in one view
    when they lie back to back in one tensor (the engine allocates them so), so one kernel
    moves any run of layers; one kernel per layer otherwise. Built once per cache."""

    def __init__(self, caches: Sequence[torch.Tensor]) -> None:
        self.caches = list(caches)
        stacked = stack_layers(self.caches, 0, len(self.caches))
        self._rows = None if stacked is None else _rows(stacked)
        self._layout: KVLayout | None = None

    def check(self, layout: KVLayout) -> None:
        """Raise LayoutMismatch unless these caches hold `layout` (ValueError if they are
        no KV cache at all); the caches are read once, on the first call."""
        if self._layout is None:
            self._layout = KVLayout.of(self.caches, layout.model_id)
        elif self._layout.model_id != layout.model_id:
            self._layout = replace(self._layout, model_id=layout.model_id)
        self._layout.check(layout)

    @property
    def rows(self) -> torch.Tensor | None:
        """The whole cache as one `[2L, N, E]` view, if its layers lie in one tensor."""
        return self._rows

    def copy_in(self, first: int, src: torch.Tensor, src_ids: torch.Tensor,
                block_ids: torch.Tensor) -> None:
        """Blocks `src_ids` of another cache's rows `src` ([2k, N', E]: layers first ..
        first + k - 1, as `rows` views them) into blocks `block_ids` of those layers."""
        count = src.shape[0] // 2
        if self._rows is not None:
            copy_blocks(src, src_ids, self._rows[2 * first:2 * (first + count)], block_ids)
            return
        for i in range(count):
            copy_blocks(src[2 * i:2 * i + 2], src_ids, _rows(self.caches[first + i]), block_ids)

    def gather(self, first: int, block_ids: torch.Tensor, out: torch.Tensor) -> None:
        """Blocks `block_ids` of layers first .. first + k - 1 into `out` [k, 2, n, bs, H, D]
        (block_ids: int64 on the caches' device)."""
        count = out.shape[0]
        if self._rows is not None:
            copy_blocks(self._rows[2 * first:2 * (first + count)], block_ids, _rows(out), None)
            return
        for i in range(count):
            copy_blocks(_rows(self.caches[first + i]), block_ids, _rows(out[i]), None)

    def scatter(self, first: int, block_ids: torch.Tensor, staged: torch.Tensor) -> None:
        """Write staged [k, 2, n, bs, H, D] into blocks `block_ids` of layers first ..
        first + k - 1; no other block changes. block_ids must be distinct."""
        head = self.caches[first]
        count, n = staged.shape[0], len(block_ids)
        want = (count, 2, n, *head.shape[2:])
        if tuple(staged.shape) != want or staged.dtype != head.dtype:
            raise ValueError(
                f"staged {tuple(staged.shape)} {staged.dtype} does not fit {n} blocks of "
                f"{count} layers of {tuple(head.shape)} {head.dtype}"
            )
        if self._rows is not None:
            copy_blocks(_rows(staged), None, self._rows[2 * first:2 * (first + count)], block_ids)
            return
        for i in range(count):
            copy_blocks(_rows(staged[i]), None, _rows(self.caches[first + i]), block_ids)


def gather_blocks(
    layer_cache: torch.Tensor,
    block_ids: Sequence[int] | torch.Tensor,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """One layer: [2, num_blocks, bs, H, D] -> contiguous [2, n, bs, H, D], in the order
    of `block_ids`. `out`, if given, is reused (its shape must be [2, n, bs, H, D])."""
    idx = _index(block_ids, layer_cache.device)
    if out is None:
        out = layer_cache.new_empty((2, len(idx), *layer_cache.shape[2:]))
    KVRows([layer_cache]).gather(0, idx, out.unsqueeze(0))
    return out


def scatter_blocks(
    layer_cache: torch.Tensor,
    block_ids: Sequence[int] | torch.Tensor,
    staged: torch.Tensor,
) -> None:
    """One layer: write staged[:, i] into block block_ids[i] of layer_cache; no other block
    changes. block_ids must be distinct (a repeated id is written in no defined order)."""
    idx = _index(block_ids, layer_cache.device)
    KVRows([layer_cache]).scatter(0, idx, staged.to(layer_cache.device).unsqueeze(0))


class StagingPool:
    """Reusable receive buffers, so a layer does not land in freshly mapped memory
    (first-touch page faults cost more than the copy on CPU). A buffer is handed out
    by `take` and comes back by `give` once its frame's scatter was enqueued, with the
    CUDA event recorded after that scatter: `take` makes the current stream wait for it,
    so a buffer is never overwritten before it was read, on whatever stream that ran.
    Thread-safe."""

    def __init__(self, keep: int = 8) -> None:
        self._keep = keep  # spare buffers kept in all, most recently returned first
        self._spare: list[tuple[torch.Tensor, torch.cuda.Event | None]] = []
        self._lock = threading.Lock()

    def take(
        self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        with self._lock:
            for i, (t, _) in enumerate(self._spare):
                if tuple(t.shape) == shape and t.dtype == dtype and t.device == device:
                    t, read = self._spare.pop(i)
                    if read is not None:
                        torch.cuda.current_stream(device).wait_event(read)
                    return t
        return torch.empty(shape, dtype=dtype, device=device)

    def give(self, t: torch.Tensor, read: torch.cuda.Event | None = None) -> None:
        with self._lock:
            self._spare.insert(0, (t, read))
            del self._spare[self._keep:]
