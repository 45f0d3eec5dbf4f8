"""The nccl connector on CPU through its gloo backend (the same code path as NCCL, whose
tests at the end need two GPUs): frames arrive bit-exact and in order, across processes,
from concurrent senders; dead, stalled and killed peers end in bounded time; KV pushed
through the transfer agent lands exactly in the sink blocks and nowhere else."""

from __future__ import annotations

import multiprocessing
import os
import signal
import socket
import threading
import time
from collections.abc import Iterator
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
    concurrent_roundtrip,
    join_all,
    make_caches,
    roundtrip,
    spawn,
    wait_until,
)

from tandem.kvtransfer.agent import SinkInfo, State, TransferAgent
from tandem.kvtransfer.connector import Frame, TransferError, get_connector
from tandem.kvtransfer.layout import KVLayout
from tandem.kvtransfer.nccl import HELLO, NcclConnector
from tandem.kvtransfer.sender import KVPush, push
from tandem.kvtransfer.tcp import TcpConnector

FRAMES = 12
two_gpus = pytest.mark.skipif(
    torch.cuda.device_count() < 2, reason="needs two CUDA devices (nvidia-h200-x2)"
)


def _connector(backend: str = "gloo", **options: Any) -> NcclConnector:
    connector = get_connector("nccl", backend=backend, **options)
    assert isinstance(connector, NcclConnector)
    return connector


def _expected(sender: int, i: int, device: str = "cpu") -> torch.Tensor | None:
    """Frame i of sender `sender`: fp32, bf16, or no payload, with random bytes."""
    if i % 3 == 2:
        return None
    g = torch.Generator().manual_seed(1000 * sender + i)
    dtype = torch.float32 if i % 3 == 0 else torch.bfloat16
    return torch.randn(2, 3 + i, 4, 8, generator=g).to(dtype).to(device)


def _frame(sender: int, i: int, device: str = "cpu") -> Frame:
    return Frame({"kind": "t", "sender": sender, "i": i}, _expected(sender, i, device))


def assert_frames_exact(frames: list[Frame], sender: int) -> None:
    assert [f.header["i"] for f in frames] == list(range(FRAMES)), "order not kept"
    for f in frames:
        want = _expected(sender, f.header["i"])
        if want is None:
            assert f.payload is None and "shape" not in f.header
            continue
        assert f.payload is not None and f.payload.dtype == want.dtype
        assert f.header["dtype"] == str(want.dtype).removeprefix("torch.")
        assert f.header["shape"] == list(want.shape)
        # Bit-exact: compare the raw bytes, so bf16 and NaN payloads can't hide a difference.
        assert torch.equal(f.payload.cpu().view(torch.uint8), want.view(torch.uint8))


@pytest.fixture
def inbox() -> Iterator[tuple[Inbox, Any]]:
    box = Inbox()
    receiver = _connector().receiver("127.0.0.1", box.alloc, box.on_frame, box.on_error)
    yield box, receiver
    receiver.close()





# -- subprocess bodies (spawn) ---------------------------------------------------------


def send_frames_and_await_reply(
    address: str, sender: int, backend: str = "gloo", device: str = "cpu"
) -> None:
    """Send FRAMES frames, then wait for the receiver's reply naming this sender."""
    if device != "cpu":
        torch.cuda.set_device(device)
    connector = _connector(backend, device=device)
    s = connector.sender(address, connect_timeout=20)
    for i in range(FRAMES):
        s.send(_frame(sender, i, device), timeout=20)
    reply = s.poll(20)
    s.close()
    connector.close()
    assert reply is not None and reply.header == {"kind": "bye", "sender": sender}, reply


def send_two_frames_then_hang(address: str, sent: Any) -> None:
    s = _connector().sender(address, connect_timeout=20)
    s.send(_frame(7, 0))
    s.send(_frame(7, 1))
    sent.set()
    time.sleep(60)  # the parent SIGKILLs us long before this


def push_kv(sink: dict, src_ids: list[int], dtype_name: str, backend: str, device: str) -> None:
    if device != "cpu":
        torch.cuda.set_device(device)
    caches = make_caches(16, getattr(torch, dtype_name), seed=1, device=device)
    connector = _connector(backend, device=device)
    push(connector, SinkInfo.from_dict(sink), caches, src_ids, KVLayout.of(caches, MODEL),
         connect_timeout=20)


def push_some_layers_then_hang(sink: dict, src_ids: list[int], layers: int, sent: Any) -> None:
    caches = make_caches(16, seed=1)
    p = KVPush(_connector(), SinkInfo.from_dict(sink), caches, src_ids,
               KVLayout.of(caches, MODEL), connect_timeout=20)
    p.start()
    for layer in range(layers):
        p.send_layer(layer)
    sent.set()
    time.sleep(60)


# -- frames ----------------------------------------------------------------------------


def test_frames_round_trip_exact_and_in_order_in_one_process(inbox) -> None:  # noqa: ANN001
    box, receiver = inbox
    connector = _connector()
    s = connector.sender(receiver.address)
    for i in range(FRAMES):
        s.send(_frame(0, i))
    assert box.wait(frames=FRAMES)
    assert_frames_exact(box.frames, 0)
    assert all(f.peer == box.frames[0].peer for f in box.frames)
    receiver.reply(box.frames[0].peer, Frame({"kind": "ack"}))
    reply = s.poll(5)
    assert reply is not None and reply.header == {"kind": "ack"} and s.poll() is None
    s.close()
    connector.close()  # the parked connection too
    # A clean close still reaches on_error, exactly once.
    assert box.wait(errors=1, timeout=5) and len(box.errors) == 1
    assert box.errors[0][0] == box.frames[0].peer


def test_a_closed_sender_parks_its_connection_for_the_next(inbox) -> None:  # noqa: ANN001
    box, receiver = inbox
    connector = _connector(max_idle=1)
    first = connector.sender(receiver.address)
    first.send(_frame(0, 0))
    assert box.wait(frames=1)
    receiver.reply(box.frames[0].peer, Frame({"kind": "late"}))  # never read by `first`
    time.sleep(0.1)
    first.close()
    with pytest.raises(TransferError, match="closed"):
        first.send(_frame(0, 1))
    second = connector.sender(receiver.address)
    assert second.poll(0.2) is None  # the stale reply was dropped
    second.send(_frame(0, 1))
    assert box.wait(frames=2)
    assert box.frames[1].peer == box.frames[0].peer and box.errors == []  # one connection
    third = connector.sender(receiver.address)  # none parked: a new connection
    third.send(_frame(0, 2))
    assert box.wait(frames=3) and box.frames[2].peer != box.frames[0].peer
    second.close()
    third.close()  # max_idle=1: this one really closes
    assert box.wait(errors=1, timeout=5) and box.errors[0][0] == box.frames[2].peer
    receiver.close()
    with pytest.raises(TransferError, match="cannot connect"):
        connector.sender(receiver.address, connect_timeout=1)  # the parked one is dropped
    assert len(box.errors) == 1  # close() is not an error


def test_two_sender_processes_into_one_receiver(inbox) -> None:  # noqa: ANN001
    box, receiver = inbox
    procs = [spawn(send_frames_and_await_reply, receiver.address, n) for n in (1, 2)]
    try:
        assert box.wait(frames=2 * FRAMES, timeout=40), f"{len(box.frames)} frames arrived"
        for sender, frames in box.by_sender().items():
            assert_frames_exact(frames, sender)
            receiver.reply(frames[0].peer, Frame({"kind": "bye", "sender": sender}))
        assert sorted(box.by_sender()) == [1, 2]
        join_all(*procs)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
    assert box.wait(errors=2, timeout=5)
    assert {peer for peer, _ in box.errors} == {fs[0].peer for fs in box.by_sender().values()}


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


def test_sender_killed_mid_stream_is_reported_once(inbox) -> None:  # noqa: ANN001
    box, receiver = inbox
    sent = multiprocessing.get_context("spawn").Event()
    proc = spawn(send_two_frames_then_hang, receiver.address, sent)
    try:
        assert sent.wait(timeout=30) and box.wait(frames=2)
        os.kill(proc.pid, signal.SIGKILL)
        assert box.wait(errors=1, timeout=5), "a killed sender must reach on_error"
    finally:
        proc.kill()
        proc.join(timeout=10)
    time.sleep(0.2)
    assert [peer for peer, _ in box.errors] == [box.frames[0].peer]


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
        s.send(_frame(0, 0))
        start = time.monotonic()
        with pytest.raises(TransferError, match="gloo transfer failed"):
            s.send(_frame(0, 1))  # its payload is never received
        assert time.monotonic() - start < 3
        with pytest.raises(TransferError):
            s.send(_frame(0, 3))  # the connection is over
        release.set()
        assert box.wait(errors=1, timeout=5) and len(box.errors) == 1
    finally:
        release.set()
        receiver.close()


def test_receiver_close_fails_the_sender(inbox) -> None:  # noqa: ANN001
    box, receiver = inbox
    s = _connector().sender(receiver.address)
    s.send(_frame(0, 0))
    assert box.wait(frames=1)
    receiver.close()
    with pytest.raises(TransferError):
        for i in range(3):  # the first write may still land in the socket buffer
            s.send(_frame(0, i))
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


# -- KV through the transfer agent ------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("sink_ids", "src_ids"), [([7, 2, 11, 5], [0, 3, 1, 9]), ([15], [0])])
def test_kv_round_trip_is_exact_and_touches_nothing_else(
    dtype: torch.dtype, sink_ids: list[int], src_ids: list[int]
) -> None:
    roundtrip(_connector(), dtype, sink_ids, src_ids)


def test_two_concurrent_kv_transfers_into_one_destination() -> None:
    concurrent_roundtrip(_connector())


def test_kv_pushed_from_another_process() -> None:
    dst = make_caches(16, torch.bfloat16, seed=2)
    before = clone(dst)
    blocks = PoolBlocks(16)
    agent = TransferAgent(dst, KVLayout.of(dst, MODEL), _connector(), blocks.free)
    try:
        sink_ids, src_ids = [9, 4, 14], [2, 0, 7]
        sink = agent.reserve("x", sink_ids, ttl_s=60)
        join_all(spawn(push_kv, sink.to_dict(), src_ids, "bfloat16", "gloo", "cpu"))
        assert agent.wait_ready("x", timeout=5) and agent.release("x") == tuple(sink_ids)
        assert_blocks_equal(dst, sink_ids, make_caches(16, torch.bfloat16, seed=1), src_ids)
        assert_unchanged_except(before, dst, sink_ids)
        assert blocks.frees == []
    finally:
        agent.close()


def test_kv_sender_killed_mid_transfer_frees_the_sink() -> None:
    dst = make_caches(16, seed=2)
    before = clone(dst)
    blocks = PoolBlocks(16)
    agent = TransferAgent(dst, KVLayout.of(dst, MODEL), _connector(), blocks.free)
    sent = multiprocessing.get_context("spawn").Event()
    try:
        ids = blocks.allocate(4)
        sink = agent.reserve("r", ids, ttl_s=60)  # long TTL: the disconnect must free it
        proc = spawn(push_some_layers_then_hang, sink.to_dict(), [0, 1, 2, 3], 2, sent)
        try:
            assert sent.wait(timeout=30)
            assert wait_until(lambda: agent.status("r").layers_received == 2)
            os.kill(proc.pid, signal.SIGKILL)
            assert wait_until(lambda: blocks.num_free == 16, timeout=5), "sink not freed"
        finally:
            proc.kill()
            proc.join(timeout=10)
        status = agent.status("r")
        assert status.state is State.FAILED and "connection lost" in (status.reason or "")
        assert blocks.frees == [ids]
        # Two layers landed before the kill; nothing outside the sink was touched.
        assert_unchanged_except(before, dst, ids)
    finally:
        agent.close()


# -- NCCL between two GPUs (the lent nvidia-h200-x2) ----------------------------------


@pytest.mark.gpu
@two_gpus
def test_nccl_frames_between_two_gpus() -> None:
    torch.cuda.set_device("cuda:1")
    box = Inbox("cuda:1")
    receiver = _connector("nccl", device="cuda:1").receiver(
        "127.0.0.1", box.alloc, box.on_frame, box.on_error
    )
    procs = [spawn(send_frames_and_await_reply, receiver.address, 3, "nccl", "cuda:0")]
    try:
        assert box.wait(frames=FRAMES, timeout=60), f"{len(box.frames)} frames arrived"
        assert all(f.payload is None or f.payload.device == torch.device("cuda:1")
                   for f in box.frames)
        assert_frames_exact(box.frames, 3)
        receiver.reply(box.frames[0].peer, Frame({"kind": "bye", "sender": 3}))
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
        join_all(spawn(push_kv, sink.to_dict(), src_ids, dtype, "nccl", "cuda:0"), timeout=90)
        assert agent.wait_ready("g", timeout=10)
        src = make_caches(16, getattr(torch, dtype), seed=1)
        assert_blocks_equal(dst, sink_ids, src, src_ids)
        assert_unchanged_except(before, dst, sink_ids)
    finally:
        agent.close()
