"""The ucx connector: frames as UCX tag messages through the `ucxx` package (shared
memory, TCP, RDMA, and CUDA IPC/copy where UCX has them).

A frame is one control message and, if it has a payload, one payload message, both on
the connection's endpoint, whose tag messages match in the order they were sent:

    control  wire.PREFIX (magic, version, header length, payload length) + the header
             as a serialized transfer message (`messages.encode`)
    payload  the tensor's raw bytes (uint8 view, so bf16 is exact), received directly
             into the tensor `alloc(header)` returned: host memory, or device memory
             where UCX has CUDA transports (else staged through a host copy); the
             header's dtype and shape are checked against the payload length first

Replies (the back channel) are control messages on the same endpoint the other way.

ucxx is asyncio-based and keeps one UCX context per process, whose completion notifier
binds to the event loop that initialised it, so the process gets one ucxx loop on its own
thread (`_UcxLoop`), and our synchronous Sender/Receiver submit coroutines to it. Caller
code (`alloc`, `on_frame`, `on_error`) never runs on that loop: each incoming connection
has its own thread, like the tcp connector's.

Timeouts: connecting is bounded by `connect_timeout`; a frame's messages and a reply by
`io_timeout` (or `send`'s timeout); an idle connection may wait between frames. A timed-out
endpoint is aborted (its pending requests cancelled, so no late write lands in a buffer we
gave up on) and its connection is over. A peer that dies is seen by UCX's endpoint error
handling (a reset on TCP, keepalive otherwise) and cancels the pending requests.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import queue
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

import numpy as np
import torch

from tandem.kvtransfer.connector import (
    Allocator,
    Connector,
    ErrorHandler,
    Frame,
    FrameHandler,
    Receiver,
    Sender,
    TransferError,
    check_payload,
    payload_header,
    payload_spec,
    stamp_peer,
)
from tandem.kvtransfer.messages import decode, encode
from tandem.kvtransfer.wire import MAGIC, PREFIX, VERSION, HostStaging

log = logging.getLogger(__name__)

_SCHEME = "ucx://"
# One control message holds the prefix and the header; headers are small control
# data (request id, layer, layout), so a fixed receive buffer of this size fits them all.
CONTROL_BYTES = 64 * 1024
# How often a connection thread idle between frames wakes up to notice close().
_IDLE_POLL_S = 0.5

T = TypeVar("T")


def parse_address(address: str) -> tuple[str, int]:
    if not address.startswith(_SCHEME):
        raise TransferError(f"not a ucx address: {address!r}")
    host, _, port = address[len(_SCHEME):].rpartition(":")
    return host.strip("[]"), int(port)


class _UcxLoop:
    """The process's one ucxx event loop, on a daemon thread."""

    def __init__(self) -> None:
        try:
            import ucxx  # imported lazily: an optional dependency
        except ImportError as exc:
            raise ImportError(
                "the ucx connector needs the ucxx package: pip install ucxx-cu12 "
                f"(or ucxx-cu13 for CUDA 13): {exc}"
            ) from exc
        self.ucxx = ucxx
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="ucx-loop",
                                        daemon=True)
        self._thread.start()
        self.submit(self._init()).result(timeout=60)
        self.cuda = any(t.startswith("cuda") for t in ucxx.get_active_transports())

    async def _init(self) -> None:
        # Python futures (a notifier thread) instead of the default polling wait, which
        # spins this loop at 100% CPU while any receive is pending, i.e. always.
        self.ucxx.init(progress_mode="thread", enable_python_future=True)

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run(self, coro: Coroutine[Any, Any, T], timeout: float, what: str) -> T:
        """Run `coro` on the loop and wait up to `timeout`; errors as TransferError. On a
        timeout the caller must abort the endpoint: only that cancels the UCX request."""
        future = self.submit(coro)
        try:
            return future.result(timeout)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise TransferError(f"{what} timed out after {timeout:g}s") from None
        except TransferError:
            raise
        except Exception as exc:  # UCX errors: reset, cancelled, truncated
            raise TransferError(f"{what} failed: {type(exc).__name__}: {exc}") from exc


# One per process, as ucxx's own context is (see the module docstring); made on first use.
_loop: _UcxLoop | None = None
_loop_lock = threading.Lock()


def _ucx_loop() -> _UcxLoop:
    global _loop
    with _loop_lock:
        if _loop is None:
            _loop = _UcxLoop()
        return _loop


# -- message encoding ------------------------------------------------------------------


def _control_message(frame: Frame, payload_len: int) -> np.ndarray:
    header = encode(payload_header(frame))
    msg = PREFIX.pack(MAGIC, VERSION, len(header), payload_len) + header
    if len(msg) > CONTROL_BYTES:
        raise TransferError(f"frame header of {len(header)} bytes is too large")
    return np.frombuffer(msg, dtype=np.uint8)


def _parse_control(buf: np.ndarray) -> tuple[dict[str, Any], int]:
    magic, version, header_len, payload_len = PREFIX.unpack_from(buf)
    if magic != MAGIC or version != VERSION:
        raise TransferError(f"not a Tandem KV frame (magic {magic!r}, version {version})")
    if PREFIX.size + header_len > buf.nbytes:
        raise TransferError(f"frame header of {header_len} bytes is too large")
    return decode(buf[PREFIX.size:PREFIX.size + header_len].tobytes()), payload_len


def _buffer(
    t: torch.Tensor, cuda_ok: bool, staging: HostStaging
) -> tuple[Any, torch.Tensor | None]:
    """What UCX reads from or writes into for tensor `t`'s bytes: a numpy view of host
    memory, the CUDA tensor itself (__cuda_array_interface__) where UCX has CUDA
    transports, else the staging buffer, returned second so the caller copies through it."""
    raw = t.reshape(-1).view(torch.uint8)
    if raw.device.type == "cpu":
        return raw.numpy(), None
    if cuda_ok:
        return raw, None
    host = staging.get(raw.numel())
    return host.numpy(), host


# -- the connector ---------------------------------------------------------------------


class UcxConnector(Connector):
    name = "ucx"

    def __init__(self, io_timeout: float = 30.0) -> None:
        self.io_timeout = io_timeout
        self._loop = _ucx_loop()

    def receiver(
        self,
        host: str,
        alloc: Allocator,
        on_frame: FrameHandler,
        on_error: ErrorHandler,
        port: int = 0,
    ) -> UcxReceiver:
        return UcxReceiver(self._loop, host, alloc, on_frame, on_error, self.io_timeout, port)

    def sender(self, address: str, connect_timeout: float = 5.0) -> UcxSender:
        host, port = parse_address(address)
        create = self._loop.ucxx.create_endpoint(host, port, connect_timeout=connect_timeout)
        ep = self._loop.run(create, connect_timeout, f"connecting to {address}")
        return UcxSender(self._loop, ep, address, self.io_timeout)


class _Conn:
    def __init__(self, ep: Any) -> None:
        self.ep = ep
        self.thread: threading.Thread | None = None


class UcxReceiver(Receiver):
    def __init__(
        self,
        ucx: _UcxLoop,
        host: str,
        alloc: Allocator,
        on_frame: FrameHandler,
        on_error: ErrorHandler,
        io_timeout: float,
        port: int = 0,
    ) -> None:
        self._ucx = ucx
        self._alloc, self._on_frame, self._on_error = alloc, on_frame, on_error
        self._io_timeout = io_timeout
        self._conns: dict[str, _Conn] = {}
        self._lock = threading.Lock()
        self._closed = False
        self._ids = itertools.count()
        # ucxx's listener takes a port only and listens on every interface; `host` is what
        # senders are told to reach. Said once, so an operator can fence the port.
        self._listener = ucx.run(self._listen(port), 10, "starting a ucx listener")
        if host not in ("0.0.0.0", "::", ""):
            log.warning("the ucx transfer port %d listens on every interface, not only %s "
                        "(ucxx cannot bind one address): fence it with a firewall or a "
                        "NetworkPolicy, or use --connector tcp", self._listener.port, host)
        self._address = f"{_SCHEME}{host}:{self._listener.port}"

    async def _listen(self, port: int) -> Any:
        return self._ucx.ucxx.create_listener(self._accept, port=port)

    @property
    def address(self) -> str:
        return self._address

    def reply(self, peer: str, frame: Frame) -> None:
        with self._lock:
            conn = self._conns.get(peer)
        if conn is None:
            raise TransferError(f"peer {peer} is gone")
        # One message per control frame: concurrent replies can't interleave mid-frame.
        msg = _control_message(frame, 0)
        self._ucx.run(conn.ep.send(msg), self._io_timeout, f"reply to {peer}")

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            conns = list(self._conns.values())
        self._ucx.run(self._shut(conns), 10, "closing the ucx receiver")
        for conn in conns:
            if conn.thread is not None and conn.thread is not threading.current_thread():
                conn.thread.join(timeout=5)

    async def _shut(self, conns: list[_Conn]) -> None:
        self._listener.close()
        for conn in conns:
            conn.ep.abort()  # cancels the pending receive its thread waits on

    async def _accept(self, ep: Any) -> None:
        # On the ucx loop: register and hand the connection to a thread of its own.
        peer = f"ucx/{next(self._ids)}"
        conn = _Conn(ep)
        with self._lock:
            if self._closed:
                ep.abort()
                return
            self._conns[peer] = conn
        conn.thread = threading.Thread(target=self._serve, args=(peer, conn),
                                       name=f"ucx-recv-{peer}", daemon=True)
        conn.thread.start()

    def _serve(self, peer: str, conn: _Conn) -> None:
        control = np.empty(CONTROL_BYTES, dtype=np.uint8)
        staging = HostStaging()
        alloc = stamp_peer(self._alloc, peer)
        error: Exception
        try:
            while True:
                frame = self._recv_frame(conn.ep, control, alloc, staging)
                self._on_frame(Frame(frame.header, frame.payload, peer))
        except TransferError as exc:
            error = exc
        except Exception as exc:  # a handler bug: this connection can't go on, others can
            log.exception("frame handler failed on %s", peer)
            error = exc
        with self._lock:
            self._conns.pop(peer, None)
            closed = self._closed
        if not closed:
            self._ucx.submit(_abort(conn.ep))
            self._on_error(peer, error)

    def _recv_frame(
        self, ep: Any, control: np.ndarray, alloc: Allocator, staging: HostStaging
    ) -> Frame:
        # Idle between frames: wait as long as it takes, waking to notice close().
        pending = self._ucx.submit(ep.recv(control))
        while True:
            try:
                pending.result(_IDLE_POLL_S)
                break
            except concurrent.futures.TimeoutError:
                if self._closed:
                    raise TransferError("receiver closed") from None
            except Exception as exc:  # cancelled or reset: the peer closed or died
                raise TransferError(f"connection lost: {type(exc).__name__}: {exc}") from exc
        header, payload_len = _parse_control(control)
        if not check_payload(header, payload_len):  # before anything is allocated
            return Frame(header)
        dtype, shape = payload_spec(header)
        out = alloc(header)
        if out.dtype != dtype or tuple(out.shape) != shape or not out.is_contiguous():
            raise TransferError(
                f"allocator gave {tuple(out.shape)} {out.dtype} for a {shape} {dtype} payload"
            )
        if payload_len:
            buf, host = _buffer(out, self._ucx.cuda, staging)
            self._ucx.run(ep.recv(buf), self._io_timeout, "receiving a payload")
            if host is not None:
                out.reshape(-1).view(torch.uint8).copy_(host)
        return Frame(header, out)


async def _abort(ep: Any) -> None:
    ep.abort()


class UcxSender(Sender):
    """One endpoint to a Receiver. Used by one thread at a time."""

    def __init__(self, ucx: _UcxLoop, ep: Any, address: str, io_timeout: float) -> None:
        self._ucx, self._ep, self._address, self._io_timeout = ucx, ep, address, io_timeout
        self._replies: queue.SimpleQueue[Frame | TransferError] = queue.SimpleQueue()
        self._staging = HostStaging()  # CUDA payloads, where UCX has no CUDA transports
        self._closed = False
        self._reader = ucx.submit(self._read_replies())

    def send(self, frame: Frame, timeout: float | None = None) -> None:
        if self._closed:
            raise TransferError(f"connection to {self._address} is closed")
        payload = frame.payload
        if payload is not None and not payload.is_contiguous():
            payload = payload.contiguous()
        nbytes = 0 if payload is None else payload.numel() * payload.element_size()
        msg = _control_message(frame, nbytes)
        buf = None
        if payload is not None and nbytes:
            buf, host = _buffer(payload, self._ucx.cuda, self._staging)
            if host is not None:
                host.copy_(payload.reshape(-1).view(torch.uint8))
            elif payload.device.type == "cuda":
                # UCX reads device memory outside torch's streams: let pending writes land.
                torch.cuda.current_stream(payload.device).synchronize()
        try:
            self._ucx.run(self._send(msg, buf), timeout or self._io_timeout,
                          f"send to {self._address}")
        except TransferError:
            self.close()  # a half-sent frame leaves the stream out of step
            raise

    async def _send(self, msg: np.ndarray, buf: Any) -> None:
        await self._ep.send(msg)
        if buf is not None:
            await self._ep.send(buf)

    def poll(self, timeout: float = 0.0) -> Frame | None:
        try:
            item = self._replies.get(timeout=timeout) if timeout > 0 else self._replies.get_nowait()
        except queue.Empty:
            return None
        if isinstance(item, TransferError):
            self._replies.put(item)  # every later poll sees it too
            raise item
        return item

    async def _read_replies(self) -> None:
        control = np.empty(CONTROL_BYTES, dtype=np.uint8)
        while True:
            try:
                await self._ep.recv(control)
                header, payload_len = _parse_control(control)
                if payload_len:
                    raise TransferError("replies carry no payload")
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                why = exc if isinstance(exc, TransferError) else f"{type(exc).__name__}: {exc}"
                self._replies.put(TransferError(f"receiver at {self._address} is gone: {why}"))
                return
            self._replies.put(Frame(header))

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._reader.cancel()
        try:
            self._ucx.run(self._ep.close(), 5, f"closing the connection to {self._address}")
        except TransferError as exc:
            log.debug("%s", exc)
