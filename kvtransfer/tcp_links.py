"""The tcp connector's sending side: links (connections to one receiver address) shared
by Senders, as `tcp.py`'s docstring tells (sharing, a Sender's end, a link's failure).
`Links` hands each new Sender a link; `Link` writes whole frames and routes the replies
it reads to the Sender that sent frames of their request; `TcpSender` is one Sender's
place on a link."""

from __future__ import annotations

import logging
import select
import socket
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import NoReturn

from tandem.kvtransfer.connector import Frame, Sender, TransferError
from tandem.kvtransfer.messages import ABORT, BEGIN, DONE, WRITTEN
from tandem.kvtransfer.wire import HostStaging, recv_frame, send_frame

log = logging.getLogger(__name__)

# A closing Sender's aborts wait at most this long for the link (best effort: if they
# can't go, the link is stuck and fails, or the sinks' TTL frees them).
_ABORT_TIMEOUT_S = 2.0


class Links:
    """A connector's links, per address. A Sender joins an idle live link if there is
    one, else opens a new one while fewer than `max_links` are open or opening, else
    joins the least busy (or waits, within its connect timeout, for one being opened).
    A link left with no Sender is kept while at most `max_idle` per address are, for at
    most `max_age_s`. `senders` counts change under `_cond`. Not `shared` (`max_idle=0`):
    every Sender gets a link of its own, closed as it leaves."""

    def __init__(self, connect: Callable[[str, float], Link], max_links: int,
                 max_idle: int, max_age_s: float) -> None:
        self._connect = connect
        self.max_links, self.max_idle, self.max_age_s = max_links, max_idle, max_age_s
        self.shared = max_idle > 0
        self._links: dict[str, list[Link]] = {}
        self._opening: dict[str, int] = {}
        self._cond = threading.Condition()
        self._closed = False

    def join(self, address: str, timeout: float) -> Link:
        """The link a new Sender goes on (counted in its `senders`)."""
        if not self.shared:
            return self._connect(address, timeout)
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                links = self._live(address)
                opening = self._opening.get(address, 0)
                room = len(links) + opening < self.max_links
                best = min(links, key=lambda link: link.senders, default=None)
                if best is not None and (best.senders == 0 or not room):
                    best.senders += 1
                    return best
                if room:
                    self._opening[address] = opening + 1
                    break
                if not self._cond.wait(deadline - time.monotonic()):  # for one being opened
                    raise TransferError(f"cannot connect to {address}: no connection came "
                                        f"up in {timeout:g}s")
        return self._open(address, deadline)

    def _open(self, address: str, deadline: float) -> Link:
        """Connect a link for the Sender that counted itself in `_opening`."""
        try:
            link = self._connect(address, max(deadline - time.monotonic(), 1e-3))
        except BaseException:
            with self._cond:
                self._opening[address] -= 1
                self._cond.notify_all()
            raise
        with self._cond:
            self._opening[address] -= 1
            link.senders = 1
            self._links.setdefault(address, []).append(link)
            self._cond.notify_all()
        return link

    def _live(self, address: str) -> list[Link]:
        """`address`'s links, less those failed, or idle too long or with bytes waiting
        (the receiver closed it), which are closed."""
        now = time.monotonic()
        links = self._links.get(address, [])
        live = [link for link in links if link.error is None and (
            link.senders or (now - link.idle_since < self.max_age_s and link.quiet()))]
        for link in links:
            if link not in live:
                link.close()
        self._links[address] = live
        return live

    def leave(self, link: Link) -> None:
        """A Sender left `link`."""
        if not self.shared:
            link.close()
            return
        with self._cond:
            link.senders -= 1
            if link.senders:
                return
            link.idle_since = time.monotonic()
            links = self._links.get(link.address, [])
            idle = sum(1 for other in links if not other.senders)
            drop = self._closed or link.error is not None or idle > self.max_idle
            if drop and link in links:
                links.remove(link)
            self._cond.notify_all()
        if drop:
            link.close()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            idle = [link for links in self._links.values() for link in links if not link.senders]
            for links in self._links.values():
                links[:] = [link for link in links if link.senders]
        for link in idle:
            link.close()


class Link:
    """One connection to a receiver, shared by the Senders on it. Whole frames are
    written under `_write_lock`; the reader thread routes replies (`_deliver`) and ends
    the link when the connection does. `error` is set once, when the link fails or
    closes; from then on every Sender on it raises. The sockets are closed by the reader
    thread as it ends, once no write is in progress."""

    def __init__(self, sock: socket.socket, address: str, io_timeout: float,
                 shared: bool) -> None:
        self.address, self.shared = address, shared
        self.senders = 0  # under Links' lock
        self.idle_since = time.monotonic()
        self.error: TransferError | None = None
        self._sock = sock
        # The reader's own socket object, so a writer setting its send timeout doesn't
        # change the reader's (timeouts are per object; both stay non-blocking beneath).
        self._rsock = sock.dup()
        self._rsock.settimeout(io_timeout)
        self._write_lock = threading.Lock()
        self._staging = HostStaging()
        self._lock = threading.Lock()  # guards the two below and `error`
        self._members: set[TcpSender] = set()
        self._routes: dict[str, TcpSender] = {}  # request id -> the Sender that sent it
        self._reader = threading.Thread(target=self._read_loop, name=f"tcp-link-{address}",
                                        daemon=True)
        self._reader.start()

    def add(self, sender: TcpSender) -> None:
        with self._lock:
            self._members.add(sender)

    def remove(self, sender: TcpSender) -> None:
        with self._lock:
            self._members.discard(sender)
            for rid in [rid for rid, s in self._routes.items() if s is sender]:
                del self._routes[rid]

    def route(self, request_id: str, sender: TcpSender) -> None:
        """Replies about `request_id` go to `sender` (the latest to send frames of it)."""
        with self._lock:
            self._routes[request_id] = sender

    def write(self, frame: Frame, timeout: float) -> None:
        """Write one whole frame within `timeout`, waiting for the link's turn included.
        A write that fails part way fails the link: the stream may be mid-frame."""
        deadline = time.monotonic() + timeout
        if not self._write_lock.acquire(timeout=timeout):
            raise TransferError(f"send to {self.address} timed out: the connection stayed "
                                f"busy for {timeout:g}s")
        try:
            self.raise_if_failed()
            self._sock.settimeout(max(deadline - time.monotonic(), 1e-3))
            send_frame(self._sock, frame, self._staging)
        except TimeoutError as exc:
            raise self.fail(TransferError(f"send to {self.address} timed out")) from exc
        except OSError as exc:
            raise self.fail(TransferError(f"send to {self.address} failed: {exc}")) from exc
        finally:
            self._write_lock.release()

    def quiet(self) -> bool:
        """Nothing waits to be read: an idle link with bytes waiting was closed by the
        receiver (or carries a late reply) and is not handed out."""
        try:
            readable, _, _ = select.select([self._sock], [], [], 0)
        except (OSError, ValueError):  # closed by its reader just now: it failed
            return False
        return not readable

    def fail(self, error: TransferError) -> TransferError:
        """End the link with `error` (the first one sticks); wake every Sender on it."""
        with self._lock:
            first, self.error = self.error is None, self.error or error
            members = list(self._members)
        if first:
            try:
                self._sock.shutdown(socket.SHUT_RDWR)  # the receiver sees it; the reader wakes
            except OSError:
                pass
            for sender in members:
                sender.wake()
        return error

    def close(self) -> None:
        self.fail(TransferError(f"connection to {self.address} closed"))

    def raise_if_failed(self) -> None:
        if self.error is not None:
            raise TransferError(str(self.error))

    def _read_loop(self) -> None:
        staging = HostStaging()
        try:
            while (frame := recv_frame(self._rsock, _no_payloads, staging,
                                       lambda: self.error is None)) is not None:
                self._deliver(frame)
            error = TransferError(f"receiver at {self.address} closed the connection")
        except (OSError, TransferError) as exc:
            error = TransferError(f"connection to {self.address} lost: {exc}")
        self.fail(error)
        with self._write_lock:  # a write in progress ends at once on the shut-down socket
            self._rsock.close()
            self._sock.close()

    def _deliver(self, frame: Frame) -> None:
        rid = frame.header.get("request_id")
        with self._lock:
            sender = self._routes.get(rid) if isinstance(rid, str) else None
            if sender is None and len(self._members) == 1:
                (sender,) = self._members
        if sender is None:
            log.debug("dropped a %s reply from %s: no sender of %r on this connection",
                      frame.header.get("kind"), self.address, rid)
            return
        sender.deliver(frame)


class TcpSender(Sender):
    """One Sender's place on a link: its frames go out whole and in call order; `poll`
    gets the replies about the request ids it sent frames of. Used by one thread at a
    time (`deliver` and `wake` come from the link's reader)."""

    def __init__(self, link: Link, leave: Callable[[Link], None], io_timeout: float) -> None:
        self._link, self._leave, self._io_timeout = link, leave, io_timeout
        self._inbox: deque[Frame] = deque()
        self._cond = threading.Condition()
        # transfers this Sender began and saw no end of: request id -> its begin's `auth`
        self._open: dict[str, str | None] = {}
        self._routed: set[str] = set()
        self._closed = False
        link.add(self)

    def send(self, frame: Frame, timeout: float | None = None) -> None:
        if self._closed:
            raise TransferError(f"sender to {self._link.address} is closed")
        self._note(frame.header, sent=True)
        self._link.write(frame, timeout or self._io_timeout)

    def poll(self, timeout: float = 0.0) -> Frame | None:
        with self._cond:
            self._cond.wait_for(lambda: self._inbox or self._link.error is not None,
                                max(timeout, 0.0))
            frame = self._inbox.popleft() if self._inbox else None
        if frame is None:
            self._link.raise_if_failed()
            return None
        self._note(frame.header, sent=False)
        return frame

    def close(self) -> None:
        """Leave the link; on a shared one, abort first what this Sender left open."""
        if self._closed:
            return
        self._closed = True
        if self._link.shared:
            for rid, auth in list(self._open.items()):
                self._abort(rid, auth)
        self._link.remove(self)
        self._leave(self._link)

    def deliver(self, frame: Frame) -> None:
        with self._cond:
            self._inbox.append(frame)
            self._cond.notify_all()

    def wake(self) -> None:
        with self._cond:
            self._cond.notify_all()

    def _note(self, header: dict, sent: bool) -> None:
        """Route `header`'s request back here; keep `_open` (begun, no end seen)."""
        if header.get("kind") == WRITTEN:  # a begin of each sink's, as far as this goes
            for sink in header["sinks"]:
                self._note({"kind": BEGIN, "request_id": sink["request_id"],
                            "auth": sink.get("auth")}, sent)
            return
        rid, kind = header.get("request_id"), header.get("kind")
        if not isinstance(rid, str):
            return
        if sent and rid not in self._routed:
            self._routed.add(rid)
            self._link.route(rid, self)
        if sent and kind == BEGIN:
            self._open[rid] = header.get("auth")
        elif kind == ABORT or (kind == DONE and not sent):
            for done in (rid, *header.get("more", ())):
                self._open.pop(done, None)

    def _abort(self, rid: str, auth: str | None) -> None:
        header = {"kind": ABORT, "request_id": rid, "reason": "sender closed the transfer"}
        if auth is not None:
            header["auth"] = auth
        try:
            self._link.write(Frame(header), min(self._io_timeout, _ABORT_TIMEOUT_S))
        except TransferError as exc:
            log.debug("abort of %s not sent: %s", rid, exc)


def _no_payloads(header: dict) -> NoReturn:
    raise TransferError("replies carry no payload")
