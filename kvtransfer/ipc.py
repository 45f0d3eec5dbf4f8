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
(CUDA_VISIBLE_DEVICES) and the two GPUs must allow peer access. A mapping lives until
its exporter is gone and no transfer writes it, or the connector closes.
"""

from __future__ import annotations

import ctypes
import functools
import itertools
import os
import random
import socket
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from tandem.kernels.block_copy import plan_copy
from tandem.kvtransfer.connector import TransferError, dtype_from_name, dtype_name
from tandem.kvtransfer.layout import KVLayout
from tandem.kvtransfer.tcp import TcpConnector


@functools.cache
def host_id() -> str:
    """This boot of this machine: equal in two processes exactly when they share a host."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return socket.gethostname()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class _IpcHandle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_char * 64)]


_CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS = 1


class _Driver:
    """The few CUDA driver calls torch does not expose. torch's own IPC rebuild maps a
    handle into the exporting GPU's context, where a kernel on another GPU of this
    process can't reach it; `open` maps it into the context of the GPU that copies."""

    def __init__(self) -> None:
        try:
            self._cu = ctypes.CDLL("libcuda.so.1")
        except OSError as exc:
            raise TransferError(f"ipc on CUDA needs the CUDA driver: {exc}") from exc
        self._cu.cuIpcOpenMemHandle_v2.argtypes = [
            ctypes.POINTER(ctypes.c_uint64), _IpcHandle, ctypes.c_uint]

    def _call(self, name: str, *args: Any) -> None:
        rc = getattr(self._cu, name)(*args)
        if rc != 0:
            raise TransferError(f"CUDA driver call {name} failed with error {rc}")

    def _push(self, device: torch.device) -> ctypes.c_int:
        """Make `device`'s primary context (the one torch uses) current; its device."""
        dev, ctx = ctypes.c_int(), ctypes.c_void_p()
        self._call("cuDeviceGet", ctypes.byref(dev), device.index or 0)
        self._call("cuDevicePrimaryCtxRetain", ctypes.byref(ctx), dev)
        self._call("cuCtxPushCurrent_v2", ctx)
        return dev

    def _pop(self, dev: ctypes.c_int) -> None:
        ctx = ctypes.c_void_p()
        self._cu.cuCtxPopCurrent_v2(ctypes.byref(ctx))
        self._cu.cuDevicePrimaryCtxRelease_v2(dev)

    def export(self, ptr: int, device: torch.device) -> tuple[bytes, int, int]:
        """(handle, ptr's offset in its allocation, the allocation's size)."""
        dev = self._push(device)
        try:
            base, size, handle = ctypes.c_uint64(), ctypes.c_size_t(), _IpcHandle()
            self._call("cuMemGetAddressRange_v2", ctypes.byref(base), ctypes.byref(size),
                       ctypes.c_uint64(ptr))
            self._call("cuIpcGetMemHandle", ctypes.byref(handle), base)
            return bytes(handle), ptr - base.value, size.value
        finally:
            self._pop(dev)

    def open(self, handle: bytes, device: torch.device) -> int:
        dev = self._push(device)
        try:
            ptr = ctypes.c_uint64()
            self._call("cuIpcOpenMemHandle_v2", ctypes.byref(ptr),
                       _IpcHandle.from_buffer_copy(handle), _CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS)
            return ptr.value
        finally:
            self._pop(dev)

    def close(self, ptr: int, device: torch.device) -> None:
        dev = self._push(device)
        try:
            self._call("cuIpcCloseMemHandle", ctypes.c_uint64(ptr))
        finally:
            self._pop(dev)


@functools.cache
def _cuda() -> _Driver:
    return _Driver()


# CUDA allocations exported by this process, by handle: CUDA can't open a handle in the
# process that made it, so a receiver in the same process (tests) reads them directly.
# Pointers only: a CUDA storage kept alive here would be freed after CUDA shut down.
_own: dict[str, int] = {}  # handle -> the allocation's base address


def export(rows: torch.Tensor) -> dict[str, Any]:
    """A JSON-able description of `rows` (a view of a KV cache) that another process on
    this host maps with `SharedCaches.open`. On CPU the whole storage moves into shared
    memory first, in place (the views on it stay valid): do it before other threads
    use the cache."""
    storage = rows.untyped_storage()
    desc: dict[str, Any] = {
        "host": host_id(), "pid": os.getpid(), "dtype": dtype_name(rows.dtype),
        "shape": list(rows.shape), "stride": list(rows.stride()),
    }
    offset = rows.storage_offset() * rows.element_size()
    if rows.is_cuda:
        handle, start, size = _cuda().export(storage.data_ptr(), rows.device)
        _own[handle.hex()] = storage.data_ptr() - start
        desc.update(device="cuda", handle=handle.hex(), offset=start + offset, size=size)
    else:
        if not storage.is_shared():
            storage.share_memory_()
        fd, size = storage._share_fd_cpu_()
        desc.update(device="cpu", fd=fd, offset=offset, size=size)
    return desc


@dataclass(frozen=True)
class SharedEvent:
    """A CUDA event another process can wait on: `handle` opens it there."""

    event: torch.cuda.Event
    handle: str
    device: torch.device


# Events made here, by handle: CUDA can't open an event's handle in the process that made
# it either. Connectors reuse their events, so this stays as small as their pools.
_own_events: dict[str, torch.cuda.Event] = {}
_PRUNE_EVERY_S = 1.0  # how often open/release look for exporters that are gone


def shared_event(device: torch.device) -> SharedEvent:
    with torch.cuda.device(device):
        event = torch.cuda.Event(interprocess=True)
        handle = bytes(event.ipc_handle()).hex()
    _own_events[handle] = event
    return SharedEvent(event, handle, device)


def _open_event(handle: str, device: torch.device) -> torch.cuda.Event:
    own = _own_events.get(handle)
    if own is not None:
        return own
    try:
        return torch.cuda.Event.from_ipc_handle(device, bytes.fromhex(handle))
    except (RuntimeError, ValueError) as exc:
        raise TransferError(f"cannot open the sender's CUDA event: {exc}") from exc


@dataclass(eq=False)
class _Mapping:
    pid: int
    device: torch.device
    storage: torch.UntypedStorage
    ptr: int | None  # CUDA: the mapped address, unmapped with cuIpcCloseMemHandle
    users: int = 0
    views: dict[tuple, torch.Tensor] = field(default_factory=dict)  # built once each


class SharedCaches:
    """Peer caches mapped into this process: one mapping per exported cache, shared by
    the transfers that read it (`open` ... `release`). A mapping is unmapped once no
    transfer reads it and its exporter is gone (checked by open and release, at most
    once a second, and by `prune`), or on `close`. Thread-safe."""

    def __init__(self) -> None:
        self._maps: dict[tuple, _Mapping] = {}
        # Opened events, kept while their maker lives: senders reuse theirs, and opening
        # one costs more than a whole transfer's copy.
        self._events: dict[tuple[int, str, str], torch.cuda.Event] = {}
        self._pruned_at = -float("inf")
        self._lock = threading.Lock()

    def event(self, pid: int, handle: str, device: torch.device) -> torch.cuda.Event:
        """The event process `pid` made with `shared_event`, to wait on from `device`;
        raises TransferError if it can't be opened."""
        key = (pid, handle, str(device))
        with self._lock:
            event = self._events.get(key)
        if event is None:
            event = _open_event(handle, device)
            with self._lock:
                self._events[key] = event
        return event

    def open(self, desc: dict[str, Any], device: torch.device) -> torch.Tensor:
        """The peer's view `desc` (from `export`), readable by work on `device`."""
        try:
            pid, dtype = int(desc["pid"]), dtype_from_name(desc["dtype"])
            shape, stride = tuple(desc["shape"]), tuple(desc["stride"])
            offset, size, kind = int(desc["offset"]), int(desc["size"]), desc["device"]
            if desc["host"] != host_id():
                raise TransferError("the peer is on another host; ipc moves KV only "
                                    "between processes of one host (use tcp, ucx or nccl)")
            if kind != device.type:
                raise TransferError(f"the sender's cache is on {kind}, this one on {device}")
            key = (pid, desc.get("handle"), desc.get("fd"), size, str(device))
        except (KeyError, TypeError, ValueError) as exc:
            raise TransferError(f"bad ipc cache description: {exc!r}") from exc
        with self._lock:
            self._prune_locked(every_s=_PRUNE_EVERY_S)
            mapping = self._maps.get(key)
            if mapping is None:
                if not _alive(pid):
                    raise TransferError(f"the sender's process {pid} is gone")
                mapping = self._maps[key] = self._map(desc, pid, size, device)
            mapping.users += 1
            view = mapping.views.get((offset, shape, stride, dtype))
        if view is not None:
            return view
        try:
            view = torch.empty(0, dtype=dtype, device=device)
            view.set_(mapping.storage, offset // dtype.itemsize, shape, stride)
        except RuntimeError as exc:  # the view does not fit in what was mapped
            self.release(desc, device)
            raise TransferError(f"bad ipc cache description: {exc}") from exc
        with self._lock:
            mapping.views[(offset, shape, stride, dtype)] = view
        return view

    def release(self, desc: dict[str, Any], device: torch.device) -> None:
        """One transfer is done reading the view `open` returned for `desc`."""
        key = (int(desc["pid"]), desc.get("handle"), desc.get("fd"), int(desc["size"]),
               str(device))
        with self._lock:
            mapping = self._maps.get(key)
            if mapping is not None:
                mapping.users -= 1
            self._prune_locked(every_s=_PRUNE_EVERY_S)

    def close(self) -> None:
        with self._lock:
            maps, self._maps = list(self._maps.values()), {}
            self._events.clear()
        for mapping in maps:
            self._unmap(mapping)

    def __len__(self) -> int:
        with self._lock:
            return len(self._maps)

    def _map(self, desc: dict[str, Any], pid: int, size: int,
             device: torch.device) -> _Mapping:
        if device.type == "cuda":
            own = _own.get(desc["handle"]) if pid == os.getpid() else None
            ptr = own or _cuda().open(bytes.fromhex(desc["handle"]), device)
            # A storage over the mapped allocation that frees nothing (`_unmap` does).
            storage = torch._C._construct_storage_from_data_pointer(ptr, device, size)
            return _Mapping(pid, device, storage, None if own else ptr)
        try:
            fd = os.open(f"/proc/{pid}/fd/{int(desc['fd'])}", os.O_RDWR)
        except OSError as exc:
            raise TransferError(f"cannot map the sender's cache: {exc}") from exc
        try:  # torch maps a dup of fd
            storage = torch.UntypedStorage._new_shared_fd_cpu(fd, size)
        finally:
            os.close(fd)
        return _Mapping(pid, device, storage, None)

    def prune(self) -> None:
        """Unmap the caches nobody reads whose exporter is gone, now."""
        with self._lock:
            self._prune_locked()

    def _prune_locked(self, every_s: float = 0.0) -> None:
        """`prune`, holding `_lock`; skipped if it ran less than `every_s` ago (a check
        costs a syscall per mapping and event, on every transfer's critical path)."""
        now = time.monotonic()
        if now - self._pruned_at < every_s:
            return
        self._pruned_at = now
        for key, mapping in list(self._maps.items()):
            if mapping.users <= 0 and not _alive(mapping.pid):
                del self._maps[key]
                self._unmap(mapping)
        for key in [key for key in self._events if not _alive(key[0])]:
            del self._events[key]

    @staticmethod
    def _unmap(mapping: _Mapping) -> None:
        if mapping.ptr is not None:
            try:
                _cuda().close(mapping.ptr, mapping.device)
            except TransferError:
                pass  # the context is going away with the process


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

    def open(self, index: torch.Tensor) -> int:
        """Let the sink of blocks `index` be written: its new ticket, set when this returns."""
        ticket = next(self._next) % (2**31 - 1) + 1
        self._set(index, ticket)
        return ticket

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
                   count: int) -> Callable[[], None]:
        """Layers first .. first + count - 1 of blocks `ids[0]` of `src` (this side's cache
        as [2L, N, E]) into the sink's blocks `ids[1]`: the copy, checked and set up; each
        call enqueues it on the current stream."""
        assert self.rows is not None and self.tags is not None
        src_rows, dst_rows = src, self.rows
        if count != src.shape[0] // 2:  # a run of layers: views of those rows
            rows = slice(2 * first, 2 * (first + count))
            src_rows, dst_rows = src[rows], self.rows[rows]
        return plan_copy(src_rows, ids[0], dst_rows, ids[1], (self.tags, self.ticket))

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
