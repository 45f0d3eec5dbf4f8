"""The receiving side of KV transfers against hostile or broken peers, over real loopback
sockets into a real TransferAgent: nothing is allocated for a payload before its header
was checked against the bytes and against a sink of the connection; with a cluster
secret, a forged begin or abort changes nothing; the tcp receiver caps its connections
and closes idle ones."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from kv_helpers import (
    MODEL,
    Inbox,
    PoolBlocks,
    assert_blocks_equal,
    assert_unchanged_except,
    clone,
    make_caches,
    wait_until,
)

from tandem.kvtransfer.agent import UNAUTHENTICATED, State, TransferAgent
from tandem.kvtransfer.auth import proof
from tandem.kvtransfer.connector import Allocator, Frame, LinkPool, TransferError
from tandem.kvtransfer.layout import KVLayout
from tandem.kvtransfer.messages import encode
from tandem.kvtransfer.sender import push
from tandem.kvtransfer.tcp import TcpConnector, TcpReceiver, parse_address
from tandem.kvtransfer.wire import MAGIC, PREFIX, VERSION, HostStaging, recv_frame, send_frame

NUM_BLOCKS = 16
SECRET = b"cluster secret"
GIB_OF_FLOAT32 = [1 << 28]


class AllocLog(TcpConnector):
    """The tcp connector, noting per payload the shape announced and the shape its
    receiver's allocator gave (None: it refused)."""

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self.allocs: list[tuple[list[int], list[int] | None]] = []

    def receiver(self, host, alloc, on_frame, on_error, port=0):  # noqa: ANN001, ANN201
        def noted(header: dict[str, Any]) -> torch.Tensor:
            try:
                out = alloc(header)
            except TransferError:
                self.allocs.append((header["shape"], None))
                raise
            self.allocs.append((header["shape"], list(out.shape)))
            return out

        return super().receiver(host, noted, on_frame, on_error, port)


@dataclass
class Dest:
    agent: TransferAgent
    caches: list[torch.Tensor]
    blocks: PoolBlocks
    layout: KVLayout
    connector: AllocLog


@contextmanager
def _dest(secret: bytes | None = None, **options: Any) -> Iterator[Dest]:
    caches = make_caches(NUM_BLOCKS, seed=2)
    blocks = PoolBlocks(NUM_BLOCKS)
    layout = KVLayout.of(caches, MODEL)
    connector = AllocLog(io_timeout=5.0, **options)
    agent = TransferAgent(caches, layout, connector, blocks.free, secret=secret)
    try:
        yield Dest(agent, caches, blocks, layout, connector)
    finally:
        agent.close()
        connector.close()


def _connect(address: str) -> socket.socket:
    sock = socket.create_connection(parse_address(address), timeout=5)
    sock.settimeout(5)
    return sock


def _raw(header: dict[str, Any] | bytes, payload_len: int) -> bytes:
    """A frame's prefix and header as a peer may write them, true to its payload or not:
    a message of the protocol, or (bytes) an envelope built by hand."""
    head = header if isinstance(header, bytes) else encode(header)
    return PREFIX.pack(MAGIC, VERSION, len(head), payload_len) + head


def _envelope(kind: int, fields: bytes) -> bytes:
    """An envelope holding message `kind` (its field number) of raw `fields`, whatever
    their types: protobuf's wire format by hand (a tag, a length, the bytes)."""
    assert len(fields) < 128  # a one-byte length
    return bytes([kind << 3 | 2, len(fields)]) + fields


# A layer 0 of "r" with a payload announced as (4,) float32, field by field: request_id
# (1, a string), layer (2, a varint), dtype (4, a string), shape (5, packed varints).
_LAYER_FIELDS = b"\x0a\x01r" + b"\x10\x00" + b"\x22\x07float32" + b"\x2a\x01\x04"
_LAYER, _END = 3, 4


def _no_payload(header: dict[str, Any]) -> torch.Tensor:
    raise AssertionError(f"a reply with a payload: {header}")


def _reply(sock: socket.socket) -> dict[str, Any]:
    frame = recv_frame(sock, _no_payload, HostStaging())
    assert frame is not None, "the receiver closed the connection"
    return frame.header


def _closed_by_receiver(sock: socket.socket, timeout: float) -> bool:
    """The receiver closed `sock` within `timeout` (bytes before the EOF are skipped)."""
    sock.settimeout(timeout)
    try:
        while sock.recv(1 << 16):
            pass
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False
    return True


def _begin(d: Dest, rid: str, n: int, auth: str | None = None) -> Frame:
    header = {"kind": "begin", "request_id": rid, "layout": d.layout.to_dict(),
              "num_blocks": n}
    if auth is not None:
        header["auth"] = auth
    return Frame(header)


def _layer(rid: str, layer: int, src: list[torch.Tensor], ids: list[int]) -> Frame:
    return Frame({"kind": "layer", "request_id": rid, "layer": layer},
                 src[layer][:, ids].contiguous())


def _open(d: Dest, rid: str, ids: list[int], auth: str | None = None) -> socket.socket:
    """A raw connection on which `rid`'s transfer was begun and accepted."""
    sock = _connect(d.agent.address)
    send_frame(sock, _begin(d, rid, len(ids), auth), HostStaging())
    assert _reply(sock) == {"kind": "accept", "request_id": rid}
    return sock


# -- nothing is allocated before it is checked ---------------------------------------------


def _recording() -> tuple[Allocator, list[dict[str, Any]]]:
    calls: list[dict[str, Any]] = []

    def alloc(header: dict[str, Any]) -> torch.Tensor:
        calls.append(header)
        return torch.empty(header["shape"], dtype=getattr(torch, header["dtype"]))

    return alloc, calls


@pytest.mark.parametrize(
    ("header", "payload_len", "error"),
    [
        ({"dtype": "float32", "shape": [4]}, 15, r"\(4,\) torch.float32 payload announced as 15"),
        ({"dtype": "float32", "shape": GIB_OF_FLOAT32}, 16, "announced as 16 bytes"),
        ({"dtype": "float99", "shape": [4]}, 16, "unknown dtype 'float99'"),
        ({"dtype": "Tensor", "shape": [4]}, 16, "unknown dtype 'Tensor'"),
        ({"dtype": "float32", "shape": [-4, -1]}, 16, r"bad payload shape \[-4, -1\]"),
        ({"dtype": "float32", "shape": [1] * 9}, 4, "bad payload shape"),
        ({}, 16, "bad payload shape None"),
        # shape 1.5: a double (wire type 1) where varints belong
        (_envelope(_LAYER, _LAYER_FIELDS[:-3] + b"\x29" + b"\0" * 6 + b"\xf8\x3f"), 4,
         "layer message with unknown or mistyped fields"),
        # dtype 16: a varint where a string belongs
        (_envelope(_LAYER, _LAYER_FIELDS[:5] + b"\x20\x10" + _LAYER_FIELDS[-3:]), 16,
         "layer message with unknown or mistyped fields"),
        # a payload on a frame of another kind: an end with a layer's fields
        (_envelope(_END, _LAYER_FIELDS), 16, "end message with unknown or mistyped fields"),
        (_envelope(_LAYER, _LAYER_FIELDS[5:]), 16, "layer message without request_id"),
        (_envelope(_LAYER, _LAYER_FIELDS)[:-1], 16, "not a transfer message"),
    ],
)
def test_wire_checks_the_announced_payload_before_allocating(
    header: dict[str, Any] | bytes, payload_len: int, error: str
) -> None:
    alloc, calls = _recording()
    if isinstance(header, dict):
        header = {"kind": "layer", "request_id": "r", "layer": 0, **header}
    a, b = socket.socketpair()
    with a, b:
        b.settimeout(5)
        a.sendall(_raw(header, payload_len) + b"\0" * 16)
        with pytest.raises(TransferError, match=error):
            recv_frame(b, alloc, HostStaging())
    assert calls == []


@pytest.mark.parametrize("raw", [b"[1, 2]", b'{"kind": "end"}', b"\xff\xfe", b"",
                                 _envelope(15, b"")])
def test_wire_refuses_a_header_that_is_no_transfer_message(raw: bytes) -> None:
    alloc, calls = _recording()
    a, b = socket.socketpair()
    with a, b:
        b.settimeout(5)
        a.sendall(PREFIX.pack(MAGIC, VERSION, len(raw), 0) + raw)
        with pytest.raises(TransferError, match="frame header is"):
            recv_frame(b, alloc, HostStaging())
    assert calls == []


def test_wire_allocates_exactly_what_a_consistent_header_announces() -> None:
    alloc, calls = _recording()
    payload = torch.arange(6, dtype=torch.float32).view(2, 3)
    a, b = socket.socketpair()
    with a, b:
        b.settimeout(5)
        send_frame(a, Frame({"kind": "layer", "request_id": "r", "layer": 0}, payload),
                   HostStaging())
        got = recv_frame(b, alloc, HostStaging())
    assert calls == [{"kind": "layer", "request_id": "r", "layer": 0, "dtype": "float32",
                      "shape": [2, 3]}]
    assert got is not None and got.payload is not None and torch.equal(got.payload, payload)


def test_a_length_that_disagrees_with_the_shape_ends_the_connection() -> None:
    with _dest() as d:
        ids = d.blocks.allocate(2)
        d.agent.reserve("r", ids, ttl_s=60)
        with _open(d, "r", ids) as sock:
            shape = list(d.layout.staging_shape(2))
            sock.sendall(_raw({"kind": "layer", "request_id": "r", "layer": 0,
                               "dtype": "float32", "shape": shape}, 1 << 30))
            assert _closed_by_receiver(sock, timeout=2)
        assert wait_until(lambda: d.blocks.frees == [ids])
        status = d.agent.status("r")
        assert status.state is State.FAILED and status.layers_received == 0
        assert status.reason == (f"sender connection lost: {tuple(shape)} torch.float32 "
                                 f"payload announced as {1 << 30} bytes")
        assert d.connector.allocs == []


def test_a_layer_bigger_than_its_sink_is_refused_before_allocation() -> None:
    with _dest() as d:
        before = clone(d.caches)
        ids = d.blocks.allocate(2)
        d.agent.reserve("r", ids, ttl_s=60)
        with _open(d, "r", ids) as sock:
            t0 = time.monotonic()
            # 1 GiB, consistently announced; the bytes never come.
            sock.sendall(_raw({"kind": "layer", "request_id": "r", "layer": 0,
                               "dtype": "float32", "shape": GIB_OF_FLOAT32}, 1 << 30))
            # At once, not after io_timeout (5 s) waiting for bytes read into 1 GiB.
            assert _closed_by_receiver(sock, timeout=2)
            assert time.monotonic() - t0 < 2
        assert d.connector.allocs == [(GIB_OF_FLOAT32, None)]
        assert wait_until(lambda: d.agent.status("r").state is State.FAILED)
        assert d.agent.status("r").reason == (
            "sender connection lost: refused a (268435456,) torch.float32 payload for 'r': "
            "receiving (None), not a layer this connection sends into"
        )
        time.sleep(0.2)  # a second free would come by now
        assert d.blocks.frees == [ids] and d.blocks.num_free == NUM_BLOCKS
        assert not d.agent.abort("r")
        assert_unchanged_except(before, d.caches, [])


@pytest.mark.parametrize(
    ("change", "shape"),
    [
        ({"dtype": "bfloat16"}, [2, 2, 4, 2, 8]),  # the sink's shape, not its dtype
        ({"layers": 2}, [2, 2, 4, 2, 8]),  # a stacked frame's header, one layer's bytes
        ({"layers": 1 << 20}, [1 << 20, 2, 2, 4, 2, 8]),  # more layers than the model has
        # (a payload on a frame of another kind: no such message, see above)
    ],
)
def test_a_payload_that_is_no_layer_of_the_sink_is_refused(
    change: dict[str, Any], shape: list[int]
) -> None:
    with _dest() as d:
        ids = d.blocks.allocate(2)
        d.agent.reserve("r", ids, ttl_s=60)
        with _open(d, "r", ids) as sock:
            header = {"kind": "layer", "request_id": "r", "layer": 0, "dtype": "float32",
                      "shape": shape, **change}
            dtype = getattr(torch, header["dtype"])
            nbytes = torch.Size(shape).numel() * dtype.itemsize
            sock.sendall(_raw(header, nbytes))
            assert _closed_by_receiver(sock, timeout=2)
        assert d.connector.allocs == [(shape, None)]
        assert wait_until(lambda: d.blocks.frees == [ids])
        assert "refused a" in (d.agent.status("r").reason or "")


def test_a_layer_into_another_connections_sink_closes_only_its_own_connection() -> None:
    with _dest() as d:
        src = make_caches(NUM_BLOCKS, seed=1)
        ids = d.blocks.allocate(2)
        d.agent.reserve("r", ids, ttl_s=60)
        with _open(d, "r", ids) as owner, _connect(d.agent.address) as intruder:
            send_frame(intruder, _layer("r", 0, src, [5, 6]), HostStaging())
            assert _closed_by_receiver(intruder, timeout=2)
            assert d.agent.status("r").state is State.RECEIVING
            for layer in range(d.layout.num_layers):
                send_frame(owner, _layer("r", layer, src, [0, 1]), HostStaging())
            send_frame(owner, Frame({"kind": "end", "request_id": "r"}), HostStaging())
            assert _reply(owner) == {"kind": "done", "request_id": "r"}
        shape = [2, 2, 4, 2, 8]
        assert d.connector.allocs == [(shape, None)] + [(shape, shape)] * 4
        assert d.agent.release("r") == tuple(ids)
        assert_blocks_equal(d.caches, ids, src, [0, 1])
        assert d.blocks.frees == []


def test_layers_still_streaming_into_an_aborted_sink_are_drained_in_step() -> None:
    with _dest() as d:
        before = clone(d.caches)
        src = make_caches(NUM_BLOCKS, seed=1)
        ids, more = d.blocks.allocate(2), d.blocks.allocate(2)
        d.agent.reserve("r", ids, ttl_s=60)
        d.agent.reserve("s", more, ttl_s=60)
        with _open(d, "r", ids) as sock:
            send_frame(sock, _layer("r", 0, src, [0, 1]), HostStaging())
            assert wait_until(lambda: d.agent.status("r").layers_received == 1)
            assert d.agent.abort("r", "client went away")
            # The sender had layer 1 on its way before it read the abort: its bytes are
            # read (into scratch of the sink's size) and dropped; the stream stays in step.
            send_frame(sock, _layer("r", 1, src, [0, 1]), HostStaging())
            assert _reply(sock) == {"kind": "abort", "request_id": "r",
                                    "reason": "client went away"}
            send_frame(sock, _begin(d, "s", 2), HostStaging())
            assert _reply(sock) == {"kind": "accept", "request_id": "s"}
        shape = [2, 2, 4, 2, 8]
        assert d.connector.allocs == [(shape, shape), (shape, shape)]
        assert d.agent.status("r").layers_received == 1
        assert wait_until(lambda: d.blocks.frees == [ids, more])  # "s": its sender left
        assert_unchanged_except(before, d.caches, ids)


# -- the cluster secret ----------------------------------------------------------------


def _refused(rid: str) -> dict[str, Any]:
    return {"kind": "abort", "request_id": rid, "error": UNAUTHENTICATED,
            "reason": "begin without a valid proof of the cluster secret"}


def test_only_a_begin_that_proves_the_secret_opens_the_sink() -> None:
    with _dest(secret=SECRET) as d:
        src = make_caches(NUM_BLOCKS, seed=1)
        before = clone(d.caches)
        ids = d.blocks.allocate(3)
        d.agent.reserve("r", ids, ttl_s=60)
        sender = d.connector.sender(d.agent.address)
        try:
            # (a proof of another type can't be sent: see test_transfer_messages.py)
            forged = [None, proof(b"another secret", "r"), proof(SECRET, "other"), ""]
            for auth in forged:
                header = {**_begin(d, "r", 3).header, "auth": auth}
                sender.send(Frame(header))
                reply = sender.poll(5)
                assert reply is not None and reply.header == _refused("r")
                assert d.agent.status("r").state is State.RESERVED
            sender.send(_begin(d, "r", 3, proof(SECRET, "r")))
            reply = sender.poll(5)
            assert reply is not None and reply.header == {"kind": "accept", "request_id": "r"}
            for layer in range(d.layout.num_layers):
                sender.send(_layer("r", layer, src, [4, 0, 9]))
            sender.send(Frame({"kind": "end", "request_id": "r"}))
            reply = sender.poll(5)
            assert reply is not None and reply.header == {"kind": "done", "request_id": "r"}
        finally:
            sender.close()
        assert d.agent.release("r") == tuple(ids)
        assert_blocks_equal(d.caches, ids, src, [4, 0, 9])
        assert_unchanged_except(before, d.caches, ids)
        assert d.blocks.frees == []


def test_an_abort_from_another_connection_needs_the_secret() -> None:
    with _dest(secret=SECRET) as d:
        ids = d.blocks.allocate(2)
        d.agent.reserve("r", ids, ttl_s=60)
        with _connect(d.agent.address) as sock:
            for auth in (None, proof(b"another secret", "r"), proof(SECRET, "other")):
                header = {"kind": "abort", "request_id": "r", "reason": "forged"}
                send_frame(sock, Frame(header if auth is None else {**header, "auth": auth}),
                           HostStaging())
            # Frames of one connection are handled in order: once this is answered,
            # the aborts before it were handled.
            send_frame(sock, Frame({"kind": "end", "request_id": "r"}), HostStaging())
            assert _reply(sock)["kind"] == "abort"
            assert d.agent.status("r").state is State.RESERVED and d.blocks.frees == []
            header = {"kind": "abort", "request_id": "r", "reason": "gave up",
                      "auth": proof(SECRET, "r")}
            send_frame(sock, Frame(header), HostStaging())
            assert wait_until(lambda: d.blocks.frees == [ids])
        status = d.agent.status("r")
        assert (status.state, status.reason) == (State.FAILED, "aborted by sender: gave up")


def test_a_begun_transfer_ignores_aborts_from_other_connections_even_with_the_secret() -> None:
    with _dest(secret=SECRET) as d:
        ids = d.blocks.allocate(2)
        d.agent.reserve("r", ids, ttl_s=60)
        with _open(d, "r", ids, proof(SECRET, "r")) as owner, \
                _connect(d.agent.address) as other:
            header = {"kind": "abort", "request_id": "r", "reason": "x",
                      "auth": proof(SECRET, "r")}
            send_frame(other, Frame(header), HostStaging())
            send_frame(other, Frame({"kind": "end", "request_id": "r"}), HostStaging())
            assert _reply(other)["kind"] == "abort"
            assert d.agent.status("r").state is State.RECEIVING
            send_frame(owner, Frame({"kind": "abort", "request_id": "r", "reason": "y"}),
                       HostStaging())
            assert wait_until(lambda: d.blocks.frees == [ids])
        assert d.agent.status("r").reason == "aborted by sender: y"


def test_without_a_secret_no_proof_is_asked_for() -> None:
    with _dest() as d:
        ids = d.blocks.allocate(1)
        d.agent.reserve("r", ids, ttl_s=60)
        with _open(d, "r", ids):
            assert d.agent.status("r").state is State.RECEIVING


# -- the tcp receiver's bounds -----------------------------------------------------------


@contextmanager
def _receiver(**options: Any) -> Iterator[tuple[TcpReceiver, Inbox]]:
    inbox = Inbox()
    receiver = TcpConnector(**options).receiver("127.0.0.1", inbox.alloc, inbox.on_frame,
                                                inbox.on_error)
    try:
        yield receiver, inbox
    finally:
        receiver.close()


def _receiving_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name.startswith("tcp-recv-")}


def test_connections_beyond_the_cap_are_closed_at_once() -> None:
    with _receiver(max_connections=2) as (receiver, inbox):
        first, second = _connect(receiver.address), _connect(receiver.address)
        with first, second:
            assert wait_until(lambda: receiver.connections == 2)
            with _connect(receiver.address) as third:
                assert _closed_by_receiver(third, timeout=2)
            assert receiver.connections == 2 and inbox.errors == []
            for i, sock in enumerate((first, second)):
                send_frame(sock, Frame({"kind": "end", "request_id": f"{i}"}), HostStaging())
            assert inbox.wait(frames=2, timeout=5)
            assert sorted(f.header["request_id"] for f in inbox.frames) == ["0", "1"]
            first.close()
            assert wait_until(lambda: receiver.connections == 1)
            with _connect(receiver.address) as fourth:  # room again
                send_frame(fourth, Frame({"kind": "end", "request_id": "4"}), HostStaging())
                assert inbox.wait(frames=3, timeout=5)
                assert receiver.connections == 2


def test_an_idle_connection_is_closed_and_its_thread_ends() -> None:
    with _receiver(idle_timeout_s=0.3) as (receiver, inbox):
        threads = _receiving_threads()
        with _connect(receiver.address) as sock:
            t0 = time.monotonic()
            assert wait_until(lambda: receiver.connections == 1)
            (mine,) = _receiving_threads() - threads
            send_frame(sock, Frame({"kind": "end", "request_id": "r"}),
                       HostStaging())  # idle from here on
            assert _closed_by_receiver(sock, timeout=3)
            assert 0.3 <= time.monotonic() - t0 < 2
        mine.join(timeout=2)
        assert not mine.is_alive() and receiver.connections == 0
        assert [f.header for f in inbox.frames] == [{"kind": "end", "request_id": "r"}]
        assert [str(exc) for _, exc in inbox.errors] == ["timed out waiting for a frame"]


def test_a_connection_with_a_transfer_in_flight_is_not_closed_as_idle() -> None:
    with _dest(idle_timeout_s=0.2) as d:
        src = make_caches(NUM_BLOCKS, seed=1)
        ids = d.blocks.allocate(2)
        d.agent.reserve("r", ids, ttl_s=60)
        with _open(d, "r", ids) as sock:
            assert not _closed_by_receiver(sock, timeout=1.0)  # RECEIVING: kept open
            for layer in range(d.layout.num_layers):
                send_frame(sock, _layer("r", layer, src, [0, 1]), HostStaging())
            send_frame(sock, Frame({"kind": "end", "request_id": "r"}), HostStaging())
            assert _reply(sock) == {"kind": "done", "request_id": "r"}
            assert _closed_by_receiver(sock, timeout=2)  # ready: nothing in flight
        assert d.agent.status("r").state is State.READY and d.blocks.frees == []


def test_a_sender_does_not_reuse_a_parked_connection_the_receiver_closed() -> None:
    with _dest(idle_timeout_s=0.3) as d:
        sender_side = TcpConnector()  # parks connections for a minute
        src = make_caches(NUM_BLOCKS, seed=1)
        try:
            push(sender_side, d.agent.reserve("a", [1, 2], ttl_s=30), src, [0, 1], d.layout)
            assert d.agent.wait_ready("a", timeout=5)
            time.sleep(1.0)  # the receiver closes the parked connection meanwhile
            push(sender_side, d.agent.reserve("b", [3, 4], ttl_s=30), src, [2, 3], d.layout)
            assert d.agent.wait_ready("b", timeout=5)
        finally:
            sender_side.close()
        assert_blocks_equal(d.caches, [1, 2, 3, 4], src, [0, 1, 2, 3])


def test_parked_connections_are_dropped_after_their_max_age() -> None:
    closed: list[str] = []
    opened = iter(["new"])
    pool = LinkPool(1, lambda conn: True, closed.append, max_age_s=0.1)
    assert pool.take("x", 1, lambda: next(opened)) == "new"
    pool.give("x", "young")
    assert pool.take("x", 1, lambda: "unused") == "young" and closed == []
    pool.give("x", "old")
    time.sleep(0.15)
    assert pool.take("x", 1, lambda: "fresh") == "fresh" and closed == ["old"]


def test_a_closed_pool_closes_what_comes_back_and_fails_its_waiters() -> None:
    closed: list[str] = []
    pool = LinkPool(1, lambda conn: True, closed.append)
    assert pool.take("x", 1, lambda: "busy") == "busy"
    failed: list[BaseException] = []

    def wait() -> None:
        try:
            pool.take("x", 30, lambda: "never")
        except TransferError as exc:
            failed.append(exc)

    waiter = threading.Thread(target=wait)
    waiter.start()
    time.sleep(0.1)
    start = time.monotonic()
    pool.close()
    waiter.join(5)
    assert time.monotonic() - start < 1 and "closed" in str(failed[0])
    pool.give("x", "busy")  # its sender ends after the close: closed, not parked
    assert closed == ["busy"]
