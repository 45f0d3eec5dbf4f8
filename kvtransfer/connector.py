"""The data-plane interface every KV connector implements (tcp, ucx, nccl, ipc).

A connector moves *frames*: a small typed header plus at most one contiguous tensor
payload. Control (reserve, ack, abort) is small and rides in headers; KV bytes ride in
payloads, one large payload per layer per transfer, never one per block. A header is one
of the transfer protocol's messages (`messages.py`: a dict whose `kind` names it), and
travels as that message's protobuf envelope, which only `messages` encodes and decodes.

Invariants every implementation keeps:
- frames from one Sender arrive at the Receiver in the order they were sent;
- Senders may share a connection (tcp keeps a few per receiver address, however many
  transfers are in flight): their frames interleave whole, each reply reaches the Sender
  that sent frames of the request id it names, and the Receiver's `peer` is the
  connection, so one peer may carry many requests' transfers at once;
- `Sender.send` returns only once the payload's memory may be reused by the caller;
  `Sender.send_async` may return before, with a `SendHandle` that says when (frames from
  both go out in call order);
- the Receiver checks a header's `dtype` and `shape` against the payload's byte count
  (`check_payload`) before anything is allocated, and ends the connection on a mismatch;
- the Receiver writes an incoming payload into the tensor that `alloc(header)` returns
  (so bytes land directly in a staging buffer on the right device), then calls
  `on_frame` with that tensor; the header `alloc` sees names the connection as `peer`
  (`stamp_peer`: the Receiver's id, whatever the sender wrote there), and an `alloc` that
  raises TransferError ends the connection; a CUDA payload may still be landing when
  `on_frame` runs: it is valid for work enqueued on the calling thread's current stream
  of its device (the connector made that stream wait for it), and for the host after a
  sync of that stream; a later header-only frame from the same peer is delivered only once every
  payload before it has landed;
- a peer that dies or stalls surfaces as `TransferError` on the sender and as
  `on_error(peer, exc)` on the receiver, never as a hang: every blocking call has a timeout;
- `on_error(peer, exc)` fires exactly once per connection that ends for any reason other
  than `Receiver.close()`, a clean close between frames included: a sender SIGKILLed
  between two frames looks exactly like one that closed, so only the caller, who knows
  whether a transfer was still open on that peer, can tell whether the end mattered;
- the Receiver stamps each delivered `Frame.peer` with the id `on_error` and `reply` use;
- the payload's dtype and shape travel in the header as `dtype` (a torch dtype name,
  "bfloat16") and `shape` (a list of ints); `Sender.send` adds them (`payload_header`),
  so callers never have to.

Back channel: a Receiver may `reply(peer, frame)` with small control frames (no payload)
that the peer's Sender reads with `poll`. The transfer agent uses it to accept or refuse
a transfer and to tell a sender it was aborted; a connector without one leaves the
defaults, which raise.
"""

from __future__ import annotations

import ctypes
import importlib
import math
import sys
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import torch

C = TypeVar("C")  # a connector's connection type

class TransferError(RuntimeError):
    """A transfer failed: peer unreachable or gone, timeout, abort, or layout mismatch."""


@dataclass(frozen=True)
class Frame:
    header: dict[str, Any]  # a transfer message (`messages`): kind, request_id, layer, ...
    payload: torch.Tensor | None = None
    # Set by the Receiver on delivery: the connection the frame came in on.
    peer: str | None = None


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    dtype = getattr(torch, str(name), None)
    if not isinstance(dtype, torch.dtype):
        raise TransferError(f"unknown dtype {name!r}")
    return dtype


def payload_header(frame: Frame) -> dict[str, Any]:
    """The header as it travels: the caller's keys plus the payload's dtype and shape."""
    if frame.payload is None:
        return frame.header
    return {
        **frame.header,
        "dtype": dtype_name(frame.payload.dtype),
        "shape": list(frame.payload.shape),
    }


# More dimensions than any payload we send ([k, 2, n, bs, H, D]) means a foreign header.
MAX_DIMS = 8
# The key under which a Receiver shows `alloc` the connection a payload came in on.
PEER = "peer"


def payload_spec(header: dict[str, Any]) -> tuple[torch.dtype, tuple[int, ...]]:
    """The (dtype, shape) a header announces for its payload; TransferError unless a known
    dtype and a short list of non-negative ints (it comes from the peer, unchecked)."""
    shape = header.get("shape")
    if not isinstance(shape, list) or len(shape) > MAX_DIMS or not all(
        type(n) is int and n >= 0 for n in shape
    ):
        raise TransferError(f"bad payload shape {shape!r}")
    return dtype_from_name(header.get("dtype")), tuple(shape)


def check_payload(header: dict[str, Any], payload_len: int) -> bool:
    """Whether a payload follows `header` (`payload_len` bytes of it); raises TransferError
    unless the header's dtype and shape account for exactly those bytes. Runs before
    anything is allocated for the payload. (A header-only frame may still announce a
    payload that travels elsewhere: nccl's control frames.)"""
    if not payload_len:
        return False
    dtype, shape = payload_spec(header)
    if math.prod(shape) * dtype.itemsize != payload_len:
        raise TransferError(f"{shape} {dtype} payload announced as {payload_len} bytes")
    return True


def stamp_peer(alloc: Allocator, peer: str) -> Allocator:
    """`alloc`, shown the connection `peer` a payload came in on (see `PEER`)."""
    return lambda header: alloc({**header, PEER: peer})


def poll_until(done: Callable[[], bool], deadline: float) -> bool:
    """Poll `done()` until it is True (True) or time.monotonic() passes `deadline` (False).
    Sleeps 5 us doubling to 20 us for the first 10 ms, so the end of a GPU operation of
    a few hundred microseconds is seen promptly, then up to 1 ms, so a long wait idles."""
    _fine_sleeps()
    start, pause = time.monotonic(), 5e-6
    while not done():
        now = time.monotonic()
        if now > deadline:
            return False
        time.sleep(pause)
        pause = min(pause * 2, 2e-5 if now - start < 0.01 else 1e-3)
    return True


_thread = threading.local()


def _fine_sleeps() -> None:
    """Let this thread's short sleeps be short: Linux rounds a sleep up by the thread's
    timer slack, 50 us by default, more than the sleeps `poll_until` starts with. Set to
    1 us once per thread; elsewhere, nothing."""
    if getattr(_thread, "fine", False):
        return
    _thread.fine = True
    if sys.platform == "linux":
        try:
            ctypes.CDLL(None).prctl(_PR_SET_TIMERSLACK, 1000, 0, 0, 0)
        except (OSError, AttributeError):
            pass


_PR_SET_TIMERSLACK = 29


class LinkPool(Generic[C]):
    """Senders' connections per address, each used by one sender at a time. At most
    `max_links` per address exist, in use or parked, so a burst of transfers queues for a
    connection instead of opening one each (an nccl connection is a communicator: 0.35 s
    to set up on two H200s, and GPU buffers). `take` hands out a parked connection still
    `usable` (its receiver did not go away nor leave bytes on it) and not parked longer
    than `max_age_s`, else opens one while fewer than `max_links` exist, else waits for
    one to come back, within its timeout. `give` parks a connection for the next sender;
    `drop` closes one (it failed) and frees its place. Once `close`d, a connection given
    back is closed and `take` fails. Thread-safe."""

    def __init__(self, max_links: int, usable: Callable[[C], bool],
                 close: Callable[[C], None], max_age_s: float = math.inf) -> None:
        if max_links < 1:
            raise ValueError(f"max_links must be at least 1, got {max_links}")
        self.max_links, self.max_age_s = max_links, max_age_s
        self._usable, self._close = usable, close
        self._idle: dict[str, list[tuple[C, float]]] = {}  # (conn, parked at), newest last
        self._count: dict[str, int] = {}  # connections per address, in use, parked or opening
        self._cond = threading.Condition()
        self._closed = False

    def take(self, address: str, timeout: float, connect: Callable[[], C]) -> C:
        """A connection to `address` for the caller alone; `connect()` opens one.
        TransferError if none came free within `timeout`."""
        deadline = time.monotonic() + timeout
        while True:
            with self._cond:
                while not self._closed and not self._idle.get(address) and self._full(address):
                    if not self._cond.wait(deadline - time.monotonic()):
                        raise TransferError(
                            f"all {self.max_links} connections to {address} stayed busy "
                            f"for {timeout:g}s")
                if self._closed:
                    raise TransferError(f"cannot connect to {address}: the connector is closed")
                idle = self._idle.get(address)
                if not idle:
                    self._count[address] = self._count.get(address, 0) + 1
                    break
                conn, parked_at = idle.pop()
            if time.monotonic() - parked_at < self.max_age_s and self._usable(conn):
                return conn
            self.drop(address, conn)
        try:
            return connect()
        except BaseException:
            self._forget(address)
            raise

    def give(self, address: str, conn: C) -> None:
        with self._cond:
            if not self._closed:
                self._idle.setdefault(address, []).append((conn, time.monotonic()))
                self._cond.notify()
                return
        self.drop(address, conn)

    def drop(self, address: str, conn: C) -> None:
        self._close(conn)
        self._forget(address)

    def close(self) -> None:
        """Close the parked connections (those in use are closed by their senders)."""
        with self._cond:
            self._closed = True
            idle = [c for conns in self._idle.values() for c, _ in conns]
            for address, conns in self._idle.items():
                self._count[address] -= len(conns)
            self._idle = {}
            self._cond.notify_all()  # waiting senders fail now
        for conn in idle:
            self._close(conn)

    def _full(self, address: str) -> bool:
        return self._count.get(address, 0) >= self.max_links

    def _forget(self, address: str) -> None:
        with self._cond:
            self._count[address] -= 1
            self._cond.notify()


# Given an incoming frame's header (which names the payload's shape and dtype), return
# the tensor its bytes are written into.
Allocator = Callable[[dict[str, Any]], torch.Tensor]
FrameHandler = Callable[[Frame], None]
ErrorHandler = Callable[[str, Exception], None]  # (peer id, error)


class Receiver(ABC):
    @property
    @abstractmethod
    def address(self) -> str:
        """What a Sender connects to, e.g. "tcp://127.0.0.1:5555"."""

    def reply(self, peer: str, frame: Frame) -> None:
        """Send a small control frame (header only) back to `peer`'s Sender; thread-safe.
        Raises TransferError if the peer is gone."""
        raise TransferError(f"{type(self).__name__} has no back channel")

    def keep_open_while(self, busy: Callable[[str], bool]) -> None:
        """A Receiver that closes idle connections keeps one open while `busy(peer)` (a
        transfer in flight on it). Default: this Receiver closes none for idleness."""
        return None

    @abstractmethod
    def close(self) -> None: ...


class SendHandle(ABC):
    """A frame on its way (`Sender.send_async`). Once `done()` is True or `wait` returned,
    the payload's memory may be reused. `wait` raises TransferError if the frame failed or
    was not out within `timeout`; the connection is then over."""

    @abstractmethod
    def done(self) -> bool: ...

    @abstractmethod
    def wait(self, timeout: float | None = None) -> None: ...


class Sent(SendHandle):
    """The handle of a frame that is already out."""

    def done(self) -> bool:
        return True

    def wait(self, timeout: float | None = None) -> None:
        return None


class Sender(ABC):
    @abstractmethod
    def send(self, frame: Frame, timeout: float | None = None) -> None: ...

    def send_async(self, frame: Frame, timeout: float | None = None) -> SendHandle:
        """Start sending `frame` and return without waiting for its payload to go out;
        the caller keeps the payload unchanged until the handle is done. The default
        sends synchronously."""
        self.send(frame, timeout)
        return Sent()

    def poll(self, timeout: float = 0.0) -> Frame | None:
        """The next frame the Receiver replied with, waiting up to `timeout` seconds;
        None if none came. Raises TransferError if the Receiver's side is gone."""
        raise TransferError(f"{type(self).__name__} has no back channel")

    def release(self) -> None:
        """This Sender's transfers ended cleanly (nothing owed either way): the connector
        may keep its connection for later Senders to the same address. Default: close."""
        self.close()

    @abstractmethod
    def close(self) -> None:
        """End this Sender; the receiver learns at once that its open transfers are over:
        its connection closes, or, one that other Senders share, carries an abort for each
        transfer this Sender began and saw no end of (done or abort)."""


class Connector(ABC):
    name: str
    # True (ipc): no KV travels in frames; the receiver reads the blocks from the
    # sender's cache itself (`export` on the sending side, `mapped` on the receiving one).
    direct: bool = False

    @abstractmethod
    def receiver(
        self,
        host: str,
        alloc: Allocator,
        on_frame: FrameHandler,
        on_error: ErrorHandler,
        port: int = 0,
    ) -> Receiver:
        """Start listening on `host`:`port` (0: a free port is chosen); frames go to
        `on_frame`."""

    @abstractmethod
    def sender(self, address: str, connect_timeout: float = 5.0) -> Sender:
        """Connect to a Receiver; raises TransferError within `connect_timeout` if it can't."""

    def close(self) -> None:
        """Release what the connector keeps across senders (e.g. reused connections).
        Most connectors keep nothing, so this is a no-op unless overridden."""
        return None


_CONNECTORS = {
    "tcp": "tandem.kvtransfer.tcp:TcpConnector",
    "ucx": "tandem.kvtransfer.ucx:UcxConnector",
    "nccl": "tandem.kvtransfer.nccl:NcclConnector",
    "ipc": "tandem.kvtransfer.ipc:IpcConnector",
}


def get_connector(name: str, **options: Any) -> Connector:
    """The connector called `name`, imported only when asked for."""
    if name not in _CONNECTORS:
        raise ValueError(f"unknown connector {name!r}; choose one of {sorted(_CONNECTORS)}")
    module, cls = _CONNECTORS[name].split(":")
    return getattr(importlib.import_module(module), cls)(**options)
