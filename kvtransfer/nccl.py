"""The nccl connector: payloads over a two-rank torch.distributed process group per
connection (NCCL between GPUs; gloo, the same code on CPU, which is what CI runs), headers
and replies over the tcp connector's control connection. This module has the connector
and the receiving side; the sending side is `nccl_sender.py`.

NCCL and gloo can only `recv` into a posted buffer of the right size, so every frame's
header, which names the payload's dtype and shape, goes first over TCP; the receiver
allocates (`alloc(header)`) and posts the matching `recv`. Per connection:

    sender -> nccl_hello {backend, proof}      over tcp, before any caller frame; with a
                                               cluster secret, the proof must hold
                                               (`auth.HelloCheck`) or nothing is set up
    sender <- nccl_welcome {store_port, pair}  the receiver hosts one TCPStore for all pairs
    both build a 2-rank group under PrefixStore(pair): receiver rank 0, sender rank 1
    nccl only: one byte rank 1 -> 0, so the communicator exists before the first layer
    per frame: header (with dtype, shape) over tcp, then the payload's bytes over the group

Every connection gets its own group, so a receiver takes any number of independent
senders over time, and no process needs a global world (`init_process_group` is never
called). Payloads travel as their raw bytes (uint8 view), so bf16 and every other dtype
arrive bit-exact. A payload on the wrong side of the transport (CUDA under gloo, CPU under
nccl, or the agent's CPU scratch for bytes it will drop) crosses through a temporary.

Pipelining (nccl). `send_async` writes the header and enqueues the payload's send on the
group's stream, which waits for the caller's current stream (so a gather just enqueued
is what goes out), and returns a handle: no host sync per frame. The receiver posts each
recv as its header arrives, with the connection's own stream current, and makes that
stream wait for it; `on_frame` runs with that stream current and gets a tensor still
landing: work ordered after that stream (the agent's scatter, on its own stream) sees the
bytes. The recv waits only for that stream, so a buffer's reuse is ordered by whoever
hands it out (`alloc` makes the stream wait for the buffer's last reader), and nothing on
the engine's streams holds a receive back. At most MAX_IN_FLIGHT recvs stay
unconfirmed per connection, and a header-only frame is delivered only once all before it
landed. gloo keeps both sides synchronous behind the same calls.

Timeouts. gloo: `Work.wait(timeout)`; a timed-out group is dead and so is its connection.
nccl: operations run asynchronously on the group's stream, so we poll
`Work.is_completed()` to a deadline and on expiry abort that group's communicator
(ncclCommAbort), which frees the stream; the connection ends, the process lives on. The
group's own watchdog timeout is set well past ours, so its handler (which by default tears
the whole process down) never fires first. Communicator setup (the first operation, run by
the handshake) is bounded by `setup_timeout` through the store; NCCL's own bootstrap after
that has no timeout of ours.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from tandem.kvtransfer.auth import HelloCheck, hello_fields
from tandem.kvtransfer.connector import (
    Allocator,
    Connector,
    ErrorHandler,
    Frame,
    FrameHandler,
    LinkPool,
    Receiver,
    TransferError,
    payload_spec,
    stamp_peer,
)
from tandem.kvtransfer.messages import ABORT, NCCL_HELLO, NCCL_WELCOME
from tandem.kvtransfer.nccl_group import RECEIVER_RANK, SENDER_RANK, PairGroup
from tandem.kvtransfer.nccl_sender import NcclLink, NcclSender
from tandem.kvtransfer.tcp import TcpConnector, TcpReceiver
from tandem.kvtransfer.tcp_links import TcpSender

log = logging.getLogger(__name__)

_SCHEME = "nccl://"
HELLO, WELCOME = NCCL_HELLO, NCCL_WELCOME  # control kinds private to this connector
BACKENDS = ("nccl", "gloo")


def _tcp_address(address: str) -> str:
    if not address.startswith(_SCHEME):
        raise TransferError(f"not an nccl address: {address!r}")
    return "tcp://" + address[len(_SCHEME):]


def _host_of(address: str) -> str:
    return address[len(_SCHEME):].rpartition(":")[0].strip("[]")


def _source_ip(host: str) -> str:
    """The local address this host's traffic to `host` leaves from (no packet is sent)."""
    family = socket.getaddrinfo(host, None)[0][0]
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect((host, 9))
        return s.getsockname()[0]


class NcclConnector(Connector):
    name = "nccl"

    def __init__(
        self,
        backend: str = "nccl",
        device: str | torch.device | None = None,
        io_timeout: float = 30.0,
        setup_timeout: float = 30.0,
        max_links: int = 1,
        secret: bytes | None = None,
    ) -> None:
        """`secret`: the cluster secret; a receiver then sets up a connection (its process
        group) only for a hello that proves it (`kvtransfer/auth.py`), and senders prove
        it in theirs."""
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        if backend == "nccl" and not dist.is_nccl_available():
            raise TransferError("this torch build has no NCCL; use backend='gloo' on CPU")
        self.backend = backend
        if backend == "gloo":
            self.device = torch.device("cpu")
        else:
            self.device = torch.device(device if device is not None else "cuda")
            if self.device.index is None:
                self.device = torch.device("cuda", torch.cuda.current_device())
        self.io_timeout, self.setup_timeout = io_timeout, setup_timeout
        self.secret = secret
        self._tcp = TcpConnector(io_timeout, max_idle=0)  # NcclLink keeps the whole link
        self._links = LinkPool(max_links, NcclLink.drain, NcclLink.close)  # see `sender`

    def receiver(
        self,
        host: str,
        alloc: Allocator,
        on_frame: FrameHandler,
        on_error: ErrorHandler,
        port: int = 0,
    ) -> NcclReceiver:
        return NcclReceiver(self, host, alloc, on_frame, on_error, port)

    def group(self, store: dist.Store, rank: int, hostname: str) -> PairGroup:
        return PairGroup(
            self.backend, self.device, store, rank, hostname, self.setup_timeout, self.io_timeout
        )

    def sender(self, address: str, connect_timeout: float = 5.0) -> NcclSender:
        """A sender on a connection of its own until it closes. A connection costs a
        rendezvous and, under NCCL, a communicator (0.35 s to set up on two H200s, and GPU
        buffers), while KVPush opens a sender per request; so at most `max_links`
        connections per address exist (one by default: NCCL kernels of several
        communicators between the same two GPUs can wait on each other, and each posted
        receive spins on the decode GPU's SMs), a sender closed cleanly (at a frame boundary,
        every send done) parks its connection for the next, and a burst of senders waits
        (up to `io_timeout`) for one of those rather than opening more."""
        link = self._links.take(address, self.io_timeout,
                                lambda: self._connect(address, connect_timeout))
        return NcclSender(self, link, address)

    def give_back(self, address: str, link: NcclLink, reusable: bool) -> None:
        """A sender is done with `link`: parked for the next sender, or closed."""
        if reusable:
            self._links.give(address, link)
        else:
            self._links.drop(address, link)

    def close(self) -> None:
        """Close the idle connections this connector keeps for reuse."""
        self._links.close()

    def _connect(self, address: str, connect_timeout: float) -> NcclLink:
        try:
            control = self._tcp.sender(_tcp_address(address), connect_timeout)
        except TransferError as exc:
            raise TransferError(f"cannot connect to {address}: {exc.__cause__ or exc}") from exc
        try:
            control.send(Frame({"kind": HELLO, "backend": self.backend,
                                **hello_fields(self.secret)}), connect_timeout)
            welcome = _await_welcome(control, address, connect_timeout)
            host = _host_of(address)
            store = dist.TCPStore(
                host, int(welcome["store_port"]), is_master=False,
                timeout=timedelta(seconds=self.setup_timeout), wait_for_workers=False,
            )
            group = self.group(
                dist.PrefixStore(welcome["pair"], store), SENDER_RANK, _source_ip(host)
            )
        except BaseException as exc:
            control.close()
            if isinstance(exc, TransferError) or not isinstance(exc, Exception):
                raise
            raise TransferError(f"cannot set up a process group with {address}: {exc}") from exc
        return NcclLink(control, group)


def _await_welcome(control: TcpSender, address: str, timeout: float) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while (left := deadline - time.monotonic()) > 0:
        frame = control.poll(left)
        if frame is None:
            continue
        if frame.header.get("kind") == WELCOME:
            return frame.header
        raise TransferError(f"{address} refused the connection: {frame.header}")
    raise TransferError(f"no handshake from {address} in {timeout:g}s")


class NcclReceiver(Receiver):
    def __init__(
        self,
        conn: NcclConnector,
        host: str,
        alloc: Allocator,
        on_frame: FrameHandler,
        on_error: ErrorHandler,
        port: int = 0,
    ) -> None:
        """`port`: the control channel's (0: a free one); the store then takes the next."""
        self._conn = conn
        self._alloc, self._on_frame, self._on_error = alloc, on_frame, on_error
        self._host = host
        # A TCPStore given no socket listens on every interface: bind its socket to
        # `host` ourselves, so the store is reachable only where this receiver is.
        # The store owns the socket from here (it closes it): detached, so Python won't.
        listening = socket.create_server((host, port + 1 if port else 0), backlog=128)
        self._store = dist.TCPStore(
            host, listening.getsockname()[1], is_master=True, wait_for_workers=False,
            timeout=timedelta(seconds=conn.setup_timeout), master_listen_fd=listening.detach(),
        )
        self._groups: dict[str, PairGroup] = {}
        self._hello_ok = HelloCheck(conn.secret)
        # Per connection: a receive posted for an announced payload (header, tensor, work);
        # only that connection's thread touches its entry.
        self._ahead: dict[str, tuple[dict[str, Any], torch.Tensor, Any]] = {}
        self._lock = threading.Lock()
        self._closed = False
        self._tcp: TcpReceiver = conn._tcp.receiver(
            host, _no_control_payloads, self._on_control, self._on_lost, port
        )
        self._address = _SCHEME + self._tcp.address.removeprefix("tcp://")

    @property
    def address(self) -> str:
        return self._address

    def reply(self, peer: str, frame: Frame) -> None:
        self._tcp.reply(peer, frame)

    def close(self) -> None:
        # tcp first: a connection ended by close() must not reach on_error; then abort
        # the groups, which unblocks any connection thread waiting in a recv.
        with self._lock:
            self._closed = True
        self._tcp.close()
        with self._lock:
            groups, self._groups = list(self._groups.values()), {}
        for group in groups:
            group.abort()

    # -- connection threads (the tcp receiver's) -------------------------------------

    def _on_control(self, frame: Frame) -> None:
        peer = frame.peer or ""
        if frame.header.get("kind") == HELLO:
            self._welcome(peer, frame.header)
            return
        with self._lock:
            group = self._groups.get(peer)
        if "shape" not in frame.header:  # header-only frame: nothing follows
            if group is not None:
                group.settle(self._conn.io_timeout)  # every payload before it landed
            self._on_frame(frame)
            # After the handler (a begin opens what it announces):
            if "next" in frame.header and group is not None:
                self._post_ahead(peer, group, frame.header["next"])
        elif group is None:
            raise TransferError(f"{peer} sent a payload before its handshake")
        else:
            with group.receiving():
                out = self._landing(peer, group, frame.header)  # `out` may still be landing
                if "next" in frame.header:  # before the handler: the link is busy meanwhile
                    self._post_ahead(peer, group, frame.header["next"])
                self._on_frame(Frame(frame.header, out, peer))

    def _landing(self, peer: str, group: PairGroup, header: dict[str, Any]) -> torch.Tensor:
        """The tensor this payload lands in: the receive posted ahead for it, or a new one.
        The current stream is made to wait for it."""
        ahead = self._ahead.pop(peer, None)
        if ahead is None:
            out = self._alloc_checked(peer, header)
            group.start_recv(out, self._conn.io_timeout)
            return out
        announced, out, work = ahead
        if announced != {k: v for k, v in header.items() if k != "next"}:
            # The posted receive took this payload's bytes (NCCL matches in order), so
            # they can't be trusted: the connection is over.
            raise TransferError(f"{peer} sent {header} after announcing {announced}")
        group.landed(work, self._conn.io_timeout)
        return out

    def _post_ahead(self, peer: str, group: PairGroup, header: dict[str, Any]) -> None:
        """Post the receive of an announced payload now, so its bytes can flow as soon as
        they are sent (nccl, into device memory only; otherwise it is posted on arrival)."""
        if group.backend != "nccl":
            return
        with group.receiving():
            out = self._alloc_checked(peer, header)
            if out.device != self._conn.device:
                return  # bytes the allocator would drop: they take the slow path on arrival
            self._ahead[peer] = (header, out, group.post_recv(out))

    def _alloc_checked(self, peer: str, header: dict[str, Any]) -> torch.Tensor:
        dtype, shape = payload_spec(header)
        out = stamp_peer(self._alloc, peer)(header)  # the agent allocates for its own peer
        if out.dtype != dtype or tuple(out.shape) != shape or not out.is_contiguous():
            raise TransferError(
                f"allocator gave {tuple(out.shape)} {out.dtype} for a {shape} {dtype} payload"
            )
        return out

    def _welcome(self, peer: str, header: dict[str, Any]) -> None:
        backend = header.get("backend")
        why = None
        if not self._hello_ok(header):
            why = "hello without a valid proof of the cluster secret"
        elif backend != self._conn.backend:
            why = f"backend {backend!r} here is {self._conn.backend!r}"
        if why is not None:
            # No transfer is open yet: the refusal names the handshake as its request.
            self.reply(peer, Frame({"kind": ABORT, "request_id": HELLO, "reason": why}))
            raise TransferError(why)
        pair = f"tandem-kv/{peer}/"
        self.reply(peer, Frame({"kind": WELCOME, "store_port": self._store.port, "pair": pair}))
        hostname = "" if self._host in ("", "0.0.0.0", "::") else self._host
        group = self._conn.group(dist.PrefixStore(pair, self._store), RECEIVER_RANK, hostname)
        with self._lock:
            if self._closed:
                group.abort()
                raise TransferError("receiver closed")
            self._groups[peer] = group

    def _on_lost(self, peer: str, exc: Exception) -> None:
        self._ahead.pop(peer, None)  # its receive ends with the group's abort below
        with self._lock:
            group = self._groups.pop(peer, None)
        # Abort first: a recv the dead peer never fed would hold back the stream, and
        # on_error's handler may wait for work queued behind it (the agent's scatters).
        if group is not None:
            group.abort()
        self._on_error(peer, exc)


def _no_control_payloads(header: dict[str, Any]) -> torch.Tensor:
    raise TransferError("payloads travel over the process group, not the control connection")
