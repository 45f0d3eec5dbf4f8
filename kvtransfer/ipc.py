"""The ipc connector: KV between two processes on one host, with no staging buffer and no
link protocol in the way. The receiving agent exports its KV cache once; a sink's
SinkInfo names it (`target`), and the sender writes the sink's blocks straight into it,
any run of layers in one kernel (`kernels/block_copy.py`) enqueued on its own stream
right after the layers are computed: the gather, the move and the scatter are one copy,
and no round trip comes before it.

- CUDA: the receiver's cache is exported as a CUDA IPC memory handle and mapped into the
  sender's device context, so the copy writes it over NVLink (or PCIe) by peer access.
  The sender records a CUDA IPC event after each copy and says so in a control frame;
  the receiver marks the sink ready once the event after the last layer has completed.
- CPU: the receiver's cache moves into shared memory (once, in place) and the sender
  maps it through `/proc/<pid>/fd`.

A sender may write into a sink before the receiver has heard of it, so the receiver
guards its blocks (`WriteGuard`): each block carries the ticket of the sink that owns it,
the copy writes a block only while its tag holds the sink's ticket, and a failed sink's
tags are cleared before its blocks go back to the pool. A push that comes after its sink
expired or was aborted writes nothing.

Control frames (begin, the layers written, the replies) ride on the tcp connector; a
layer frame carries no payload. Needs both processes on one host (checked: the kernel's
boot id) and in one PID namespace; on CUDA, each process must see the other's GPU
(CUDA_VISIBLE_DEVICES) and the two GPUs must allow peer access. Mapping the other
process's memory is `kvtransfer/ipc_mapping.py`; a mapping lives until its exporter is
gone and no transfer writes it, or the connector closes.
"""

from __future__ import annotations

import itertools
import random
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from tandem.kernels.block_copy import plan_copy
from tandem.kvtransfer.connector import TransferError
from tandem.kvtransfer.ipc_mapping import SharedCaches, SharedEvent, export, shared_event
from tandem.kvtransfer.layout import KVLayout
from tandem.kvtransfer.tcp import TcpConnector


class WriteGuard:
    """The receiver's half of the write check: one int32 tag per block of its cache, the
    ticket of the sink that a sender may write into that block now, 0 for none. A
    sender's copy checks each block's tag just before writing it (`copy_blocks` with a
    guard), so a push that comes late, after its sink expired or was aborted, writes
    nothing. `close` clears a sink's tags; a copy that read a tag just before that may
    still be writing that block's last tile, so the blocks go back to the pool only
    `SETTLE_S` later."""

    SETTLE_S = 0.02  # a tile is at most 32 KiB: written within microseconds of its check

    def __init__(self, num_blocks: int, device: torch.device) -> None:
        self.tags = torch.zeros(num_blocks, dtype=torch.int32, device=device)
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.desc = export(self.tags)
        self._next = itertools.count(random.randrange(1, 2**30))

    def open_many(self, indices: list[torch.Tensor]) -> list[int]:
        """Let the sinks of blocks `indices` be written: their new tickets, set (in one
        write, waited for once) when this returns."""
        tickets = [next(self._next) % (2**31 - 1) + 1 for _ in indices]
        values = torch.tensor([t for t, index in zip(tickets, indices, strict=True)
                               for _ in range(len(index))], dtype=torch.int32)
        if self._stream is None:
            self.tags.index_copy_(0, torch.cat(indices), values)
            return tickets
        with torch.cuda.stream(self._stream):  # the ids made here: nothing to record
            self.tags.index_copy_(0, torch.cat(indices),
                                  values.to(self.tags.device, non_blocking=True))
        for index in indices:
            index.record_stream(self._stream)
        self._stream.synchronize()
        return tickets

    def close(self, index: torch.Tensor, wait: bool = True) -> None:
        """No more writes into blocks `index` start once this returns (`wait`), or very
        soon after (not `wait`: for a sink whose writer is known to be done)."""
        self._set(index, 0, wait)

    def _set(self, index: torch.Tensor, value: int, wait: bool = True) -> None:
        if self._stream is None:
            self.tags.index_fill_(0, index, value)
            return
        with torch.cuda.stream(self._stream):
            self.tags.index_fill_(0, index, value)
        index.record_stream(self._stream)  # made on another stream: kept until this ran
        if wait:
            self._stream.synchronize()


@dataclass(eq=False)
class Target:
    """Where a sender writes one sink's blocks: the receiver's cache and tags as mapped
    here and the sink's ticket. `close` once no write into it is left to run."""

    caches: SharedCaches
    descs: list[dict[str, Any]]  # the mappings this holds, as the receiver exported them
    device: torch.device
    rows: torch.Tensor | None = None  # the receiver's cache as [2L, N, E]
    tags: torch.Tensor | None = None
    ticket: int = 0

    @classmethod
    def open(cls, caches: SharedCaches, target: Any, layout: KVLayout,
             block_ids: Sequence[int], device: torch.device) -> Target:
        """Map the cache a sink's `target` names (SinkInfo.target); raises TransferError
        if it can't be written from here or does not hold `layout`'s blocks `block_ids`,
        and LayoutMismatch if the receiver's layout is not `layout`."""
        try:
            cache, tags, ticket = target["cache"], target["tags"], int(target["ticket"])
            receiver_layout = KVLayout.from_dict(target["layout"])
        except (KeyError, TypeError, ValueError) as exc:
            raise TransferError(f"bad ipc target: {exc!r}") from exc
        receiver_layout.check(layout, "on the receiver", "on the sender")
        out = cls(caches, [], device, ticket=ticket)
        try:
            out.rows, out.tags = out._map(cache), out._map(tags)
            rows, tags_view = out.rows, out.tags
            rows_e = (2 * layout.num_layers,  # K and V rows; elements per block:
                      layout.block_bytes // (2 * layout.torch_dtype.itemsize))
            if (rows.dim() != 3 or (rows.shape[0], rows.shape[2]) != rows_e
                    or rows.dtype != layout.torch_dtype or rows.stride(2) != 1
                    or tuple(tags_view.shape) != (rows.shape[1],)
                    or tags_view.dtype != torch.int32):
                raise TransferError(f"the receiver's cache {tuple(rows.shape)} {rows.dtype} "
                                    f"does not hold this layout's blocks")
            if block_ids and (min(block_ids) < 0 or max(block_ids) >= rows.shape[1]):
                raise TransferError(f"sink block ids out of range: {list(block_ids)}")
        except BaseException:
            out.close()
            raise
        return out

    def _map(self, desc: dict[str, Any]) -> torch.Tensor:
        view = self.caches.open(desc, self.device)
        self.descs.append(desc)
        return view

    def plan_write(self, src: torch.Tensor, ids: torch.Tensor, first: int,
                   count: int, tickets: torch.Tensor | None = None) -> Callable[[], None]:
        """Layers first .. first + count - 1 of blocks `ids[0]` of `src` (this side's cache
        as [2L, N, E]) into the sink's blocks `ids[1]`: the copy, checked and set up; each
        call enqueues it on the current stream. `tickets`: one per block, for blocks of
        several sinks of this cache (each its own target's ticket), in place of this
        one's."""
        assert self.rows is not None and self.tags is not None
        src_rows, dst_rows = src, self.rows
        if count != src.shape[0] // 2:  # a run of layers: views of those rows
            rows = slice(2 * first, 2 * (first + count))
            src_rows, dst_rows = src[rows], self.rows[rows]
        return plan_copy(src_rows, ids[0], dst_rows, ids[1],
                         (self.tags, self.ticket if tickets is None else tickets))

    def close(self) -> None:
        for desc in self.descs:
            self.caches.release(desc, self.device)
        self.descs = []


class IpcConnector(TcpConnector):
    """tcp for the control frames; the sender writes the KV into the receiver's cache."""

    name = "ipc"
    direct = True

    def __init__(self, io_timeout: float = 30.0) -> None:
        super().__init__(io_timeout)
        self._exports: dict[tuple, dict[str, Any]] = {}
        self._events: list[SharedEvent] = []
        self._lock = threading.Lock()
        self.mapped = SharedCaches()

    def export(self, rows: torch.Tensor) -> dict[str, Any]:
        """`export(rows)`, once per view."""
        key = (rows.data_ptr(), tuple(rows.shape), tuple(rows.stride()), rows.dtype)
        with self._lock:
            if key not in self._exports:
                self._exports[key] = export(rows)
            return self._exports[key]

    def event(self, device: torch.device) -> SharedEvent:
        """An event for one push to mark its writes with; back with `give_event` once the
        push is over: its receiver has seen the last write complete, or the push failed
        (and its receiver no longer looks at the event)."""
        with self._lock:
            for i, shared in enumerate(self._events):
                if shared.device == device:
                    return self._events.pop(i)
        return shared_event(device)

    def give_event(self, shared: SharedEvent) -> None:
        with self._lock:
            self._events.append(shared)

    def close(self) -> None:
        super().close()
        self.mapped.close()
