"""Every KV transfer failure has an end: a clear error on the sender, a failed and freed
reservation on the receiver, no block leaked, no byte of the destination changed where
it must not be, and nothing waits longer than its timeout."""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
import signal
import socket
import time
from collections.abc import Iterator

import pytest
import torch
from kv_helpers import (
    MODEL,
    PoolBlocks,
    assert_unchanged_except,
    clone,
    make_caches,
    send_some_layers_then_hang,
    wait_until,
)

from tandem.kvtransfer.agent import SinkInfo, State, TransferAgent
from tandem.kvtransfer.connector import Frame, TransferError, get_connector
from tandem.kvtransfer.layout import KVLayout, LayoutMismatch
from tandem.kvtransfer.messages import encode
from tandem.kvtransfer.sender import KVPush, push
from tandem.kvtransfer.tcp import TcpConnector, parse_address
from tandem.kvtransfer.wire import MAGIC, PREFIX, VERSION, HostStaging, recv_frame, send_frame

NUM_BLOCKS = 16


@dataclasses.dataclass
class Dest:
    agent: TransferAgent
    caches: list[torch.Tensor]
    before: list[torch.Tensor]
    blocks: PoolBlocks
    layout: KVLayout
    connector: TcpConnector


@pytest.fixture(params=["tcp", "ipc"])
def dest(request: pytest.FixtureRequest) -> Iterator[Dest]:
    """A destination whose agent receives through tcp, or ipc (the same control frames
    over tcp, the blocks read from the sender's cache)."""
    caches = make_caches(NUM_BLOCKS, seed=2)
    blocks = PoolBlocks(NUM_BLOCKS)
    layout = KVLayout.of(caches, MODEL)
    connector = get_connector(request.param, io_timeout=5.0)
    agent = TransferAgent(caches, layout, connector, blocks.free)
    yield Dest(agent, caches, clone(caches), blocks, layout, connector)
    agent.close()
    connector.close()


def _freed(d: Dest, timeout: float = 5.0) -> bool:
    return wait_until(lambda: d.blocks.num_free == NUM_BLOCKS, timeout)


def _send_until_it_raises(p: KVPush, layers: range) -> None:
    """Go on sending: the receiver frees the sink, then replies with its abort, which one
    of these sees (the receiver drops what comes in for a failed sink)."""
    for layer in layers:
        p.send_layer(layer)
        time.sleep(0.05)


def test_layout_mismatch_seen_by_the_sender_moves_no_data(dest: Dest) -> None:
    ids = dest.blocks.allocate(4)
    sink = dest.agent.reserve("r", ids, ttl_s=30)
    src = make_caches(NUM_BLOCKS, torch.bfloat16, seed=1)  # bf16 into an fp32 sink
    msg = "dtype: 'bfloat16' on the sender vs 'float32' on the receiver"
    with pytest.raises(LayoutMismatch, match=msg):
        push(dest.connector, sink, src, [0, 1, 2, 3], KVLayout.of(src, MODEL))
    # The sender's abort frees the sink at once, not at its TTL.
    assert _freed(dest) and dest.blocks.frees == [ids]
    status = dest.agent.status("r")
    assert status.state is State.FAILED and "dtype: 'bfloat16'" in (status.reason or "")
    assert_unchanged_except(dest.before, dest.caches, [])


def test_layout_mismatch_seen_by_the_receiver_moves_no_data(dest: Dest) -> None:
    ids = dest.blocks.allocate(4)
    src = make_caches(NUM_BLOCKS, seed=1, head_dim=4, heads=4)  # same bytes per block
    layout = KVLayout.of(src, MODEL)
    # A stale sink that claims the sender's layout: only the receiver can catch it.
    sink = dataclasses.replace(dest.agent.reserve("r", ids, ttl_s=30), layout=layout.to_dict())
    msg = "num_kv_heads: 2 on the receiver vs 4 on the sender; head_dim: 8 on the receiver"
    with pytest.raises(LayoutMismatch, match=msg):
        push(dest.connector, sink, src, [0, 1, 2, 3], layout)
    assert _freed(dest) and dest.blocks.frees == [ids]
    assert "num_kv_heads" in (dest.agent.status("r").reason or "")
    assert_unchanged_except(dest.before, dest.caches, [])


def test_sender_killed_mid_transfer_frees_the_sink_at_disconnect(dest: Dest) -> None:
    ids = dest.blocks.allocate(4)
    sink = dest.agent.reserve("r", ids, ttl_s=60)  # long TTL: disconnect must free it
    ctx = multiprocessing.get_context("spawn")
    sent = ctx.Event()
    proc = ctx.Process(
        target=send_some_layers_then_hang,
        args=(dest.connector.name, sink.to_dict(), [0, 1, 2, 3], "float32", 2, sent),
        daemon=True,
    )
    proc.start()
    try:
        assert sent.wait(timeout=30), "sender subprocess never sent its layers"
        assert wait_until(lambda: dest.agent.status("r").layers_received == 2)
        assert dest.agent.status("r").state is State.RECEIVING
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(timeout=10)
        assert _freed(dest, timeout=5), "sink not freed after the sender died"
    finally:
        if proc.is_alive():
            proc.kill()
    status = dest.agent.status("r")
    assert status.state is State.FAILED
    assert "sender connection lost" in (status.reason or "")
    assert dest.blocks.frees == [ids] and not dest.agent.wait_ready("r", timeout=0)


def test_connection_dropped_mid_frame_fails_the_sink(dest: Dest) -> None:
    ids = dest.blocks.allocate(2)
    dest.agent.reserve("r", ids, ttl_s=60)
    with socket.create_connection(parse_address(dest.agent.address), timeout=5) as s:
        begin = {"kind": "begin", "request_id": "r", "layout": dest.layout.to_dict(),
                 "num_blocks": 2}
        send_frame(s, Frame(begin), HostStaging())
        accept = recv_frame(s, lambda h: torch.empty(0), HostStaging())
        assert accept is not None and accept.header == {"kind": "accept", "request_id": "r"}
        header = encode({"kind": "layer", "request_id": "r", "layer": 0,
                         "dtype": "float32", "shape": list(dest.layout.staging_shape(2))})
        s.sendall(PREFIX.pack(MAGIC, VERSION, len(header), 2 * dest.layout.block_bytes)
                  + header + b"\0" * 100)
    assert _freed(dest)
    assert "closed mid-frame" in (dest.agent.status("r").reason or "")
    assert_unchanged_except(dest.before, dest.caches, [])


def test_unused_reservation_expires_and_is_freed(dest: Dest) -> None:
    ids = dest.blocks.allocate(3)
    sink = dest.agent.reserve("r", ids, ttl_s=0.3)
    t0 = time.monotonic()
    assert _freed(dest, timeout=5)
    assert 0.25 < time.monotonic() - t0 < 2.0
    assert dest.agent.status("r") == dataclasses.replace(
        dest.agent.status("r"), state=State.FAILED, reason="reservation expired after 0.3s"
    )
    src = make_caches(NUM_BLOCKS, seed=1)
    with pytest.raises(TransferError, match="no open reservation for 'r': failed"):
        push(dest.connector, sink, src, [0, 1, 2], dest.layout)
    assert dest.blocks.frees == [ids]


def test_ended_reservations_are_forgotten_after_keep_s_and_no_sooner() -> None:
    """The reaper drops a sink's tombstone (what `status` reads after its end) once
    `keep_s` has passed since it ended, and only that sink's: a request id reserved again
    since keeps its new reservation; one that expires meanwhile is failed."""
    caches, blocks = make_caches(NUM_BLOCKS, seed=2), PoolBlocks(NUM_BLOCKS)
    connector = get_connector("tcp", io_timeout=5.0)
    agent = TransferAgent(caches, KVLayout.of(caches, MODEL), connector, blocks.free,
                          reap_interval_s=0.02, keep_s=1.0)
    try:
        agent.reserve("gone", blocks.allocate(1), ttl_s=30)
        agent.reserve("again", blocks.allocate(1), ttl_s=30)
        assert agent.abort("gone") and agent.abort("again")
        ended = time.monotonic()
        agent.reserve("again", blocks.allocate(1), ttl_s=30)
        agent.reserve("short", blocks.allocate(1), ttl_s=0.1)
        assert agent.status("gone").state is State.FAILED
        assert wait_until(lambda: agent.status("short").state is State.FAILED, 5)
        assert time.monotonic() - ended < 1.0
        assert agent.status("gone").state is State.FAILED  # kept still
        assert wait_until(lambda: not _known(agent, "gone"), 5)
        assert time.monotonic() - ended >= 1.0
        assert agent.status("again").state is State.RESERVED
        assert wait_until(lambda: not _known(agent, "short"), 5)
        assert agent.status("again").state is State.RESERVED
    finally:
        agent.close()
        connector.close()


def _known(agent: TransferAgent, rid: str) -> bool:
    try:
        agent.status(rid)
    except KeyError:
        return False
    return True


def test_stalled_sender_is_stopped_by_the_ttl(dest: Dest) -> None:
    ids = dest.blocks.allocate(2)
    sink = dest.agent.reserve("r", ids, ttl_s=0.5)
    src = make_caches(NUM_BLOCKS, seed=1)
    with KVPush(dest.connector, sink, src, [0, 1], dest.layout) as p:
        p.start()
        p.send_layer(0)
        assert _freed(dest, timeout=5)
        with pytest.raises(TransferError, match="aborted by receiver: reservation expired"):
            _send_until_it_raises(p, range(1, dest.layout.num_layers))
    assert dest.blocks.frees == [ids]


def test_abort_on_the_receiver_stops_the_sender(dest: Dest) -> None:
    ids = dest.blocks.allocate(2)
    other = dest.blocks.allocate(2)
    sink = dest.agent.reserve("r", ids, ttl_s=30)
    dest.agent.reserve("keep", other, ttl_s=30)
    src = make_caches(NUM_BLOCKS, seed=1)
    with KVPush(dest.connector, sink, src, [0, 1], dest.layout) as p:
        p.start()
        p.send_layer(0)
        assert wait_until(lambda: dest.agent.status("r").layers_received == 1)
        assert dest.agent.abort("r", "client went away")
        with pytest.raises(TransferError, match="aborted by receiver: client went away"):
            _send_until_it_raises(p, range(1, dest.layout.num_layers))
    assert dest.blocks.frees == [ids] and dest.blocks.num_free == NUM_BLOCKS - 2
    assert not dest.agent.abort("r")  # already failed: freed exactly once
    assert dest.agent.status("keep").state is State.RESERVED
    assert_unchanged_except(dest.before, dest.caches, ids)


def test_abort_on_the_sender_frees_the_sink(dest: Dest) -> None:
    ids = dest.blocks.allocate(2)
    sink = dest.agent.reserve("r", ids, ttl_s=30)
    src = make_caches(NUM_BLOCKS, seed=1)
    with pytest.raises(RuntimeError, match="prefill crashed"):
        with KVPush(dest.connector, sink, src, [0, 1], dest.layout) as p:
            p.start()
            p.send_layer(0)
            raise RuntimeError("prefill crashed")
    assert _freed(dest)
    assert dest.agent.status("r").reason == "aborted by sender: RuntimeError: prefill crashed"
    # A retry may reserve the same request id again.
    dest.agent.reserve("r", dest.blocks.allocate(2), ttl_s=30)


def test_ending_early_fails_the_transfer(dest: Dest) -> None:
    ids = dest.blocks.allocate(2)
    sink = dest.agent.reserve("r", ids, ttl_s=30)
    src = make_caches(NUM_BLOCKS, seed=1)
    with KVPush(dest.connector, sink, src, [0, 1], dest.layout) as p:
        p.start()
        p.send_layer(0)
        with pytest.raises(TransferError, match="sender ended after 1 of 4 layers"):
            p.finish()
    assert _freed(dest)


def test_receiver_closing_mid_transfer_fails_the_sender(dest: Dest) -> None:
    ids = dest.blocks.allocate(2)
    sink = dest.agent.reserve("r", ids, ttl_s=30)
    src = make_caches(NUM_BLOCKS, seed=1)
    with KVPush(dest.connector, sink, src, [0, 1], dest.layout, reply_timeout=2) as p:
        p.start()
        dest.agent.close()
        assert _freed(dest)
        t0 = time.monotonic()
        with pytest.raises(TransferError):
            for layer in range(4):
                p.send_layer(layer)
            p.finish()
        assert time.monotonic() - t0 < 5


def _unused_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("address", [f"tcp://127.0.0.1:{_unused_port()}", "tcp://10.255.255.1:5555"])
def test_dead_address_fails_within_a_bounded_time(address: str) -> None:
    src = make_caches(NUM_BLOCKS, seed=1)
    layout = KVLayout.of(src, MODEL)
    sink = SinkInfo("r", address, (0, 1), layout.to_dict(), time.time() + 30)  # nobody serves
    t0 = time.monotonic()
    # Non-routable: the connect times out, or a transparent proxy answers it, which the
    # framing rejects or the accept wait outlasts. Either way a TransferError, in time.
    with pytest.raises(TransferError):
        push(TcpConnector(), sink, src, [0, 1], layout, connect_timeout=0.5, reply_timeout=1.0)
    assert time.monotonic() - t0 < 2.5


def test_unanswered_connect_times_out() -> None:
    # A listener that never accepts, its backlog full: further SYNs are dropped, as on a
    # route to nowhere, so only the connect timeout ends the wait.
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(0)
        port = listener.getsockname()[1]
        fillers = [socket.socket() for _ in range(4)]
        for s in fillers:
            s.setblocking(False)
            s.connect_ex(("127.0.0.1", port))
        try:
            t0 = time.monotonic()
            with pytest.raises(TransferError, match="cannot connect .* timed out"):
                TcpConnector().sender(f"tcp://127.0.0.1:{port}", connect_timeout=0.5)
            assert 0.4 < time.monotonic() - t0 < 2.0
        finally:
            for s in fillers:
                s.close()
