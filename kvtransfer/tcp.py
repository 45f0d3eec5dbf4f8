"""The tcp connector: plain sockets, the CPU default. Senders to one receiver share a few
long-lived connections, so many transfers in flight are never many connections.

Sharing. Per receiver address a connector keeps at most `max_links` connections (links)
and puts each new Sender on the least busy one, opening another only while every open one
carries a Sender (`tcp_links.Links`). Transfers on a link interleave frame by frame: a Sender writes
a whole frame under the link's write lock, so one Sender's frames keep their order and
never mix bytes with another's; a Sender waits for the lock within its send timeout. One
reader thread per link hands each reply to the Sender that sent frames of its request id
(`TcpSender.poll`); a reply about no such request goes to the link's only Sender if it has
exactly one (a handshake of its own, nccl's hello), else nowhere (a late abort of a
transfer that ended). The receiver names the link as one `peer` carrying many transfers.

A Sender's end never ends its link: `close` (and `release`, the same here) first sends an
`abort`, signed with its begin's `auth`, for each transfer it began and saw no end of
(done or abort, either way), so the receiver frees those sinks at once, as it did when a
transfer closed a connection of its own. A link fails as a whole, and then every Sender on
it raises TransferError: a write that times out or breaks (the stream may be mid-frame), a
read error or a stall mid-frame, the receiver closing it. A link no Sender uses is kept
(at most `max_idle` per address) for at most `idle_timeout_s / 2`, so it is not handed out
just as the receiver closes it for idleness, and never while it has bytes to read (the
receiver closed it). `max_idle=0`: no link is shared or kept; each Sender gets a
connection of its own, closed with it, and every frame on it (nccl's control channel,
whose receiver keeps state per connection).

Every socket has a timeout (`io_timeout`), so nothing blocks forever: a peer that stalls
mid-frame is an error after `io_timeout`; an idle connection between frames may wait on
(a sender computing its next layer), and keepalive probes find a peer host that vanished
without closing. A killed peer process closes its sockets, which the other side sees at
once as EOF or a reset.

The receiver bounds what peers can hold: at most `max_connections` connections at once
(one beyond is closed as it is accepted; a sending process opens at most `max_links`), and
a connection that sent nothing for `idle_timeout_s` while no transfer is in flight on it
(`Receiver.keep_open_while`) is closed, its thread ending with it.

Why not pyzmq (which the design names): measured side by side, sender and receiver in two
processes over loopback with the real envelopes, the best of 15-30 transfers of
begin/accept, 30 layer frames and end/done, in ms ("+copy": the bytes land in `alloc`'s
tensor, as the Receiver contract asks; "no copy": ZeroMQ's own buffer is handed over):

                          2-core dev machine      16-core H100 host, 3 runs
    layer size            sockets  pyzmq+copy     sockets    pyzmq+copy  pyzmq, no copy
    256 KiB                  4.3      6.6         2.4-4.3    2.1-3.2     2.4-3.2
    1 MiB                   13.3     17.9         7.1-7.2    6.6-6.8     5.3-6.3
    4 MiB                   46.0     62.7         26.8-29.8  26.3-29.9   27.9-29.9
    control round trip      87 us    97 us        80-88 us   139-152 us
    small frames, one way   46 k/s   118 k/s      46-58 k/s  54-81 k/s

Bulk bytes are a tie on the big host and faster on sockets on the small one; the round
trips every transfer waits on (begin -> accept, end -> done) are faster on sockets on
both; only a one-way stream of tiny frames is faster on pyzmq, which batches writes.
ZeroMQ also takes in a whole message before its header can be read, so nothing could be
checked (`check_payload`, the sink's shape) before the bytes are allocated, nor land in
`alloc`'s buffer without the copy; and it shows a connection's end (`on_error`) only
through a socket monitor. So these are plain sockets, multiplexed.
"""

from __future__ import annotations

import itertools
import logging
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

from tandem.kvtransfer.connector import (
    Allocator,
    Connector,
    ErrorHandler,
    Frame,
    FrameHandler,
    Receiver,
    TransferError,
    stamp_peer,
)
from tandem.kvtransfer.tcp_links import Link, Links, TcpSender
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
        max_links: int = 4,
    ) -> None:
        """`max_links`: connections per receiver address that Senders share; `max_idle`:
        how many of them stay open with no Sender (0: none is shared, see the module)."""
        if max_links < 1 or max_idle < 0:
            raise ValueError(f"need max_links >= 1, max_idle >= 0: {max_links}, {max_idle}")
        self.io_timeout = io_timeout
        self.max_connections, self.idle_timeout_s = max_connections, idle_timeout_s
        self._links = Links(self._connect, max_links, max_idle, idle_timeout_s / 2)

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
        parse_address(address)
        link = self._links.join(address, connect_timeout)
        return TcpSender(link, self._links.leave, self.io_timeout)

    def close(self) -> None:
        """Close the links no Sender uses; the others close as their last Sender leaves."""
        self._links.close()

    def _connect(self, address: str, timeout: float) -> Link:
        host, port = parse_address(address)
        try:
            sock = socket.create_connection((host, port), timeout=timeout)
        except OSError as exc:  # refused, unreachable, or timed out
            raise TransferError(f"cannot connect to {address}: {exc}") from exc
        _tune(sock, self.io_timeout)
        return Link(sock, address, self.io_timeout, shared=self._links.shared)


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
