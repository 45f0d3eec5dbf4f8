"""The receiving side of KV transfers: reservations (sinks) that senders push KV into.

Protocol, per request, on one sender connection, which may carry many requests'
transfers interleaved (tcp shares a few connections per sending process): every frame
names its request id, and a sink takes frames only from the connection (`peer`) its begin
was accepted on (kinds below; each is one message of protos/transfer.proto, which only
`messages.py` encodes and decodes):

    sender -> begin {request_id, layout, num_blocks[, writer]}
                                                       receiver checks the layout
    sender <- accept | abort {reason, error}           no data moves before accept
                                                       (ipc: writes may, guarded)
    sender -> layer {request_id, layer[, layers]} + payload
                                    layers `layer`.. `layer+layers-1` (default 1), stacked
                                    when more than one; scattered as they land; ready
                                    after the last
                                    with a `writer` (the ipc connector: the sender's pid
                                    and CUDA event), no payload: the sender has written
                                    the layers into the sink itself, and the event
                                    completes once they are in place
    sender -> end                                       "that was all"
    sender <- done | abort {reason}
    sender -> abort {reason}                            at any time: the sender gave up
    sender <- abort {reason}                            at any time: receiver abort or TTL

An ipc sender that has written whole prompts into their sinks tells of them together:

    sender -> written {layout, pid, sinks: [{request_id, num_blocks, first_token[, auth,
                       event]}]}                 for each sink, its begin, every layer and
                                                 its end; no accept
    sender <- abort {reason}                     for each sink refused, as it is
    sender <- done {request_id[, more]}          every sink done, in one

A reservation owns its block ids from `reserve` until it is released to the caller
(`release`, after ready) or fails. It fails, and `free_blocks` is called exactly once, on
TTL expiry before release, on `abort` here, on an abort frame, on a layout or protocol
error, when the sender's connection ends before ready (at disconnect, not at the TTL:
every live sink of that connection), or on `close()`. The TTL is a lease over every
state, from `reserve` to `release`: a ready sink nobody releases (its caller died between
the push and its Generate) is freed when it lapses too. Failed and released reservations
stay visible to `status` for `keep_s`; a retry may reserve the same id again.

With the ipc connector a sender writes before this side has heard of it: the sink's
SinkInfo carries a `target` (this cache and its write guard, with the sink's ticket), and
the blocks of a failed sink are closed to writes (`ipc.WriteGuard`) before they are freed,
and a ready sink's as `release` hands them over.

Trust: with a cluster `secret`, a begin must carry `auth` (`auth.proof`) or it is
answered with an abort (`UNAUTHENTICATED`) and leaves the sink as it was, so a forged
begin neither kills nor takes over a reservation; so must an abort from any connection
but the sink's accepted one. Payload memory is allocated only for what a sink of the
connection expects (`_alloc`), so a peer's header can't make this side allocate more.

Locks: `_lock` guards the table; a sink's `write_lock` is held while a layer is
scattered into its blocks, and failing a sink takes it first, so blocks are never freed
to the caller's pool while still being written. Order: write_lock, then _lock.
Callbacks (`free_blocks`, `on_ready`, `on_end`, `on_failed`) run with no lock held.
`on_end(rid, token)` hears the first token a prefill node's end frame carries, once the
sink is ready, so the decode side need not wait for the prefill node's own reply.
"""

from __future__ import annotations

import collections
import contextlib
import heapq
import itertools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import torch

from tandem.engine import trace
from tandem.kvtransfer.auth import verify
from tandem.kvtransfer.connector import (
    PEER,
    Connector,
    Frame,
    TransferError,
    payload_spec,
    poll_until,
)
from tandem.kvtransfer.ipc import WriteGuard
from tandem.kvtransfer.layout import KVLayout, LayoutMismatch
from tandem.kvtransfer.messages import ABORT, ACCEPT, BEGIN, DONE, END, LAYER, WRITTEN
from tandem.kvtransfer.staging import KVRows, StagingPool

log = logging.getLogger(__name__)

# abort `error` codes, so the sender can raise them typed
LAYOUT_MISMATCH = "layout_mismatch"
UNAUTHENTICATED = "unauthenticated"  # a begin without a valid proof of the cluster secret
# How long a failing sink waits for scatters already queued on the GPU before its blocks
# are freed (an aborted connection's recvs end at once, so this is only for a stuck GPU).
_LANDING_GRACE_S = 10.0


@dataclass(frozen=True)
class SinkInfo:
    """Where and into what a sender pushes one request's KV; crosses processes."""

    request_id: str
    address: str
    block_ids: tuple[int, ...]
    layout: dict[str, Any]
    expires_at: float  # time.time(): the one clock both hosts share
    # ipc: where the sender writes (`ipc.Target`); crosses as `messages.target_to_pb`
    target: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        return {**self.__dict__, "block_ids": list(self.block_ids)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SinkInfo:
        return cls(**{**d, "block_ids": tuple(d["block_ids"])})


class State(str, Enum):
    RESERVED = "reserved"  # waiting for the sender's begin
    RECEIVING = "receiving"
    READY = "ready"  # every layer landed; the caller may release
    RELEASED = "released"  # blocks handed to the caller
    FAILED = "failed"  # blocks freed; `reason` says why


_LIVE = (State.RESERVED, State.RECEIVING)


@dataclass(frozen=True)
class TransferStatus:
    state: State
    layers_received: int
    reason: str | None = None


@dataclass(eq=False)
class _Sink:
    request_id: str
    block_ids: tuple[int, ...]
    index: torch.Tensor  # block_ids on the cache's device, built once
    ttl_s: float
    deadline: float  # time.monotonic()
    state: State = State.RESERVED
    peer: str | None = None
    layers: set[int] = field(default_factory=set)
    reason: str | None = None
    ended_at: float | None = None
    done: threading.Event = field(default_factory=threading.Event)
    write_lock: threading.Lock = field(default_factory=threading.Lock)
    # CUDA: recorded after the latest scatter, which the stream may not have run yet (the
    # connector hands over payloads still landing); its blocks are not freed before it.
    landed: torch.cuda.Event | None = None
    ticket: int = 0  # ipc: the blocks may be written while their tags hold it
    direct: bool = False  # ipc: the sender writes the blocks itself
    written: torch.cuda.Event | None = None  # ipc, CUDA: the sender's, after its writes


class TransferAgent:
    def __init__(
        self,
        kv_caches: Sequence[torch.Tensor],
        layout: KVLayout,
        connector: Connector,
        free_blocks: Callable[[list[int]], None],
        host: str = "127.0.0.1",
        *,
        on_ready: Callable[[str], None] | None = None,
        on_end: Callable[[str, int], None] | None = None,
        on_failed: Callable[[str, str], None] | None = None,
        reap_interval_s: float = 0.05,
        keep_s: float = 300.0,
        secret: bytes | None = None,
        port: int = 0,
        advertise_host: str | None = None,
    ) -> None:
        """Listens on `host`:`port` (0: a free port); senders are told `advertise_host`
        (default: `host`) and that port."""
        KVLayout.of(kv_caches, layout.model_id).check(layout)
        self.layout = layout
        self._connector = connector
        self._caches = list(kv_caches)
        self._rows = KVRows(self._caches)
        self._device = self._caches[0].device
        self._num_blocks = self._caches[0].shape[1]
        self._free_blocks, self._on_ready, self._on_failed = free_blocks, on_ready, on_failed
        self._on_first_token = on_end
        self._reap_interval_s, self._keep_s = reap_interval_s, keep_s
        self._secret, self._advertise_host = secret, advertise_host
        self._sinks: dict[str, _Sink] = {}
        self._owned: set[int] = set()  # block ids of live and ready sinks
        # For the reaper, under _lock: every sink by its deadline, the ended ones (the
        # tombstones status() reads) in the order they ended; each tick looks only at
        # those due. A scan of every sink every tick held the GIL against the engine
        # thread for as long as the sinks of the last `keep_s` took to walk.
        self._deadlines: list[tuple[float, int, _Sink]] = []
        self._ended: collections.deque[_Sink] = collections.deque()
        self._made = itertools.count()
        self._buffers = StagingPool()
        # CUDA: scatters run here, off the receiving and the engine's streams; sinks'
        # block ids are copied to the device on the second.
        on_cuda = self._device.type == "cuda"
        self._stream = torch.cuda.Stream(self._device) if on_cuda else None
        self._copies = torch.cuda.Stream(self._device) if on_cuda else None
        self._guard: WriteGuard | None = None  # ipc: which sink may write which block
        self._target: dict[str, Any] | None = None
        if getattr(connector, "direct", False):
            if self._rows.rows is None:
                raise ValueError(f"the {connector.name} connector writes into the KV cache "
                                 f"as one tensor; these layers are separate tensors")
            self._guard = WriteGuard(self._num_blocks, self._device)
            self._target = {"cache": connector.export(self._rows.rows),
                            "tags": self._guard.desc, "layout": layout.to_dict()}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._receiver = connector.receiver(host, self._alloc, self._on_frame, self._on_error,
                                            port)
        self._receiver.keep_open_while(self._busy)
        self._reaper = threading.Thread(target=self._reap_loop, name="kv-reaper", daemon=True)
        self._reaper.start()

    @property
    def address(self) -> str:
        address = self._receiver.address
        if self._advertise_host is None:
            return address
        scheme, _, rest = address.rpartition("://")
        return f"{scheme}://{self._advertise_host}:{rest.rpartition(':')[2]}"

    # -- the caller's side -------------------------------------------------------------

    def reserve(self, request_id: str, block_ids: Sequence[int], ttl_s: float) -> SinkInfo:
        result = self.reserve_many([(request_id, block_ids, ttl_s)])[0]
        if isinstance(result, BaseException):
            raise result
        return result

    def reserve_many(self, wanted: Sequence[tuple[str, Sequence[int], float]]
                     ) -> list[SinkInfo | BaseException]:
        """A sink for each (request id, block ids, ttl) of `wanted`, or why not (ValueError,
        TransferError). On CUDA their block ids go to the device in one copy, and (ipc)
        their tags are opened in one write, waited for once: a decode node reserving a
        burst's prompts pays one round trip to the device, not one each."""
        results: list[SinkInfo | BaseException | None] = []
        checked: list[tuple[str, tuple[int, ...], float]] = []
        for request_id, block_ids, ttl_s in wanted:
            ids = tuple(int(b) for b in block_ids)
            bad = [b for b in ids if not 0 <= b < self._num_blocks]
            if not ids or bad or len(set(ids)) != len(ids):
                results.append(ValueError(
                    f"block ids must be distinct, in [0, {self._num_blocks}): {ids}"))
            else:
                results.append(None)  # filled below
                checked.append((request_id, ids, ttl_s))
        indices = self._indices([ids for _, ids, _ in checked])
        opened: list[tuple[int, _Sink]] = []  # (its place in results, the sink)
        at = (i for i, r in enumerate(results) if r is None)
        with self._lock:
            for (request_id, ids, ttl_s), index, i in zip(checked, indices, at, strict=True):
                try:
                    sink = self._new_sink(request_id, ids, index, ttl_s)
                except (ValueError, TransferError) as exc:
                    results[i] = exc
                    continue
                sink.write_lock.acquire()  # an expiry now waits until the tags are open
                opened.append((i, sink))
        try:
            if self._guard is not None and opened:  # before the SinkInfos leave
                tickets = self._guard.open_many([sink.index for _, sink in opened])
                for (_, sink), ticket in zip(opened, tickets, strict=True):
                    sink.ticket = ticket
        finally:
            for _, sink in opened:
                sink.write_lock.release()
        for i, sink in opened:
            target = None if self._guard is None else {**self._target, "ticket": sink.ticket}
            results[i] = SinkInfo(sink.request_id, self.address, sink.block_ids,
                                  self.layout.to_dict(), time.time() + sink.ttl_s, target)
        return results  # type: ignore[return-value]  (every None was filled)

    def _new_sink(self, request_id: str, ids: tuple[int, ...], index: torch.Tensor,
                  ttl_s: float) -> _Sink:
        """Under the lock: `request_id`'s sink of blocks `ids`, owned from now."""
        if self._stop.is_set():
            raise TransferError("transfer agent is closed")
        old = self._sinks.get(request_id)
        if old is not None and old.state not in (State.FAILED, State.RELEASED):
            raise ValueError(f"request {request_id!r} already holds a reservation")
        if taken := self._owned.intersection(ids):
            raise ValueError(f"blocks {sorted(taken)} are already reserved")
        self._owned.update(ids)
        deadline = time.monotonic() + ttl_s
        sink = self._sinks[request_id] = _Sink(request_id, ids, index, ttl_s, deadline)
        heapq.heappush(self._deadlines, (deadline, next(self._made), sink))
        return sink

    def _indices(self, id_lists: list[tuple[int, ...]]) -> list[torch.Tensor]:
        """Sinks' block ids on the device, in one copy on a stream of the agent's own: a
        copy on the caller's stream would first wait for the work queued there (a decode
        node's engine thread reserves, its step in flight: a reservation took a median
        0.8 ms there on an H200). Each is a view of one tensor; every other stream that
        reads them records itself on them."""
        flat = [b for ids in id_lists for b in ids]
        if not flat:
            return []
        with torch.cuda.stream(self._copies) if self._copies is not None else (
                contextlib.nullcontext()):
            every = torch.tensor(flat, dtype=torch.long, device=self._device)
        return list(every.split([len(ids) for ids in id_lists]))

    def _get(self, request_id: str) -> _Sink | None:
        with self._lock:
            return self._sinks.get(request_id)

    def status(self, request_id: str) -> TransferStatus:
        with self._lock:
            s = self._sinks[request_id]
            return TransferStatus(s.state, len(s.layers), s.reason)

    def holds(self, request_id: str) -> bool:
        """True while `request_id` has a reservation here that is live or ready."""
        with self._lock:
            sink = self._sinks.get(request_id)
            return sink is not None and sink.state in (*_LIVE, State.READY)

    def wait_ready(self, request_id: str, timeout: float) -> bool:
        """True once every layer landed; False on failure or timeout. KeyError if unknown."""
        with self._lock:
            sink = self._sinks[request_id]
        sink.done.wait(timeout)
        return sink.state in (State.READY, State.RELEASED)

    def release(self, request_id: str) -> tuple[int, ...]:
        """Hand a ready sink's blocks to the caller, who now owns (and frees) them."""
        with self._lock:
            sink = self._sinks.get(request_id)
            if sink is None or sink.state is not State.READY:
                raise TransferError(f"request {request_id!r} is not ready: {_describe(sink)}")
            sink.state, sink.ended_at = State.RELEASED, time.monotonic()
            self._ended.append(sink)
            self._owned.difference_update(sink.block_ids)
        if sink.direct:  # the sender is done: the blocks are closed to writes as they go
            assert self._guard is not None  # (queued before any later sink's open)
            self._guard.close(sink.index, wait=False)
        return sink.block_ids

    def abort(self, request_id: str, reason: str = "abort requested") -> bool:
        """Fail the reservation (ready ones too), free its blocks, tell its sender."""
        sink = self._get(request_id)
        return sink is not None and self._fail(sink, reason, (*_LIVE, State.READY), notify=True)

    def close(self) -> None:
        """Stop receiving and free every block still held (ready-but-unreleased too)."""
        self._stop.set()
        self._reaper.join(timeout=5)
        self._receiver.close()
        with self._lock:
            held = list(self._sinks.values())
        for sink in held:
            self._fail(sink, "transfer agent closed", (*_LIVE, State.READY))

    # -- the connector's side (connection threads) -------------------------------------

    def _alloc(self, header: dict[str, Any]) -> torch.Tensor:
        """Where a payload lands. Invariant: nothing is allocated but what a sink that
        this connection began expects, exactly: a layer frame of its dtype and frame
        shape (so at most the sink's own KV). A live sink's lands in a staging buffer; a
        sink that failed meanwhile (its sender may still stream what it queued before it
        read our abort) takes its bytes in scratch of that same size, so the stream stays
        in step. Anything else ends the connection (TransferError), failing its sinks."""
        dtype, shape = payload_spec(header)
        sink = self._get(header.get("request_id"))
        with self._lock:
            state, peer = (None, None) if sink is None else (sink.state, sink.peer)
        # (nccl shows no `PEER` yet: there its connection is checked by `_on_layer` alone)
        ours = peer is not None and header.get(PEER, peer) == peer
        if (sink is None or not ours or header.get("kind") != LAYER
                or state not in (State.RECEIVING, State.FAILED)
                or (dtype, shape) != (self.layout.torch_dtype, self._frame_shape(sink, header))):
            raise TransferError(f"refused a {shape} {dtype} payload for "
                                f"{header.get('request_id')!r}: {_describe(sink)}, "
                                f"not a layer this connection sends into")
        if state is State.RECEIVING:
            return self._buffers.take(shape, dtype, self._device)
        return torch.empty(shape, dtype=dtype)

    def _layer_shape(self, sink: _Sink) -> tuple[int, ...]:
        return self.layout.staging_shape(len(sink.block_ids))

    def _frame_shape(self, sink: _Sink, header: dict[str, Any]) -> tuple[int, ...] | None:
        """One layer's staging shape, or [k, *that] for a frame of k layers (`layers`);
        None for a count no transfer sends."""
        count = header.get("layers", 1)
        if type(count) is not int or not 1 <= count <= self.layout.num_layers:
            return None
        shape = self._layer_shape(sink)
        return shape if count == 1 else (count, *shape)

    def _busy(self, peer: str) -> bool:
        """A transfer is in flight on connection `peer`: it must not be closed as idle."""
        with self._lock:
            return any(s.peer == peer and s.state in _LIVE for s in self._sinks.values())

    def _on_frame(self, frame: Frame) -> None:
        kind = frame.header.get("kind")
        if kind == WRITTEN:  # (messages.decode checked each sink's request id)
            self._on_written(frame.header, frame.peer or "")
            return
        handler = {BEGIN: self._on_begin, LAYER: self._on_layer, END: self._on_end,
                   ABORT: self._on_abort}.get(kind)
        if handler is None:
            log.warning("ignoring frame of kind %r from %s", kind, frame.peer)
            return
        if not isinstance(frame.header.get("request_id"), str):
            raise TransferError(f"a {kind} frame without a request id")
        handler(frame.header, frame.payload, frame.peer or "")

    def _on_written(self, header: dict[str, Any], peer: str) -> None:
        """ipc: each sink's begin, its every layer and its end, as if they came one by
        one, less the accept (its sender waits for none): a done or an abort each."""
        whole = {"kind": LAYER, "layer": 0, "layers": self.layout.num_layers}
        done: list[str] = []  # answered in one frame at the end
        for entry in header["sinks"]:
            rid = entry["request_id"]
            begin = {"kind": BEGIN, "request_id": rid, "layout": header["layout"],
                     "num_blocks": entry["num_blocks"], "auth": entry.get("auth"),
                     "writer": {"pid": header["pid"], "event": entry.get("event")}}
            if self._on_begin(begin, None, peer, accept=False):
                self._on_layer({**whole, "request_id": rid}, None, peer)
                self._on_end({"kind": END, "request_id": rid,
                              "first_token": entry["first_token"]}, None, peer, done)
        if done:
            self._reply(peer, Frame({"kind": DONE, "request_id": done[0], "more": done[1:]}))

    def _on_begin(self, header: dict[str, Any], _: torch.Tensor | None, peer: str,
                  accept: bool = True) -> bool:
        """Whether the sink took the transfer (`accept`: and the sender was told so)."""
        rid = header["request_id"]
        trace.mark(rid, "agent.begin")
        if not verify(self._secret, rid, header.get("auth")):
            # Leave the sink be: its real sender may still begin.
            why = "begin without a valid proof of the cluster secret"
            self._reply(peer, _abort(rid, why, UNAUTHENTICATED))
            return False
        sink = self._get(rid)
        if sink is None or sink.state is not State.RESERVED:
            self._reply(peer, _abort(rid, f"no open reservation for {rid!r}: {_describe(sink)}"))
            return False
        try:
            sender_layout = KVLayout.from_dict(header.get("layout", {}))
            self.layout.check(sender_layout, "on the receiver", "on the sender")
            if header.get("num_blocks") != len(sink.block_ids):
                raise TransferError(
                    f"sender has {header.get('num_blocks')} blocks, sink {len(sink.block_ids)}"
                )
            written = None if "writer" not in header else self._writer(header["writer"])
        except TransferError as exc:
            self._fail(sink, str(exc), notify=True, peer=peer, error=_code(exc))
            return False
        with self._lock:
            accepted = sink.state is State.RESERVED  # not expired or aborted meanwhile
            if accepted:
                sink.state, sink.peer = State.RECEIVING, peer
                sink.direct, sink.written = "writer" in header, written
        if not accepted:
            self._reply(peer, _abort(rid, f"reservation {_describe(sink)}"))
        elif accept:
            self._reply(peer, Frame({"kind": ACCEPT, "request_id": rid}))
        return accepted

    def _on_layer(self, header: dict[str, Any], payload: torch.Tensor | None, peer: str) -> None:
        rid, layer = header["request_id"], header.get("layer")
        sink = self._get(rid)
        if sink is None:
            return
        error, ready = None, False
        with sink.write_lock:
            with self._lock:
                if sink.state is not State.RECEIVING or sink.peer != peer:
                    return  # aborted or expired while the sender streams on: drop the bytes
            want = self._frame_shape(sink, header)
            count = header.get("layers", 1)
            whole = isinstance(layer, int) and isinstance(count, int) and count >= 1
            layers = range(layer, layer + count) if whole else range(0)
            if not layers or not 0 <= layer <= layers[-1] < self.layout.num_layers:
                error = f"bad layer index {layer!r} (x{count!r})"
            elif dup := sink.layers.intersection(layers):
                error = f"layers {sorted(dup)} sent twice"
            elif sink.direct and payload is not None:
                error = f"layer {layer}: an ipc transfer's layers carry no payload"
            elif not sink.direct and (payload is None or (
                payload.shape, payload.dtype, payload.device
            ) != (want, self.layout.torch_dtype, self._device)):
                error = f"layer {layer} payload is not {want} {self.layout.dtype}"
            else:
                landed = sink.written  # ipc: the sender's event, after its writes
                if payload is not None:
                    staged = payload.view(count, *self._layer_shape(sink))
                    landed = sink.landed = self._scatter(sink, layer, staged, payload)
                last = len(sink.layers) + count == self.layout.num_layers
                # Ready means the bytes are in place: wait, bounded by the TTL, for the
                # last scatter or write; a stuck one ends the connection.
                if last and landed is not None and not poll_until(landed.query, sink.deadline):
                    raise TransferError(f"layer {layers[-1]} did not land before the TTL")
                with self._lock:
                    sink.layers.update(layers)
                    ready = last
                    if ready:
                        sink.state = State.READY
        if error is not None:
            self._fail(sink, error, notify=True)
        elif ready:
            trace.mark(rid, "agent.ready")
            sink.done.set()
            _call(self._on_ready, rid)

    def _scatter(
        self, sink: _Sink, first: int, staged: torch.Tensor, payload: torch.Tensor
    ) -> torch.cuda.Event | None:
        """Enqueue the scatter of `staged` (a view of `payload`) into the sink's blocks and
        hand the buffer back; on CUDA, the event after the scatter. The scatter runs on
        the agent's own stream, after the bytes landed (the connector made the current
        stream wait for them), so neither the next frame's receive nor the engine's work
        waits for it, and it waits for neither."""
        if self._stream is None:
            self._rows.scatter(first, sink.index, staged)
            self._buffers.give(payload)
            return None
        self._stream.wait_stream(torch.cuda.current_stream(self._device))
        with torch.cuda.stream(self._stream):
            self._rows.scatter(first, sink.index, staged)
        payload.record_stream(self._stream)  # the allocator must not reuse it before
        sink.index.record_stream(self._stream)  # (nor the ids, made on `_copies`)
        landed = torch.cuda.Event()
        landed.record(self._stream)
        self._buffers.give(payload, landed)
        return landed

    def _writer(self, writer: Any) -> torch.cuda.Event | None:
        """The event an ipc sender records after its writes (None on CPU, where they are
        done before it says so); raises TransferError if this side takes no writes."""
        if self._guard is None:
            raise TransferError(f"the sender writes through ipc, this receiver takes "
                                f"{self._connector.name}")
        try:
            pid, handle = int(writer["pid"]), writer.get("event")
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise TransferError(f"bad ipc writer: {exc!r}") from exc
        if handle is None or self._device.type != "cuda":
            return None
        return self._connector.mapped.event(pid, str(handle), self._device)

    def _on_end(self, header: dict[str, Any], _: torch.Tensor | None, peer: str,
                done: list[str] | None = None) -> None:
        """`done`: where a sink that is done goes, to be answered with others (else its
        done is sent now)."""
        rid = header["request_id"]
        trace.mark(rid, "agent.end")
        with self._lock:
            sink = self._sinks.get(rid)
            state = None if sink is None or sink.peer != peer else sink.state
        if state in (State.READY, State.RELEASED):
            if done is None:
                self._reply(peer, Frame({"kind": DONE, "request_id": rid}))
            else:
                done.append(rid)
            token = header.get("first_token")
            if state is State.READY and isinstance(token, int):
                _call(self._on_first_token, rid, token)
        elif state is State.RECEIVING:
            assert sink is not None
            got = f"{len(sink.layers)} of {self.layout.num_layers}"
            self._fail(sink, f"sender ended after {got} layers", notify=True)
        else:
            self._reply(peer, _abort(rid, f"transfer for {rid!r} is {_describe(sink)}"))

    def _on_abort(self, header: dict[str, Any], _: torch.Tensor | None, peer: str) -> None:
        rid = header["request_id"]
        sink = self._get(rid)
        if sink is None:
            return
        with self._lock:
            accepted = sink.peer
        # Before begin any peer with the secret may abort (a sender whose own layout check
        # failed); after it, only the connection that began.
        if accepted == peer or (accepted is None and verify(self._secret, rid,
                                                            header.get("auth"))):
            self._fail(sink, f"aborted by sender: {header.get('reason', '')}")

    def _on_error(self, peer: str, exc: Exception) -> None:
        with self._lock:
            lost = [s for s in self._sinks.values() if s.peer == peer and s.state in _LIVE]
        for sink in lost:
            self._fail(sink, f"sender connection lost: {exc}")

    # -- failure and expiry --------------------------------------------------------------

    def _fail(
        self,
        sink: _Sink,
        reason: str,
        from_states: tuple[State, ...] = _LIVE,
        *,
        notify: bool = False,
        peer: str | None = None,
        error: str | None = None,
    ) -> bool:
        """Move a sink to FAILED and free its blocks, once; False if it had already ended.
        `notify` tells the sender (`peer`, or the sink's) with an abort frame."""
        with sink.write_lock:
            with self._lock:
                if self._sinks.get(sink.request_id) is not sink or sink.state not in from_states:
                    return False
                # ipc: a live sink's tags are open until it fails, a ready one's until
                # it is released
                writable = self._guard is not None and sink.state in (*_LIVE, State.READY)
                sink.state, sink.reason, sink.ended_at = State.FAILED, reason, time.monotonic()
                self._ended.append(sink)
                peer = peer or sink.peer
        if writable:  # ipc: a sender may be writing, or about to: close the blocks first
            assert self._guard is not None
            self._guard.close(sink.index)
            time.sleep(WriteGuard.SETTLE_S)
        sink.done.set()
        log.info("KV transfer %s failed: %s", sink.request_id, reason)
        grace = time.monotonic() + _LANDING_GRACE_S
        if sink.landed is None or poll_until(sink.landed.query, grace):
            with self._lock:
                self._owned.difference_update(sink.block_ids)
            try:
                self._free_blocks(list(sink.block_ids))
            except Exception:  # the caller's pool must not take the reaper or a connection down
                log.exception("free_blocks failed for %s", sink.request_id)
        else:  # a scatter may still write them: leaked beats corrupting their next owner
            log.error("KV transfer %s: blocks %s leaked, a scatter into them never ran",
                      sink.request_id, list(sink.block_ids))
        if notify and peer is not None:  # after the free: an abort means the blocks are back
            self._reply(peer, _abort(sink.request_id, reason, error))
        _call(self._on_failed, sink.request_id, reason)
        return True

    def _reply(self, peer: str, frame: Frame) -> None:
        try:
            self._receiver.reply(peer, frame)
        except TransferError as exc:  # the sender is gone; its own timeouts end its side
            log.debug("reply to %s dropped: %s", peer, exc)

    def _reap_loop(self) -> None:
        while not self._stop.wait(self._reap_interval_s):
            now = time.monotonic()
            expired = []
            with self._lock:
                while self._deadlines and self._deadlines[0][0] <= now:
                    sink = heapq.heappop(self._deadlines)[2]
                    if sink.state in (*_LIVE, State.READY):
                        expired.append(sink)
                # ended_at is set only on FAILED and RELEASED: tombstones kept for status().
                while self._ended and now - self._ended[0].ended_at > self._keep_s:
                    sink = self._ended.popleft()
                    if self._sinks.get(sink.request_id) is sink:  # not since reserved again
                        del self._sinks[sink.request_id]
            for sink in expired:
                self._fail(sink, f"reservation expired after {sink.ttl_s:g}s",
                           (*_LIVE, State.READY), notify=True)


def _abort(request_id: str, reason: str, error: str | None = None) -> Frame:
    header: dict[str, Any] = {"kind": ABORT, "request_id": request_id, "reason": reason}
    if error is not None:
        header["error"] = error
    return Frame(header)


def _describe(sink: _Sink | None) -> str:
    return "unknown" if sink is None else f"{sink.state.value} ({sink.reason})"


def _code(exc: TransferError) -> str | None:
    return LAYOUT_MISMATCH if isinstance(exc, LayoutMismatch) else None


def _call(callback: Callable[..., None] | None, *args: Any) -> None:
    """Run a caller's callback; its bug must not break the connection it runs on."""
    if callback is None:
        return
    try:
        callback(*args)
    except Exception:
        log.exception("KV transfer callback %r failed", callback)
