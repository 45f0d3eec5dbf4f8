"""The sending side of a KV transfer: push a request's blocks into a remote sink.

`KVPush` sends layer by layer, so a prefill can push layer i while it computes i+1:

    with KVPush(connector, sink, kv_caches, src_block_ids, layout) as push:
        push.start()                 # layout checked here and by the receiver
        for i in range(layout.num_layers):
            ...compute layer i...
            push.send_layer(i)       # raises once the receiver aborted
        push.finish()                # returns when the sink is ready

Every failure raises TransferError (LayoutMismatch for a layout mismatch) within a
bounded time; leaving the `with` block on an exception aborts the transfer, so the
receiver frees the sink at once rather than at its TTL.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from types import TracebackType

import torch

from tandem.kvtransfer.agent import (
    ABORT,
    ACCEPT,
    BEGIN,
    DONE,
    END,
    LAYER,
    LAYOUT_MISMATCH,
    SinkInfo,
)
from tandem.kvtransfer.connector import Connector, Frame, Sender, TransferError
from tandem.kvtransfer.layout import KVLayout, LayoutMismatch
from tandem.kvtransfer.staging import gather_blocks


class KVPush:
    def __init__(
        self,
        connector: Connector,
        sink: SinkInfo,
        kv_caches: Sequence[torch.Tensor],
        src_block_ids: Sequence[int],
        layout: KVLayout,
        *,
        connect_timeout: float = 5.0,
        send_timeout: float = 30.0,
        reply_timeout: float = 10.0,
    ) -> None:
        if len(src_block_ids) != len(sink.block_ids):
            raise ValueError(
                f"{len(src_block_ids)} source blocks for {len(sink.block_ids)} sink blocks"
            )
        KVLayout.of(kv_caches, layout.model_id).check(layout)
        self.sink, self.layout = sink, layout
        self._connector = connector
        self._caches = kv_caches
        device = kv_caches[0].device
        self._src = torch.tensor(list(src_block_ids), dtype=torch.long, device=device)
        self._connect_timeout, self._send_timeout = connect_timeout, send_timeout
        self._reply_timeout = reply_timeout
        self._sender: Sender | None = None
        self._closed = False  # once closed (done, failed or aborted) nothing more is sent
        # One staging buffer for every layer: `send` returns once it may be reused.
        self._staging: torch.Tensor | None = None

    def start(self) -> None:
        """Connect and open the transfer; returns once the receiver accepted it."""
        try:
            sink_layout = KVLayout.from_dict(self.sink.layout)
            self.layout.check(sink_layout, "on the sender", "on the receiver")
        except LayoutMismatch as exc:
            self.abort(str(exc))
            raise
        try:
            self._sender = self._connector.sender(self.sink.address, self._connect_timeout)
        except TransferError:
            self._closed = True  # unreachable: an abort could not get through either
            raise
        self._send({"kind": BEGIN, "layout": self.layout.to_dict(),
                    "num_blocks": len(self.sink.block_ids)})
        self._await(ACCEPT)

    def send_layer(self, layer: int) -> None:
        """Gather layer `layer`'s source blocks and send them as one payload."""
        self._raise_if_aborted()
        self._staging = gather_blocks(self._caches[layer], self._src, out=self._staging)
        self._send({"kind": LAYER, "layer": layer}, self._staging)

    def finish(self) -> None:
        """Close the transfer; returns once the receiver confirmed every layer landed."""
        self._send({"kind": END})
        try:
            self._await(DONE)
        finally:
            self.close()

    def abort(self, reason: str) -> None:
        """Give up; the receiver frees the sink now. Best effort, never raises."""
        if self._closed:
            return  # finished, or the receiver already knows (it aborted, or it is gone)
        if self._sender is None:
            self._tell_receiver_we_gave_up(reason)
        else:
            try:
                self._send({"kind": ABORT, "reason": reason})
            except TransferError:
                pass
        self.close()

    def close(self) -> None:
        self._closed = True
        if self._sender is not None:
            self._sender.close()
            self._sender = None

    def __enter__(self) -> KVPush:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc is not None:
            self.abort(f"{exc_type.__name__ if exc_type else 'error'}: {exc}")
        self.close()

    # -- internals -----------------------------------------------------------------------

    def _open(self) -> Sender:
        if self._sender is None:
            state = "closed" if self._closed else "not started"
            raise TransferError(f"transfer of {self.sink.request_id!r} is {state}")
        return self._sender

    def _send(self, header: dict, payload: torch.Tensor | None = None) -> None:
        frame = Frame({**header, "request_id": self.sink.request_id}, payload)
        try:
            self._open().send(frame, self._send_timeout)
        except TransferError:
            self.close()
            raise

    def _raise_if_aborted(self) -> None:
        """Raise if the receiver replied with an abort; never blocks."""
        while (frame := self._poll(0.0)) is not None:
            self._raise_on_abort(frame)

    def _await(self, kind: str) -> None:
        deadline = time.monotonic() + self._reply_timeout
        while (left := deadline - time.monotonic()) > 0:
            frame = self._poll(left)
            if frame is None:
                continue
            self._raise_on_abort(frame)
            if frame.header.get("kind") == kind:
                return
        self.close()
        raise TransferError(f"no {kind!r} from {self.sink.address} in {self._reply_timeout:g}s")

    def _poll(self, timeout: float) -> Frame | None:
        try:
            return self._open().poll(timeout)
        except TransferError:
            self.close()
            raise

    def _raise_on_abort(self, frame: Frame) -> None:
        if frame.header.get("kind") != ABORT:
            return
        self.close()
        reason = frame.header.get("reason", "")
        if frame.header.get("error") == LAYOUT_MISMATCH:
            raise LayoutMismatch(reason)
        raise TransferError(f"aborted by receiver: {reason}")

    def _tell_receiver_we_gave_up(self, reason: str) -> None:
        """An abort frame on a short-lived connection, so the sink is freed now, not at
        its TTL. Best effort: if it can't be delivered, the TTL still frees the sink."""
        try:
            sender = self._connector.sender(self.sink.address, self._connect_timeout)
        except TransferError:
            return
        try:
            header = {"kind": ABORT, "request_id": self.sink.request_id, "reason": reason}
            sender.send(Frame(header), self._send_timeout)
        except TransferError:
            pass
        finally:
            sender.close()


def push(
    connector: Connector,
    sink: SinkInfo,
    kv_caches: Sequence[torch.Tensor],
    src_block_ids: Sequence[int],
    layout: KVLayout,
    **timeouts: float,
) -> None:
    """Send a whole request's KV into `sink`; returns once the sink is ready."""
    with KVPush(connector, sink, kv_caches, src_block_ids, layout, **timeouts) as p:
        p.start()
        for layer in range(layout.num_layers):
            p.send_layer(layer)
        p.finish()
