"""Another process's memory, mapped into this one, on one host: what the ipc connector
(`kvtransfer/ipc.py`) writes through.

- `export(rows)` describes a tensor (a view of a KV cache) so that another process can
  map it: on CUDA a CUDA IPC memory handle, mapped with the driver API into the context
  of the GPU that will write it (torch's own rebuild maps it into the exporting GPU's
  context, where a kernel on another GPU can't reach it); on CPU the storage moves into
  shared memory, mapped through `/proc/<pid>/fd`.
- `SharedCaches` holds the mappings of one process, one per exported allocation, shared
  by the transfers that use it, and unmaps one once its exporter is gone.
- `shared_event` / `SharedCaches.event`: CUDA events one process records and another
  waits on.

Both processes must be on one host (checked: the kernel's boot id) and in one PID
namespace.
"""

from __future__ import annotations

import ctypes
import functools
import os
import socket
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from tandem.kvtransfer.connector import TransferError, dtype_from_name, dtype_name


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
    """A plain description of `rows` (a view of a KV cache) that another process on
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
