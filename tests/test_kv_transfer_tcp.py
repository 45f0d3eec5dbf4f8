"""KV transfers over the tcp connector on loopback: wire framing, round trips that
arrive bit-identical without touching other blocks, layer-wise progress, concurrency."""

from __future__ import annotations

import json
import socket
import time
from dataclasses import replace

import pytest
import torch
from kv_helpers import (
    MODEL,
    assert_blocks_equal,
    assert_unchanged_except,
    clone,
    concurrent_roundtrip,
    make_caches,
    roundtrip,
    wait_until,
)

from tandem.kvtransfer.agent import SinkInfo, State, TransferAgent
from tandem.kvtransfer.connector import Frame, Sender, TransferError, get_connector
from tandem.kvtransfer.layout import KVLayout
from tandem.kvtransfer.messages import encode
from tandem.kvtransfer.sender import KVPush, push
from tandem.kvtransfer.tcp import TcpConnector
from tandem.kvtransfer.wire import MAGIC, PREFIX, VERSION, HostStaging, recv_frame, send_frame

# -- wire framing ------------------------------------------------------------------------


def _alloc(header: dict) -> torch.Tensor:
    return torch.empty(header["shape"], dtype=getattr(torch, header["dtype"]))


def test_wire_frame_round_trip_bf16() -> None:
    a, b = socket.socketpair()
    payload = torch.randn(2, 3, 4, 2, 8).to(torch.bfloat16)
    with a, b:
        a.settimeout(5)
        b.settimeout(5)
        send_frame(a, Frame({"kind": "layer", "request_id": "r", "layer": 3}, payload),
                   HostStaging())
        send_frame(a, Frame({"kind": "end", "request_id": "r"}), HostStaging())
        got = recv_frame(b, _alloc, HostStaging())
        assert got is not None and got.payload is not None
        assert got.header == {"kind": "layer", "request_id": "r", "layer": 3,
                              "dtype": "bfloat16", "shape": [2, 3, 4, 2, 8]}
        assert torch.equal(got.payload, payload)
        end = recv_frame(b, _alloc, HostStaging())
        assert end is not None and end.header == {"kind": "end", "request_id": "r"}
        assert end.payload is None
        a.close()
        assert recv_frame(b, _alloc, HostStaging()) is None  # clean EOF between frames


def test_wire_eof_mid_frame_is_an_error() -> None:
    a, b = socket.socketpair()
    with a, b:
        b.settimeout(5)
        header = encode({"kind": "layer", "request_id": "r", "layer": 0, "dtype": "float32",
                         "shape": [4]})
        a.sendall(PREFIX.pack(MAGIC, VERSION, len(header), 16) + header + b"12345678")
        a.close()
        with pytest.raises(TransferError, match="closed mid-frame"):
            recv_frame(b, _alloc, HostStaging())


def test_wire_rejects_a_foreign_stream() -> None:
    a, b = socket.socketpair()
    with a, b:
        b.settimeout(5)
        a.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        with pytest.raises(TransferError, match="not a Tandem KV frame"):
            recv_frame(b, _alloc, HostStaging())


def test_wire_stall_mid_frame_times_out() -> None:
    a, b = socket.socketpair()
    with a, b:
        b.settimeout(0.2)
        a.sendall(PREFIX.pack(MAGIC, VERSION, 10, 0)[:5])
        with pytest.raises(TransferError, match="stalled mid-frame"):
            recv_frame(b, _alloc, HostStaging(), keep_waiting=lambda: True)


# -- round trips -------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("sink_ids", "src_ids"),
    [([7, 2, 11, 5], [0, 3, 1, 9]), ([4, 5, 6], [4, 5, 6]), ([15], [0])],
)
def test_round_trip_is_exact_and_touches_nothing_else(
    dtype: torch.dtype, sink_ids: list[int], src_ids: list[int]
) -> None:
    roundtrip(get_connector("tcp"), dtype, sink_ids, src_ids)


def test_layer_by_layer_progress_and_ready_callback() -> None:
    connector = TcpConnector()
    src, dst = make_caches(16, seed=1), make_caches(16, seed=2)
    layout = KVLayout.of(dst, MODEL)
    ready: list[str] = []
    agent = TransferAgent(dst, layout, connector, lambda ids: None, on_ready=ready.append)
    try:
        sink = agent.reserve("r", [9, 3], ttl_s=30)
        assert agent.status("r").state is State.RESERVED
        with KVPush(connector, sink, src, [1, 2], layout) as p:
            p.start()
            assert agent.status("r").state is State.RECEIVING
            for layer in range(layout.num_layers):
                p.send_layer(layer)
                assert wait_until(lambda n=layer + 1: agent.status("r").layers_received == n)
                # A layer is in place as soon as it lands, before the transfer ends.
                assert torch.equal(dst[layer][:, 9], src[layer][:, 1])
                assert (agent.status("r").state is State.READY) == (layer == 3)
            p.finish()
        assert ready == ["r"] and agent.wait_ready("r", timeout=0)
        assert agent.release("r") == (9, 3)
        assert agent.status("r").state is State.RELEASED
        assert not agent.abort("r")  # released blocks belong to the caller now
    finally:
        agent.close()


def test_a_reply_that_came_while_the_sender_was_away_counts() -> None:
    """A thread that ends several pushes sends each end, then waits for each reply: a
    push's done that came while the thread waited on another push counts, though its
    reply timeout has passed by the time it is looked at."""
    connector = TcpConnector()
    src, dst = make_caches(16, seed=1), make_caches(16, seed=2)
    layout = KVLayout.of(dst, MODEL)
    agent = TransferAgent(dst, layout, connector, lambda ids: None)
    try:
        with KVPush(connector, agent.reserve("r", [9, 3], ttl_s=30), src, [1, 2], layout,
                    reply_timeout=0.3, all_computed=True) as p:
            p.start()
            for layer in range(layout.num_layers):
                p.send_layer(layer)
            p.end()
            assert agent.wait_ready("r", timeout=5)
            time.sleep(0.5)  # past the reply timeout: the done is in already
            p.wait_done()
        assert_blocks_equal(dst, [9, 3], src, [1, 2])
    finally:
        agent.close()
        connector.close()


def _await_reply(sender: Sender, kind: str) -> dict:
    frame = sender.poll(5.0)
    assert frame is not None and frame.header["kind"] == kind, frame
    return frame.header


def test_a_frame_may_carry_several_consecutive_layers() -> None:
    # What KVPush sends when it is ahead of the link: layers 0-2 stacked, then layer 3.
    connector = TcpConnector()
    src, dst = make_caches(16, seed=1), make_caches(16, seed=2)
    before = clone(dst)
    layout = KVLayout.of(dst, MODEL)
    agent = TransferAgent(dst, layout, connector, lambda ids: None)
    sender = None
    try:
        sink = agent.reserve("r", [9, 3], ttl_s=30)
        sender = connector.sender(sink.address)
        sender.send(Frame({"kind": "begin", "request_id": "r", "layout": layout.to_dict(),
                           "num_blocks": 2}))
        _await_reply(sender, "accept")
        stacked = torch.stack([c[:, [1, 2]] for c in src[:3]])  # [3, 2, n, bs, H, D]
        sender.send(Frame({"kind": "layer", "request_id": "r", "layer": 0, "layers": 3},
                          stacked))
        assert wait_until(lambda: agent.status("r").layers_received == 3)
        assert agent.status("r").state is State.RECEIVING
        sender.send(Frame({"kind": "layer", "request_id": "r", "layer": 3},
                          src[3][:, [1, 2]].contiguous()))
        sender.send(Frame({"kind": "end", "request_id": "r"}))
        _await_reply(sender, "done")
        assert_blocks_equal(dst, [9, 3], src, [1, 2])
        assert_unchanged_except(before, dst, [9, 3])
    finally:
        if sender is not None:
            sender.close()
        agent.close()


def test_a_layer_sent_again_in_a_stacked_frame_fails_the_sink() -> None:
    connector = TcpConnector()
    src, dst = make_caches(16, seed=1), make_caches(16, seed=2)
    layout = KVLayout.of(dst, MODEL)
    freed: list[list[int]] = []
    agent = TransferAgent(dst, layout, connector, freed.append)
    sender = None
    try:
        sink = agent.reserve("r", [9, 3], ttl_s=30)
        sender = connector.sender(sink.address)
        sender.send(Frame({"kind": "begin", "request_id": "r", "layout": layout.to_dict(),
                           "num_blocks": 2}))
        _await_reply(sender, "accept")
        one = src[1][:, [1, 2]].contiguous()
        sender.send(Frame({"kind": "layer", "request_id": "r", "layer": 1}, one))
        sender.send(Frame({"kind": "layer", "request_id": "r", "layer": 0, "layers": 2},
                          torch.stack([one, one])))
        reply = _await_reply(sender, "abort")
        assert reply["reason"] == "layers [1] sent twice"
        assert agent.status("r").state is State.FAILED and freed == [[9, 3]]
    finally:
        if sender is not None:
            sender.close()
        agent.close()


def test_two_concurrent_transfers_into_one_destination() -> None:
    concurrent_roundtrip(TcpConnector())


def test_sink_info_crosses_processes_as_a_dict() -> None:
    layout = KVLayout(MODEL, "float32", 4, 2, 8, 4)
    sink = SinkInfo("r", "tcp://127.0.0.1:1", (3, 1), layout.to_dict(), 12.5)
    assert SinkInfo.from_dict(json.loads(json.dumps(sink.to_dict()))) == sink


def test_a_fixed_port_and_an_advertised_host() -> None:
    """A node behind a Service: the agent listens on the port it is given and tells
    senders the advertised host; a push to that port lands."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    src, dst = make_caches(8, seed=1), make_caches(8, seed=2)
    layout = KVLayout.of(dst, MODEL)
    connector = TcpConnector()
    agent = TransferAgent(dst, layout, connector, lambda ids: None, "127.0.0.1", port=port,
                          advertise_host="decode-0.tandem.svc")
    try:
        assert agent.address == f"tcp://decode-0.tandem.svc:{port}"
        sink = agent.reserve("r", [3, 5], ttl_s=30)
        reachable = replace(sink, address=f"tcp://127.0.0.1:{port}")  # as DNS would
        push(connector, reachable, src, [1, 2], layout)
        assert agent.wait_ready("r", timeout=10)
        assert_blocks_equal(dst, [3, 5], src, [1, 2])
    finally:
        agent.close()


def test_reserve_validates_block_ids() -> None:
    dst = make_caches(8)
    agent = TransferAgent(dst, KVLayout.of(dst, MODEL), TcpConnector(), lambda ids: None)
    try:
        agent.reserve("a", [1, 2], ttl_s=30)
        with pytest.raises(ValueError, match=r"blocks \[2\] are already reserved"):
            agent.reserve("b", [2, 3], ttl_s=30)
        with pytest.raises(ValueError, match="already holds"):
            agent.reserve("a", [4], ttl_s=30)
        for bad in ([], [5, 5], [8], [-1]):
            with pytest.raises(ValueError, match="distinct"):
                agent.reserve("c", bad, ttl_s=30)
        with pytest.raises(TransferError, match="not ready: reserved"):
            agent.release("a")
    finally:
        agent.close()


def test_agent_rejects_caches_that_do_not_match_its_layout() -> None:
    dst = make_caches(8)
    wrong = KVLayout(MODEL, "float32", 4, 2, 8, 16)
    with pytest.raises(TransferError, match="block_size: 4 here vs 16 there"):
        TransferAgent(dst, wrong, TcpConnector(), lambda ids: None)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_round_trip_between_cuda_caches(dtype: torch.dtype) -> None:
    # Gather and scatter on the GPU; payloads cross the socket through pinned memory.
    roundtrip(TcpConnector(), dtype, [7, 2, 11, 5], [0, 3, 1, 9], device="cuda")


def test_round_trip_between_separately_allocated_layers() -> None:
    # One kernel per layer instead of one per run of layers: the same bytes arrive.
    roundtrip(get_connector("tcp"), torch.bfloat16, [7, 2, 11, 5], [0, 3, 1, 9],
              one_tensor=False)


class RecordingTcp(TcpConnector):
    """The tcp connector, noting every header its receivers deliver."""

    def __init__(self) -> None:
        super().__init__()
        self.headers: list[dict] = []

    def receiver(self, host, alloc, on_frame, on_error, port=0):  # noqa: ANN001, ANN201
        def record(frame: Frame) -> None:
            self.headers.append(frame.header)
            on_frame(frame)

        return super().receiver(host, alloc, record, on_error, port)


def test_a_push_sends_planned_messages_each_announced_one_ahead() -> None:
    connector = RecordingTcp()
    src = make_caches(16, seed=1, num_layers=5)
    dst = make_caches(16, seed=2, num_layers=5)
    before = clone(dst)
    layout = KVLayout.of(dst, MODEL)
    agent = TransferAgent(dst, layout, connector, lambda ids: None)
    try:
        sink = agent.reserve("r", [9, 3], ttl_s=30)
        push(connector, sink, src, [1, 2], layout, message_bytes=2 * 2 * layout.block_bytes)
        assert agent.wait_ready("r", timeout=5)
    finally:
        agent.close()
    assert_blocks_equal(dst, [9, 3], src, [1, 2])
    assert_unchanged_except(before, dst, [9, 3])
    headers = connector.headers
    assert [(h["kind"], h.get("layer"), h.get("layers", 1)) for h in headers] == [
        ("begin", None, 1), ("layer", 0, 2), ("layer", 2, 2), ("layer", 4, 1), ("end", None, 1)
    ]
    for h, following in zip(headers[:3], headers[1:4]):
        assert h["next"] == {k: v for k, v in following.items() if k != "next"}
    assert "next" not in headers[3]


def test_a_planned_push_takes_layers_once_each_in_order() -> None:
    connector = TcpConnector()
    src, dst = make_caches(16, seed=1), make_caches(16, seed=2)
    layout = KVLayout.of(dst, MODEL)
    agent = TransferAgent(dst, layout, connector, lambda ids: None)
    try:
        sink = agent.reserve("r", [9, 3], ttl_s=30)
        with KVPush(connector, sink, src, [1, 2], layout, all_computed=True) as p:
            p.start()
            with pytest.raises(ValueError, match="expected 0, got 1"):
                p.send_layer(1)
            for layer in range(layout.num_layers):
                p.send_layer(layer)
            with pytest.raises(ValueError, match="every layer was sent, got 0"):
                p.send_layer(0)
            p.finish()
        assert agent.wait_ready("r", timeout=5)
    finally:
        agent.close()


class PeerRecordingTcp(TcpConnector):
    """The tcp connector, noting the connection (peer id) each begin came in on."""

    def __init__(self) -> None:
        super().__init__()
        self.begins: list[str | None] = []

    def receiver(self, host, alloc, on_frame, on_error, port=0):  # noqa: ANN001, ANN201
        def record(frame: Frame) -> None:
            if frame.header.get("kind") == "begin":
                self.begins.append(frame.peer)
            on_frame(frame)

        return super().receiver(host, alloc, record, on_error, port)


def test_one_connection_carries_every_push_clean_or_failed() -> None:
    """Pushes one after another share one connection: a late abort of a finished request
    is dropped on it, and a push the receiver aborted leaves it open for the next."""
    connector = PeerRecordingTcp()
    src, dst = make_caches(16, seed=1), make_caches(16, seed=2)
    layout = KVLayout.of(dst, MODEL)
    agent = TransferAgent(dst, layout, connector, lambda ids: None)
    try:
        for rid, ids in (("a", [9, 3]), ("b", [4, 5])):
            push(connector, agent.reserve(rid, ids, ttl_s=30), src, [1, 2], layout)
            assert agent.wait_ready(rid, timeout=5)
        assert_blocks_equal(dst, [9, 3, 4, 5], src, [1, 2, 1, 2])
        assert agent.abort("a", "dropped after ready")  # its abort reaches no sender
        time.sleep(0.2)
        push(connector, agent.reserve("c", [6], ttl_s=30), src, [0], layout)
        with KVPush(connector, agent.reserve("d", [7], ttl_s=30), src, [0], layout) as p:
            p.start()
            agent.abort("d", "client went away")
            with pytest.raises(TransferError, match="client went away"):
                for layer in range(layout.num_layers):
                    time.sleep(0.05)
                    p.send_layer(layer)
        push(connector, agent.reserve("e", [8], ttl_s=30), src, [0], layout)
        assert agent.wait_ready("e", timeout=5)
    finally:
        agent.close()
    a, b, c, d, e = connector.begins
    assert a == b == c == d == e
    assert_blocks_equal(dst, [6, 8], src, [0, 0])


def test_an_idle_connection_to_a_closed_receiver_is_not_reused() -> None:
    connector = TcpConnector()
    src, dst = make_caches(16, seed=1), make_caches(16, seed=2)
    layout = KVLayout.of(dst, MODEL)
    agent = TransferAgent(dst, layout, connector, lambda ids: None)
    push(connector, agent.reserve("a", [1], ttl_s=30), src, [0], layout)
    sink = agent.reserve("b", [2], ttl_s=30)
    agent.close()
    start = time.monotonic()
    with pytest.raises(TransferError, match="cannot connect"):
        push(connector, sink, src, [0], layout, connect_timeout=1.0)
    assert time.monotonic() - start < 5
    connector.close()
