"""The nccl connector on CPU through its gloo backend (the same code path as NCCL, whose
tests at the end need two GPUs), its own cases: connections parked for reuse; dead,
silent, stalled and closed peers end in bounded time; a backend mismatch is refused.
What every connector must do runs in test_connectors.py."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from frame_helpers import (
    FRAMES,
    assert_frames_exact,
    bye,
    numbered_frame,
    push_kv,
    send_frames_and_await_reply,
)
from kv_helpers import (
    MODEL,
    Inbox,
    assert_blocks_equal,
    assert_unchanged_except,
    clone,
    join_all,
    make_caches,
    spawn,
)

from tandem.kvtransfer import auth
from tandem.kvtransfer.agent import TransferAgent
from tandem.kvtransfer.connector import Frame, TransferError, get_connector
from tandem.kvtransfer.layout import KVLayout
from tandem.kvtransfer.nccl import HELLO, NcclConnector
from tandem.kvtransfer.tcp import TcpConnector

GLOO = {"backend": "gloo"}  # get_connector options: nccl's code path on CPU
two_gpus = pytest.mark.skipif(
    torch.cuda.device_count() < 2, reason="needs two CUDA devices (nvidia-h200-x2)"
)


def _connector(backend: str = "gloo", **options: Any) -> NcclConnector:
    connector = get_connector("nccl", backend=backend, **options)
    assert isinstance(connector, NcclConnector)
    return connector


@pytest.fixture
def inbox() -> Iterator[tuple[Inbox, Any]]:
    box = Inbox()
    receiver = _connector().receiver("127.0.0.1", box.alloc, box.on_frame, box.on_error)
    yield box, receiver
    receiver.close()


# -- frames ----------------------------------------------------------------------------


def test_senders_reuse_at_most_max_links_connections_and_wait_for_one(inbox) -> None:  # noqa: ANN001
    box, receiver = inbox
    connector = _connector(max_links=2)
    first = connector.sender(receiver.address)
    first.send(numbered_frame(0, 0))
    assert box.wait(frames=1)
    receiver.reply(box.frames[0].peer, bye(0))  # never read by `first`
    time.sleep(0.1)
    first.close()
    with pytest.raises(TransferError, match="closed"):
        first.send(numbered_frame(0, 1))
    second = connector.sender(receiver.address)
    assert second.poll(0.2) is None  # the stale reply was dropped
    second.send(numbered_frame(0, 1))
    assert box.wait(frames=2)
    assert box.frames[1].peer == box.frames[0].peer and box.errors == []  # one connection
    third = connector.sender(receiver.address)  # the parked one is in use: a new one
    third.send(numbered_frame(0, 2))
    assert box.wait(frames=3) and box.frames[2].peer != box.frames[0].peer
    got: list[Any] = []
    waiter = threading.Thread(target=lambda: got.append(connector.sender(receiver.address)))
    waiter.start()
    waiter.join(0.5)
    assert got == []  # both connections are in use: it waits for one, opening none
    third.close()
    waiter.join(5)
    fourth = got[0]
    fourth.send(numbered_frame(0, 3))
    assert box.wait(frames=4) and box.frames[3].peer == box.frames[2].peer
    second.close()
    fourth.close()
    receiver.close()
    with pytest.raises(TransferError, match="cannot connect"):
        connector.sender(receiver.address, connect_timeout=1)  # the parked ones are dropped
    assert box.errors == []  # close() is not an error


def test_a_sender_waits_no_longer_than_io_timeout_for_a_busy_connection(inbox) -> None:  # noqa: ANN001
    _, receiver = inbox
    connector = _connector(max_links=1, io_timeout=0.5)
    busy = connector.sender(receiver.address)
    start = time.monotonic()
    with pytest.raises(TransferError, match="all 1 connections .* stayed busy"):
        connector.sender(receiver.address)
    assert 0.4 < time.monotonic() - start < 2
    busy.close()
    connector.sender(receiver.address).close()  # the parked one


def test_connect_to_a_dead_address_fails_fast() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens here once closed
    start = time.monotonic()
    with pytest.raises(TransferError, match="cannot connect"):
        _connector().sender(f"nccl://127.0.0.1:{port}", connect_timeout=2)
    assert time.monotonic() - start < 2.5


def test_connect_to_a_silent_listener_times_out() -> None:
    with socket.create_server(("127.0.0.1", 0)) as silent:  # accepts, never answers
        start = time.monotonic()
        with pytest.raises(TransferError, match="no handshake"):
            _connector().sender(f"nccl://127.0.0.1:{silent.getsockname()[1]}", connect_timeout=1)
        assert time.monotonic() - start < 2.0


def test_a_stalled_receiver_times_the_sender_out() -> None:
    box = Inbox()
    release = threading.Event()

    def slow(frame: Frame) -> None:
        box.on_frame(frame)
        release.wait(10)  # the receiver stops reading after the first frame

    connector = _connector(io_timeout=1.0)
    receiver = connector.receiver("127.0.0.1", box.alloc, slow, box.on_error)
    try:
        s = connector.sender(receiver.address)
        s.send(numbered_frame(0, 0))
        start = time.monotonic()
        with pytest.raises(TransferError, match="gloo transfer failed"):
            s.send(numbered_frame(0, 1))  # its payload is never received
        assert time.monotonic() - start < 3
        with pytest.raises(TransferError):
            s.send(numbered_frame(0, 3))  # the connection is over
        release.set()
        assert box.wait(errors=1, timeout=5) and len(box.errors) == 1
    finally:
        release.set()
        receiver.close()


def test_receiver_close_fails_the_sender(inbox) -> None:  # noqa: ANN001
    box, receiver = inbox
    s = _connector().sender(receiver.address)
    s.send(numbered_frame(0, 0))
    assert box.wait(frames=1)
    receiver.close()
    with pytest.raises(TransferError):
        for i in range(3):  # the first write may still land in the socket buffer
            s.send(numbered_frame(0, i))
            time.sleep(0.1)
    assert box.errors == []  # close() is not an error
    s.close()


def test_backend_mismatch_is_refused(inbox) -> None:  # noqa: ANN001
    box, receiver = inbox
    control = TcpConnector().sender(receiver.address.replace("nccl://", "tcp://"))
    control.send(Frame({"kind": HELLO, "backend": "nccl"}))
    reply = control.poll(5)
    assert reply is not None and reply.header["kind"] == "abort"
    assert box.wait(errors=1, timeout=5)
    assert "backend 'nccl' here is 'gloo'" in str(box.errors[0][1])
    control.close()


def test_with_a_cluster_secret_only_a_proven_fresh_hello_gets_a_process_group() -> None:
    """No group is set up for a hello without the secret's proof, with another secret's,
    or for a hello copied off the wire; a sender with the secret gets through."""
    secret = b"cluster-secret"
    box = Inbox()
    receiver = _connector(secret=secret, setup_timeout=2).receiver(
        "127.0.0.1", box.alloc, box.on_frame, box.on_error)
    address = receiver.address.replace("nccl://", "tcp://")

    def hello(fields: dict[str, Any]) -> dict[str, Any]:
        control = TcpConnector().sender(address)
        control.send(Frame({"kind": HELLO, "backend": "gloo", **fields}))
        reply = control.poll(10)
        control.close()
        assert reply is not None
        return reply.header

    try:
        fresh = auth.hello_fields(secret)
        for fields, welcome in (({}, False), (auth.hello_fields(b"another-secret"), False),
                                (fresh, True), (fresh, False)):  # the last: a replay
            reply = hello(fields)
            assert (reply["kind"] != "abort") == welcome, reply
            if not welcome:
                assert reply["reason"] == "hello without a valid proof of the cluster secret"

        with pytest.raises(TransferError):
            _connector().sender(receiver.address, connect_timeout=5).send(numbered_frame(0, 0))
        proven = _connector(secret=secret).sender(receiver.address)
        proven.send(numbered_frame(1, 0))
        assert box.wait(frames=1) and box.frames[0].header["request_id"] == "1"
        proven.close()
    finally:
        receiver.close()


# -- NCCL between two GPUs (the lent nvidia-h200-x2) ----------------------------------


@pytest.mark.gpu
@two_gpus
def test_nccl_frames_between_two_gpus() -> None:
    torch.cuda.set_device("cuda:1")
    box = Inbox("cuda:1")
    receiver = _connector("nccl", device="cuda:1").receiver(
        "127.0.0.1", box.alloc, box.on_frame, box.on_error
    )
    procs = [spawn(send_frames_and_await_reply, "nccl", {"device": "cuda:0"}, receiver.address, 3,
                   "cuda:0")]
    try:
        assert box.wait(frames=FRAMES, timeout=60), f"{len(box.frames)} frames arrived"
        assert all(f.payload is None or f.payload.device == torch.device("cuda:1")
                   for f in box.frames)
        assert_frames_exact(box.frames, 3)
        receiver.reply(box.frames[0].peer, bye(3))
        join_all(*procs, timeout=60)
    finally:
        receiver.close()


@pytest.mark.gpu
@two_gpus
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_nccl_kv_push_between_two_gpus(dtype: str) -> None:
    torch.cuda.set_device("cuda:1")
    dst = make_caches(16, getattr(torch, dtype), seed=2, device="cuda:1")
    before = clone(dst)
    agent = TransferAgent(dst, KVLayout.of(dst, MODEL), _connector("nccl", device="cuda:1"),
                          lambda ids: None)
    try:
        sink_ids, src_ids = [9, 4, 14, 0], [2, 0, 7, 15]
        sink = agent.reserve("g", sink_ids, ttl_s=120)
        join_all(spawn(push_kv, "nccl", {"device": "cuda:0"}, sink.to_dict(), src_ids, dtype,
                       "cuda:0"), timeout=90)
        assert agent.wait_ready("g", timeout=10)
        src = make_caches(16, getattr(torch, dtype), seed=1)
        assert_blocks_equal(dst, sink_ids, src, src_ids)
        assert_unchanged_except(before, dst, sink_ids)
    finally:
        agent.close()
