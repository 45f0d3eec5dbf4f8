"""The sending side of a KV transfer: push a request's blocks into a remote sink.

`KVPush` sends layer by layer, so a prefill can push layer i while it computes i+1:

    with KVPush(connector, sink, kv_caches, src_block_ids, layout) as push:
        push.start()                 # layout checked here and by the receiver
        for i in range(layout.num_layers):
            ...compute layer i...
            push.send_layer(i)       # raises once the receiver aborted; doesn't wait
        push.finish()                # returns when the sink is ready

Layers go out in messages from a small ring of staging buffers, sent asynchronously
(`Sender.send_async`), so they overlap on the link: once the link is idle a layer goes
out at once; while it is busy, consecutive layers stack up into one message of at most
`message_bytes`, gathered by one kernel (large messages are what NCCL moves fastest).

With `all_computed` (a finished prefill, or cached blocks: `push()`), the messages follow
a fixed plan of `message_bytes` each, and every header announces the next message's
header (`next`; `begin` announces the first), so a connector that must post a receive
before the bytes come (nccl) posts it while the previous message is still on the link.

With a direct connector (ipc) no KV goes through the link at all: this side writes the
blocks straight into the receiver's cache (the sink's `target`), one kernel per message
enqueued on the current stream right after the layers' compute, records a CUDA IPC event
after it, and tells the receiver (`begin` names the event; a layer message is a header
only). With `all_computed` it does not wait for the receiver's `accept` either: the
receiver's write guard decides which blocks a write may touch, so every layer is written,
in one kernel, as soon as it is handed over, and a refusal is heard by `finish`. Such
pushes to one receiver may also go together (the prefill role's ipc pushes of one step):
each is written alone (`write`: no frame), then `send_written` tells the receiver of them
all in one `written` message, each with its first token, and waits for each one's done:
one frame out for them all and one in each, not three out and two in each.

`kv_caches` is the per-layer caches, or a `KVRows` over them built once and passed to
every push (it reads the caches' layout once, not per push).

With the cluster `secret`, `begin` and `abort` carry `auth`: `auth.proof(secret,
request_id)`, which the receiver checks; the secret itself never goes on the wire.

One push is driven by one thread at a time (the prefill role gives each its own). Pushes
to one receiver share the connector's connections (tcp: a few per address, however many
pushes are in flight); every frame names its request id, and so does every reply.

Every failure raises TransferError (LayoutMismatch for a layout mismatch) within a
bounded time; leaving the `with` block on an exception aborts the transfer, so the
receiver frees the sink at once rather than at its TTL.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from types import TracebackType
from typing import Any

import torch

from tandem.kvtransfer import auth
from tandem.kvtransfer.agent import LAYOUT_MISMATCH, SinkInfo
from tandem.kvtransfer.connector import Connector, Frame, Sender, SendHandle, TransferError
from tandem.kvtransfer.ipc import Target
from tandem.kvtransfer.layout import KVLayout, LayoutMismatch
from tandem.kvtransfer.messages import ABORT, ACCEPT, BEGIN, DONE, END, LAYER, WRITTEN
from tandem.kvtransfer.staging import KVRows, device_ids


class KVPush:
    def __init__(
        self,
        connector: Connector,
        sink: SinkInfo,
        kv_caches: Sequence[torch.Tensor] | KVRows,
        src_block_ids: Sequence[int],
        layout: KVLayout,
        *,
        connect_timeout: float = 5.0,
        send_timeout: float = 30.0,
        reply_timeout: float = 10.0,
        ring: int = 2,
        message_bytes: int = 64 << 20,
        all_computed: bool = False,
        secret: bytes | None = None,
    ) -> None:
        if ring < 1 or message_bytes < 1:
            raise ValueError(f"ring and message_bytes must be positive: {ring}, {message_bytes}")
        if len(src_block_ids) != len(sink.block_ids):
            raise ValueError(
                f"{len(src_block_ids)} source blocks for {len(sink.block_ids)} sink blocks"
            )
        self._rows = kv_caches if isinstance(kv_caches, KVRows) else KVRows(kv_caches)
        self._rows.check(layout)
        self.sink, self.layout = sink, layout
        self._connector = connector
        # begin and abort carry it; None: the receiver asks for none
        self._auth = auth.proof(secret, sink.request_id)
        device = self._rows.caches[0].device
        self._direct = getattr(connector, "direct", False)
        # On the device when first needed (`write_together` moves a gang's in one copy),
        # not waiting for the compute queued on the stream. Direct: the sink's ids too,
        # [source; sink], for the kernel that writes into it.
        self._block_ids = ((src_block_ids, sink.block_ids) if self._direct
                           else (src_block_ids,))
        self._device = device
        self._on_device: torch.Tensor | None = None
        if self._direct and self._rows.rows is None:
            raise ValueError(f"the {connector.name} connector reads the KV cache as one "
                             f"tensor; these layers are separate tensors")
        # direct, CUDA: recorded after each write into the sink
        self._written = (connector.event(device)
                         if self._direct and device.type == "cuda" else None)
        self._target: Target | None = None  # direct: the sink, mapped here
        self._writes: dict[tuple[int, int], Callable[[], None]] = {}  # planned, by layers
        self._connect_timeout, self._send_timeout = connect_timeout, send_timeout
        self._reply_timeout = reply_timeout
        self._sender: Sender | None = None
        self._closed = False  # once closed (done, failed or aborted) nothing more is sent
        # A ring of staging buffers, each room for `_per_message` layers: the slot being
        # filled collects layers while earlier slots are still on their way, and is
        # gathered into only once its previous send is done.
        layer_bytes = layout.block_bytes * len(sink.block_ids)
        self._per_message = max(1, min(layout.num_layers, message_bytes // layer_bytes))
        self._ring: list[torch.Tensor | None] = [None] * ring
        self._in_flight: list[SendHandle | None] = [None] * ring
        self._slot = 0  # the slot being filled, with layers first .. first + count - 1
        self._first, self._count = 0, 0
        # all_computed: message i carries layers plan[i], announced one message ahead.
        n, per = layout.num_layers, self._per_message
        if self._direct:  # no staging: every layer is written at once
            self._ring, per = [], n
        self._plan = [(f, min(per, n - f)) for f in range(0, n, per)] if all_computed else []
        self._sent_messages = 0
        self._handed = 0  # all_computed: layers handed to send_layer so far
        self._ended_at = 0.0  # time.monotonic() when the end frame went

    def start(self) -> None:
        """Connect and open the transfer; returns once the receiver accepted it (direct,
        with every layer computed: once `begin` went out)."""
        try:
            sink_layout = KVLayout.from_dict(self.sink.layout)
            self.layout.check(sink_layout, "on the sender", "on the receiver")
            if self._direct:
                self._target = self._open_target()
                # Every layer computed: the writes are planned now, launched when due.
                assert self._rows.rows is not None
                self._writes = {m: self._target.plan_write(self._rows.rows, self._ids, *m)
                                for m in self._plan}
        except TransferError as exc:  # LayoutMismatch too
            self.abort(str(exc))
            raise
        try:
            self._sender = self._connector.sender(self.sink.address, self._connect_timeout)
        except TransferError:
            self._closed = True  # unreachable: an abort could not get through either
            raise
        begin = self._signed({"kind": BEGIN, "layout": self.layout.to_dict(),
                              "num_blocks": len(self.sink.block_ids)})
        if self._direct:
            begin["writer"] = {"pid": os.getpid(),
                               "event": self._written.handle if self._written else None}
        self._send(self._announcing(begin, 0))
        for slot in range(len(self._ring)):  # staging memory ready before the first layer
            self._buffer(slot)
        if not (self._direct and self._plan):
            self._await(ACCEPT)

    def send_layer(self, layer: int) -> None:
        """Layer `layer`'s KV is computed (on CUDA: enqueued on the current stream); send
        it. Returns without waiting for the bytes unless every staging slot is still on
        its way; once the last layer is handed over, every layer has been read from the
        cache (on CUDA: the reads are enqueued on the current stream). While an earlier
        send is still out, consecutive layers stack up into one message (a sender ahead
        of the link sends fewer, larger ones); once the link is idle they go out at once.
        Raises once the receiver aborted (a planned push checks
        when a message is due: a poll per layer costs more than the copy of one)."""
        if self._plan:
            self._send_planned(layer)
            return
        self._raise_if_aborted()
        if self._count and layer != self._first + self._count:
            self._flush()
        if not self._count:
            self._first = layer
        self._count += 1
        # The last layer goes at once: nothing more will stack up with it, and the caller
        # may reuse the blocks once every layer is handed over and gathered.
        last = layer == self.layout.num_layers - 1
        if last or self._count == self._per_message or self._link_idle():
            self._flush()

    def _send_planned(self, layer: int) -> None:
        """A message goes once its last layer is handed over; direct, at its first: every
        layer is computed, and the write takes no staging slot."""
        if layer != self._handed or layer >= self.layout.num_layers:
            want = (f"expected {self._handed}" if self._handed < self.layout.num_layers
                    else "every layer was sent")
            raise ValueError(f"with all_computed, layers are sent once each in order; "
                             f"{want}, got {layer}")
        self._handed += 1
        if self._sent_messages == len(self._plan):
            return  # direct: the last message went at its first layer
        first, count = self._plan[self._sent_messages]
        if layer == (first if self._direct else first + count - 1):
            if not self._direct:  # (a direct write is guarded: it goes first, then the check)
                self._raise_if_aborted()
            self._first, self._count = first, count
            self._flush()
            if self._direct:
                self._raise_if_aborted()

    def write(self) -> None:
        """Direct, every layer computed (on CUDA: enqueued on the current stream): write
        them all into the sink now, and tell the receiver nothing yet: `send_written`
        tells it of this push and others to it in one message. Raises TransferError
        (LayoutMismatch) as `start` does, the push aborted."""
        self._open_for_write()
        self._write(0, self.layout.num_layers)
        self._wrote()

    def _open_for_write(self) -> None:
        """`write`'s checks and the sink's target, mapped; an error aborts the push."""
        if not (self._direct and self._plan):
            raise ValueError("only a direct push with every layer computed writes alone")
        try:
            self.layout.check(KVLayout.from_dict(self.sink.layout), "on the sender",
                              "on the receiver")
            self._target = self._open_target()
        except TransferError as exc:
            self.abort(str(exc))
            raise

    def _wrote(self) -> None:
        """Every layer is written (enqueued): the push has nothing left to send."""
        self._handed, self._sent_messages = self.layout.num_layers, len(self._plan)

    def finish(self, first_token: int | None = None) -> None:
        """Close the transfer; returns once the receiver confirmed every layer landed.
        `first_token`, the token sampled from the prompt, rides in the end frame."""
        self.end(first_token)
        self.wait_done()

    def end(self, first_token: int | None = None) -> None:
        """`finish`'s first half: every layer out, then the end frame. A thread ending
        many pushes sends each one's end before it waits for any receiver's reply."""
        if not self._plan:  # a planned message goes out only whole, as announced
            self._flush()
        for slot in range(len(self._in_flight)):
            self._settle(slot)
        end: dict[str, Any] = {"kind": END}
        if first_token is not None:
            end["first_token"] = first_token
        self._send(end)
        self._ended_at = time.monotonic()

    def wait_done(self) -> None:
        """`finish`'s second half: returns once the receiver confirmed every layer landed,
        within the reply timeout of the end frame."""
        try:
            self._await(DONE, self._ended_at)
        except BaseException:
            self.close()
            raise
        self.close(reuse=True)

    def abort(self, reason: str) -> None:
        """Give up; the receiver frees the sink now. Best effort, never raises."""
        if self._closed:
            return  # finished, or the receiver already knows (it aborted, or it is gone)
        if self._sender is None:
            self._tell_receiver_we_gave_up(reason)
        else:
            try:
                self._send(self._signed({"kind": ABORT, "reason": reason}))
            except TransferError:
                pass
        self.close()

    def close(self, reuse: bool = False) -> None:
        """`reuse`: the transfer ended cleanly (done), so the connection may serve later
        ones; any other close ends the transfer, which the receiver learns at once (its
        connection closes, or carries an abort: `Sender.close`)."""
        self._closed = True
        if self._written is not None:
            self._written.event.synchronize()  # our writes, before their mapping goes
            self._connector.give_event(self._written)
            self._written = None
        if self._target is not None:
            self._target.close()
            self._target = None
        if self._sender is not None:
            if reuse:
                self._sender.release()
            else:
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

    def _signed(self, header: dict[str, Any]) -> dict[str, Any]:
        """`header` with the proof of the cluster secret, if this push has one."""
        return header if self._auth is None else {**header, "auth": self._auth}

    @property
    def _ids(self) -> torch.Tensor:
        """The block ids on the push's device: [source] or, direct, [source; sink]."""
        if self._on_device is None:
            self._on_device = device_ids(*self._block_ids, device=self._device)
        return self._on_device

    def _open_target(self) -> Target:
        if self.sink.target is None:
            raise TransferError(f"the sink at {self.sink.address} takes no {self._connector.name}"
                                f" writes: its receiver's connector is not {self._connector.name}")
        return Target.open(self._connector.mapped, self.sink.target, self.layout,
                           self.sink.block_ids, self._device)

    def _write(self, first: int, count: int) -> None:
        """Direct: layers first .. first + count - 1 into the sink, after the work enqueued
        so far on the current stream (their compute); on CUDA, the event after it."""
        assert self._target is not None and self._rows.rows is not None
        write = self._writes.pop((first, count), None)
        if write is None:
            write = self._target.plan_write(self._rows.rows, self._ids, first, count)
        write()
        self._record_written()

    def _record_written(self) -> None:
        if self._written is not None:
            self._written.event.record(torch.cuda.current_stream(self._device))

    def _buffer(self, slot: int) -> torch.Tensor:
        # [per_message, 2, n, bs, H, D]
        if self._ring[slot] is None:
            shape = (self._per_message, *self.layout.staging_shape(len(self.sink.block_ids)))
            head = self._rows.caches[0]
            self._ring[slot] = torch.empty(shape, dtype=head.dtype, device=head.device)
        return self._ring[slot]

    def _link_idle(self) -> bool:
        return all(h is None or h.done() for h in self._in_flight)

    def _flush(self) -> None:
        """Gather the layers collected for the current slot (one kernel on CUDA, enqueued
        on the current stream, which the connector's send waits for) and send them as one
        frame; next slot."""
        if not self._count:
            return
        if self._direct:
            self._write_layers()
            return
        self._settle(self._slot)
        staged = self._buffer(self._slot)[:self._count]
        self._rows.gather(self._first, self._ids[0], staged)
        header = self._layer_header(self._first, self._count)
        payload = staged[0] if self._count == 1 else staged
        self._count = 0
        self._sent_messages += 1
        header = self._announcing(header, self._sent_messages)
        try:
            self._in_flight[self._slot] = self._open().send_async(Frame(header, payload),
                                                                  self._send_timeout)
        except TransferError:
            self.close()
            raise
        self._slot = (self._slot + 1) % len(self._ring)

    def _write_layers(self) -> None:
        """Direct: write the collected layers and tell the receiver."""
        header = {"kind": LAYER, "layer": self._first}
        if self._count > 1:
            header["layers"] = self._count
        self._write(self._first, self._count)
        self._count = 0
        self._sent_messages += 1
        self._send(header)

    def _layer_header(self, first: int, count: int) -> dict[str, Any]:
        """A layer message's header as it travels (dtype and shape included)."""
        shape = self.layout.staging_shape(len(self.sink.block_ids))
        header = {"kind": LAYER, "layer": first, "request_id": self.sink.request_id,
                  "dtype": self.layout.dtype, "shape": [count, *shape] if count > 1 else shape}
        if count > 1:
            header["layers"] = count
        return header

    def _announcing(self, header: dict[str, Any], message: int) -> dict[str, Any]:
        """`header`, carrying planned message `message`'s header as `next` if there is one."""
        if message < len(self._plan) and not self._direct:
            return {**header, "next": self._layer_header(*self._plan[message])}
        return header

    def _settle(self, slot: int) -> None:
        """Wait until the send from `slot` is out, so its buffer may be reused."""
        handle, self._in_flight[slot] = self._in_flight[slot], None
        if handle is None:
            return
        try:
            handle.wait(self._send_timeout)
        except TransferError:
            self.close()
            raise

    def _raise_if_aborted(self) -> None:
        """Raise if the receiver replied with an abort; never blocks."""
        while (frame := self._poll(0.0)) is not None:
            self._raise_on_abort(frame)

    def _await(self, kind: str, since: float | None = None) -> None:
        """Wait for a reply of `kind`, until the reply timeout after `since` (default:
        now); one that came meanwhile counts, however late this looks."""
        deadline = (time.monotonic() if since is None else since) + self._reply_timeout
        while (frame := self._poll(max(0.0, deadline - time.monotonic()))) is not None or (
                time.monotonic() < deadline):
            if frame is None:
                continue
            self._raise_on_abort(frame)
            if frame.header.get("kind") == kind and self._ours(frame):
                return
        self.close()
        raise TransferError(f"no {kind!r} from {self.sink.address} in {self._reply_timeout:g}s")

    def _poll(self, timeout: float) -> Frame | None:
        try:
            return self._open().poll(timeout)
        except TransferError:
            self.close()
            raise

    def _ours(self, frame: Frame) -> bool:
        """Not a late reply about an earlier transfer on a reused connection."""
        return frame.header.get("request_id", self.sink.request_id) == self.sink.request_id

    def _raise_on_abort(self, frame: Frame) -> None:
        if frame.header.get("kind") != ABORT or not self._ours(frame):
            return
        self.close()
        raise _abort_error(frame)

    def _written_sink(self, first_token: int) -> dict[str, Any]:
        """This push (written) as a `written` message names it."""
        entry: dict[str, Any] = {"request_id": self.sink.request_id,
                                 "num_blocks": len(self.sink.block_ids),
                                 "first_token": first_token}
        if self._auth is not None:
            entry["auth"] = self._auth
        if self._written is not None:
            entry["event"] = self._written.handle
        return entry

    def _tell_receiver_we_gave_up(self, reason: str) -> None:
        """An abort frame on a short-lived connection, so the sink is freed now, not at
        its TTL. Best effort: if it can't be delivered, the TTL still frees the sink."""
        try:
            sender = self._connector.sender(self.sink.address, self._connect_timeout)
        except TransferError:
            return
        try:
            header = {"kind": ABORT, "request_id": self.sink.request_id, "reason": reason}
            sender.send(Frame(self._signed(header)), self._send_timeout)
        except TransferError:
            pass
        finally:
            sender.close()


def _abort_error(frame: Frame) -> TransferError:
    """What a push raises for the receiver's abort `frame`."""
    reason = frame.header.get("reason", "")
    if frame.header.get("error") == LAYOUT_MISMATCH:
        return LayoutMismatch(reason)
    return TransferError(f"aborted by receiver: {reason}")


def write_together(pushes: Sequence[KVPush], after: Sequence[torch.cuda.Event] = ()
                   ) -> list[BaseException | None]:
    """`KVPush.write` for many pushes, each direct with every layer computed, in as few
    copies as their sinks allow: those whose sinks lie in one mapped cache (one
    receiver's) have their block ids moved to the device together, then one kernel
    writes every one's blocks, each block checked against its own sink's ticket. The
    copies are enqueued on the current stream after the events `after` (the layers'
    compute), the ids' move before them. None for each push written, else why it
    failed (that push aborted), as `write` raises."""
    out: list[BaseException | None] = [None] * len(pushes)
    caches: dict[tuple[int, int], list[int]] = {}  # pushes by the cache they write into
    for i, push in enumerate(pushes):
        try:
            push._open_for_write()
        except TransferError as exc:
            out[i] = exc
            continue
        target = push._target
        assert target is not None and target.rows is not None and target.tags is not None
        caches.setdefault((target.rows.data_ptr(), target.tags.data_ptr()), []).append(i)
    plans = []
    for group in caches.values():
        members = [pushes[i] for i in group]
        head = members[0]
        ids = device_ids([b for p in members for b in p._block_ids[0]],
                         [b for p in members for b in p._block_ids[1]],
                         [p._target.ticket for p in members for _ in p._block_ids[1]],
                         device=head._device)
        assert head._target is not None and head._rows.rows is not None
        plans.append((group, head._target.plan_write(head._rows.rows, ids[:2], 0,
                                                      head.layout.num_layers, ids[2])))
    device = pushes[plans[0][0][0]]._device if plans else None
    if device is not None and device.type == "cuda":
        stream = torch.cuda.current_stream(device)
        for event in after:  # the ids' moves are enqueued: they need not wait
            stream.wait_event(event)
    for group, write in plans:
        try:
            write()
        except BaseException as exc:  # noqa: BLE001 - every push of that copy failed
            for i in group:
                pushes[i].abort(f"{type(exc).__name__}: {exc}")
                out[i] = exc
            continue
        for i in group:
            pushes[i]._record_written()
            pushes[i]._wrote()
    return out


def send_written(pushes: Sequence[KVPush], first_tokens: Sequence[int]
                 ) -> list[BaseException | None]:
    """Tell the receiver of `pushes` (each written, `KVPush.write`; one receiver's, of one
    connector and layout) of them all in one message, each with its first token, and
    wait for each one's reply, within the reply timeout: None for its done, else why it
    failed. Each push is closed once this returns."""
    head = pushes[0]
    waiting = {push.sink.request_id: i for i, push in enumerate(pushes)}
    if len(waiting) != len(pushes):  # a reply names its request: each must be one push's
        raise ValueError("pushes told of together need distinct request ids")
    out: list[BaseException | None] = [None] * len(pushes)
    sender: Sender | None = None
    try:
        sender = head._connector.sender(head.sink.address, head._connect_timeout)
        sinks = [push._written_sink(token)
                 for push, token in zip(pushes, first_tokens, strict=True)]
        sender.send(Frame({"kind": WRITTEN, "layout": head.layout.to_dict(),
                           "pid": os.getpid(), "sinks": sinks}), head._send_timeout)
        deadline = time.monotonic() + head._reply_timeout
        while waiting and ((frame := sender.poll(max(0.0, deadline - time.monotonic())))
                           is not None or time.monotonic() < deadline):
            if frame is None:
                continue
            if frame.header.get("kind") == DONE:
                for rid in (frame.header.get("request_id"), *frame.header.get("more", ())):
                    waiting.pop(rid, None)
            elif frame.header.get("kind") == ABORT and (
                    i := waiting.pop(frame.header.get("request_id"), None)) is not None:
                out[i] = _abort_error(frame)
        late = TransferError(f"no 'done' from {head.sink.address} in {head._reply_timeout:g}s")
        for i in waiting.values():
            out[i] = late
    except TransferError as exc:  # the connection failed: every push not answered did
        for i in waiting.values():
            out[i] = exc
    finally:
        if sender is not None and waiting:  # those left are aborted (a frame each, or
            sender.close()                   # the connection's end)
        elif sender is not None:
            sender.release()
        for push in pushes:
            push.close()
    return out


def push(
    connector: Connector,
    sink: SinkInfo,
    kv_caches: Sequence[torch.Tensor] | KVRows,
    src_block_ids: Sequence[int],
    layout: KVLayout,
    **options: Any,
) -> None:
    """Send a whole, computed request's KV into `sink`; returns once the sink is ready.
    `options`: KVPush's keyword arguments (timeouts, ring, message_bytes, secret)."""
    with KVPush(connector, sink, kv_caches, src_block_ids, layout, all_computed=True,
                **options) as p:
        p.start()
        for layer in range(layout.num_layers):
            p.send_layer(layer)
        p.finish()
