"""The sending half of the nccl connector (`nccl.py` has the protocol): one connection,
its control socket and process group (`NcclLink`), kept by the connector for reuse between
transfers; `NcclSender` enqueues each payload's send on the group's stream and hands back
a `_NcclSend` that says when the payload may be reused."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from tandem.kvtransfer.connector import (
    Frame,
    Sender,
    SendHandle,
    Sent,
    TransferError,
    payload_header,
)
from tandem.kvtransfer.nccl_group import PairGroup
from tandem.kvtransfer.tcp_links import TcpSender

if TYPE_CHECKING:
    from tandem.kvtransfer.nccl import NcclConnector


@dataclass(eq=False)
class NcclLink:
    """A sender's connection: the control socket and the process group."""

    control: TcpSender
    group: PairGroup

    def drain(self) -> bool:
        """Drop replies left from an earlier transfer; False if the receiver is gone."""
        try:
            while self.control.poll(0) is not None:
                pass
        except TransferError:
            return False
        return True

    def close(self) -> None:
        self.control.close()
        self.group.abort()


class NcclSender(Sender):
    """One connection (control socket + process group). Used by one thread at a time."""

    def __init__(self, connector: NcclConnector, link: NcclLink, address: str) -> None:
        self._connector, self._link, self._address = connector, link, address
        self._io_timeout = connector.io_timeout
        self._broken: str | None = None
        self._closed = False
        self._in_flight: list[_NcclSend] = []  # sends not yet seen completed
        # A message announced (`next`) and not sent yet: the receiver has a receive posted
        # for it, so this connection can't carry anything else and is not parked.
        self._owed: dict[str, Any] | None = None

    def send(self, frame: Frame, timeout: float | None = None) -> None:
        self.send_async(frame, timeout).wait(timeout)

    def send_async(self, frame: Frame, timeout: float | None = None) -> SendHandle:
        """The header goes out over tcp now, with no reply awaited; the payload's send is
        enqueued on the group's stream (nccl; gloo sends it before returning)."""
        self._check_open()
        timeout = timeout or self._io_timeout
        header = Frame(payload_header(frame))
        work = None
        try:
            if frame.payload is None:
                self._link.control.send(header, timeout)
            elif self._link.group.backend == "nccl":
                # Payload first: its send only waits on the GPU for the matching receive,
                # which may already be posted (announced ahead); the header follows.
                work = self._link.group.start_send(frame.payload, timeout)
                self._link.control.send(header, timeout)
            else:  # gloo sends synchronously: the receiver needs the header first
                self._link.control.send(header, timeout)
                work = self._link.group.start_send(frame.payload, timeout)
        except TransferError as exc:
            # Half a frame went out (or the group is dead): this connection is over.
            self._fail(str(exc))
            raise
        if frame.payload is not None:
            self._owed = None  # the announced message, if one was owed, is this one
        if "next" in frame.header:
            self._owed = frame.header["next"]
        if work is None:
            return Sent()
        handle = _NcclSend(self, work, frame.payload, timeout)
        self._in_flight = [h for h in self._in_flight if not h.done()] + [handle]
        return handle

    def poll(self, timeout: float = 0.0) -> Frame | None:
        self._check_open()
        try:
            return self._link.control.poll(timeout)
        except TransferError as exc:
            self._fail(str(exc))
            raise

    def close(self) -> None:
        """Give the connection back: parked for the next sender once every send is done
        (they are by the receiver's reply, but NCCL may say so a moment later), unless a
        receive is posted for a message it never sent; closed otherwise."""
        if self._closed:
            return
        self._closed = True
        reusable = self._owed is None
        try:
            for handle in self._in_flight:
                handle.wait(self._io_timeout)
        except TransferError:
            reusable = False
        self._in_flight = []
        self._connector.give_back(self._address, self._link, reusable)

    def _check_open(self) -> None:
        if self._closed:
            why = f" ({self._broken})" if self._broken else ""
            raise TransferError(f"connection to {self._address} is closed{why}")

    def _fail(self, why: str) -> None:
        if not self._closed:
            self._connector.give_back(self._address, self._link, reusable=False)
        self._broken, self._closed = why, True


class _NcclSend(SendHandle):
    """A payload's send enqueued on the group's stream; holds the payload until done."""

    def __init__(self, sender: NcclSender, work: Any, payload: torch.Tensor,
                 timeout: float) -> None:
        self._sender, self._work, self._payload = sender, work, payload
        self._timeout = timeout
        self._done = False

    def done(self) -> bool:
        self._done = self._done or self._work.is_completed()
        return self._done

    def wait(self, timeout: float | None = None) -> None:
        if self._done:
            return
        try:
            self._sender._link.group.wait(self._work, timeout or self._timeout)
        except TransferError as exc:
            self._sender._fail(str(exc))
            raise
        self._done = True
