"""The tcp connector: plain sockets, one thread per incoming connection. The CPU default.

Every socket has a timeout (`io_timeout`), so nothing blocks forever: a peer that stalls
mid-frame is an error after `io_timeout`; an idle connection between frames may wait on
(a sender computing its next layer), and keepalive probes find a peer host that vanished
without closing. A killed peer process closes its sockets, which the receiver sees at
once as EOF or a reset.

The receiver bounds what peers can hold: at most `max_connections` connections at once
(one beyond is closed as it is accepted), and a connection that sent nothing for
`idle_timeout_s` while no transfer is in flight on it (`Receiver.keep_open_while`) is
closed, its thread ending with it. Senders drop a parked connection after half that, so
they don't reuse one the receiver is closing just then (`_quiet` catches one it closed).
"""

from __future__ import annotations

import itertools
import logging
import select
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import NoReturn

from tandem.kvtransfer.connector import (
    Allocator,
    Connector,
    ErrorHandler,
    Frame,
    FrameHandler,
    IdleConnections,
    Receiver,
    Sender,
    TransferError,
    stamp_peer,
)
from tandem.kvtransfer.wire import HostStaging, recv_frame, send_frame

log = logging.getLogger(__name__)

_SCHEME = "tcp://"


def parse_address(address: str) -> tuple[str, int]:
    if not address.startswith(_SCHEME):
        raise TransferError(f"not a tcp address: {address!r}")
    host, _, port = address[len(_SCHEME):].rpartition(":")
    return host.strip("[]"), int(port)


def _tune(sock: socket.socket, io_timeout: float) -> None:
    sock.settimeout(io_timeout)
    # Control frames (begin, end, replies) are tiny; don't let Nagle hold them back.
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for opt, value in (("TCP_KEEPIDLE", 10), ("TCP_KEEPINTVL", 5), ("TCP_KEEPCNT", 3)):
        if hasattr(socket, opt):  # Linux; elsewhere the OS defaults apply
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, opt), value)


class TcpConnector(Connector):
    name = "tcp"

    def __init__(
        self,
        io_timeout: float = 30.0,
        max_idle: int = 2,
        max_connections: int = 64,
        idle_timeout_s: float = 120.0,
    ) -> None:
        self.io_timeout = io_timeout
        self.max_connections, self.idle_timeout_s = max_connections, idle_timeout_s
        # Connections kept per address after a transfer ended cleanly (`Sender.release`),
        # so the next one skips connecting (and the receiver starting a thread for it).
        self._idle = IdleConnections(max_idle, _quiet, socket.socket.close,
                                     max_age_s=idle_timeout_s / 2)

    def receiver(
        self,
        host: str,
        alloc: Allocator,
        on_frame: FrameHandler,
        on_error: ErrorHandler,
        port: int = 0,
    ) -> TcpReceiver:
        return TcpReceiver(host, alloc, on_frame, on_error, self.io_timeout,
                           self.max_connections, self.idle_timeout_s, port)

    def sender(self, address: str, connect_timeout: float = 5.0) -> TcpSender:
        host, port = parse_address(address)
        sock = self._idle.take(address)
        if sock is None:
            try:
                sock = socket.create_connection((host, port), timeout=connect_timeout)
            except OSError as exc:  # refused, unreachable, or timed out
                raise TransferError(f"cannot connect to {address}: {exc}") from exc
            _tune(sock, self.io_timeout)
        return TcpSender(sock, address, self.io_timeout, self._idle.park)

    def close(self) -> None:
        """Close the idle connections kept for reuse."""
        self._idle.close()


def _quiet(sock: socket.socket) -> bool:
    """Nothing to read on an idle connection: one with bytes waiting was closed by the
    receiver or carries a late reply, and is not reused."""
    readable, _, _ = select.select([sock], [], [], 0)
    return not readable


@dataclass(eq=False)
class _Conn:
    sock: socket.socket
    # Replies come from any thread (an abort, the TTL reaper) while the connection's
    # own thread may be replying too; one writer at a time keeps frames whole.
    write_lock: threading.Lock = field(default_factory=threading.Lock)


class TcpReceiver(Receiver):
    def __init__(
        self,
        host: str,
        alloc: Allocator,
        on_frame: FrameHandler,
        on_error: ErrorHandler,
        io_timeout: float,
        max_connections: int = 64,
        idle_timeout_s: float = 120.0,
        port: int = 0,
    ) -> None:
        self._alloc, self._on_frame, self._on_error = alloc, on_frame, on_error
        # A connection's reads wake up at least this often, to notice it went idle.
        self._io_timeout = min(io_timeout, idle_timeout_s)
        self._max_connections, self._idle_timeout_s = max_connections, idle_timeout_s
        self._busy: Callable[[str], bool] = lambda peer: False
        self._listener = socket.create_server((host, port), backlog=128)
        # accept() wakes up this often to notice close(); shutdown() usually wakes it first.
        self._listener.settimeout(0.5)
        self._address = f"{_SCHEME}{host}:{self._listener.getsockname()[1]}"
        self._conns: dict[str, _Conn] = {}
        self._lock = threading.Lock()
        self._closed = False
        self._ids = itertools.count()
        self._acceptor = threading.Thread(target=self._accept_loop, name="tcp-accept", daemon=True)
        self._acceptor.start()

    @property
    def address(self) -> str:
        return self._address

    @property
    def connections(self) -> int:
        """Connections open now, each with its thread."""
        with self._lock:
            return len(self._conns)

    def keep_open_while(self, busy: Callable[[str], bool]) -> None:
        self._busy = busy

    def reply(self, peer: str, frame: Frame) -> None:
        with self._lock:
            conn = self._conns.get(peer)
        if conn is None:
            raise TransferError(f"peer {peer} is gone")
        try:
            with conn.write_lock:
                send_frame(conn.sock, frame, HostStaging())
        except OSError as exc:
            raise TransferError(f"reply to {peer} failed: {exc}") from exc

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            conns = list(self._conns.values())
        for s in [self._listener, *(c.sock for c in conns)]:
            try:
                s.shutdown(socket.SHUT_RDWR)  # wakes the thread blocked on it
            except OSError:
                pass
        self._acceptor.join(timeout=5)
        self._listener.close()

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                sock, (ip, port, *_) = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return  # listener shut down by close()
            peer = f"{ip}:{port}/{next(self._ids)}"
            with self._lock:
                if self._closed:
                    sock.close()
                    return
                full = len(self._conns) >= self._max_connections
                if not full:
                    self._conns[peer] = _Conn(sock)
            if full:  # every connection is a thread: a flood must not make thousands
                log.warning("refused connection %s: %d connections open already",
                            peer, self._max_connections)
                sock.close()
                continue
            _tune(sock, self._io_timeout)
            threading.Thread(
                target=self._serve, args=(peer, sock), name=f"tcp-recv-{peer}", daemon=True
            ).start()

    def _serve(self, peer: str, sock: socket.socket) -> None:
        staging = HostStaging()
        alloc = stamp_peer(self._alloc, peer)
        error: Exception
        try:
            while True:
                waiting = partial(self._may_wait, peer, time.monotonic())
                frame = recv_frame(sock, alloc, staging, waiting)
                if frame is None:
                    error = TransferError("peer closed the connection")
                    break
                self._on_frame(Frame(frame.header, frame.payload, peer))
        except TransferError as exc:
            error = exc
        except OSError as exc:
            error = TransferError(f"{type(exc).__name__}: {exc}")
        except Exception as exc:  # a handler bug: this connection can't go on, others can
            log.exception("frame handler failed on %s", peer)
            error = exc
        with self._lock:
            self._conns.pop(peer, None)
            closed = self._closed
        sock.close()
        if not closed:
            self._on_error(peer, error)

    def _may_wait(self, peer: str, since: float) -> bool:
        """Whether connection `peer`, quiet since `since`, may wait on for its next frame."""
        if self._closed:
            return False
        if time.monotonic() - since < self._idle_timeout_s or self._busy(peer):
            return True
        log.info("closing connection %s: idle for %gs", peer, self._idle_timeout_s)
        return False


class TcpSender(Sender):
    """One connection to a Receiver. Used by one thread at a time."""

    def __init__(
        self,
        sock: socket.socket,
        address: str,
        io_timeout: float,
        park: Callable[[str, socket.socket], None] | None = None,
    ) -> None:
        self._sock, self._address, self._io_timeout = sock, address, io_timeout
        self._staging = HostStaging()
        self._park = park
        self._broken = False  # a send or read failed: the stream may be mid-frame

    def send(self, frame: Frame, timeout: float | None = None) -> None:
        # The timeout bounds the whole send, so a receiver that stops reading is caught.
        self._sock.settimeout(timeout or self._io_timeout)
        try:
            send_frame(self._sock, frame, self._staging)
        except TimeoutError as exc:
            self._broken = True
            raise TransferError(f"send to {self._address} timed out") from exc
        except OSError as exc:
            self._broken = True
            raise TransferError(f"send to {self._address} failed: {exc}") from exc

    def poll(self, timeout: float = 0.0) -> Frame | None:
        try:
            readable, _, _ = select.select([self._sock], [], [], timeout)
            if not readable:
                return None
            self._sock.settimeout(self._io_timeout)
            frame = recv_frame(self._sock, _no_payloads, self._staging)
        except (OSError, TransferError) as exc:
            self._broken = True
            if isinstance(exc, TransferError):
                raise
            raise TransferError(f"connection to {self._address} lost: {exc}") from exc
        if frame is None:
            self._broken = True
            raise TransferError(f"receiver at {self._address} closed the connection")
        return frame

    def release(self) -> None:
        if self._park is None or self._broken or self._sock.fileno() < 0:
            self.close()
        else:
            self._park(self._address, self._sock)
            self._park = None

    def close(self) -> None:
        self._sock.close()


def _no_payloads(header: dict) -> NoReturn:
    raise TransferError("replies carry no payload")
