"""What every frame-level connector must do, run for ucx (where ucxx is installed) and for
nccl on CPU through gloo: frames arrive bit-exact and in order, from one process and from
two; a killed sender is reported once; KV pushed through the transfer agent lands exactly
in the sink blocks, from this process and from another; a sender killed mid-transfer
frees its sink at disconnect. Each connector's own cases stay in its own file."""

from __future__ import annotations

import importlib.util
import multiprocessing
import os
import signal
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
    send_two_frames_then_hang,
)
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
    send_some_layers_then_hang,
    spawn,
    wait_until,
)

from tandem.kvtransfer.agent import State, TransferAgent
from tandem.kvtransfer.connector import Connector, get_connector
from tandem.kvtransfer.layout import KVLayout

NO_UCXX = importlib.util.find_spec("ucxx") is None


@pytest.fixture(params=[
    pytest.param(("ucx", {}), id="ucx", marks=pytest.mark.skipif(
        NO_UCXX, reason="the ucx connector needs ucxx (pip install ucxx-cu12)")),
    pytest.param(("nccl", {"backend": "gloo"}), id="nccl-gloo"),
])
def spec(request: pytest.FixtureRequest) -> tuple[str, dict[str, Any]]:
    """A connector's name and the get_connector options that run it on CPU."""
    return request.param


def _connector(spec: tuple[str, dict[str, Any]]) -> Connector:
    name, options = spec
    return get_connector(name, **options)


@pytest.fixture
def inbox(spec: tuple[str, dict[str, Any]]) -> Iterator[tuple[Inbox, Any]]:
    box = Inbox()
    receiver = _connector(spec).receiver("127.0.0.1", box.alloc, box.on_frame, box.on_error)
    yield box, receiver
    receiver.close()


def test_frames_round_trip_exact_and_in_order_in_one_process(spec, inbox) -> None:  # noqa: ANN001
    box, receiver = inbox
    connector = _connector(spec)
    s = connector.sender(receiver.address)
    for i in range(FRAMES):
        s.send(numbered_frame(0, i))
    assert box.wait(frames=FRAMES)
    assert_frames_exact(box.frames, 0)
    assert all(f.peer == box.frames[0].peer for f in box.frames)
    receiver.reply(box.frames[0].peer, bye(0))
    reply = s.poll(5)
    assert reply is not None and reply.header == bye(0).header and s.poll() is None
    s.close()
    connector.close()  # a connection it keeps for reuse too
    # A clean close still reaches on_error, exactly once.
    assert box.wait(errors=1, timeout=5) and len(box.errors) == 1
    assert box.errors[0][0] == box.frames[0].peer


def test_two_sender_processes_into_one_receiver(spec, inbox) -> None:  # noqa: ANN001
    box, receiver = inbox
    procs = [spawn(send_frames_and_await_reply, *spec, receiver.address, n) for n in (1, 2)]
    try:
        assert box.wait(frames=2 * FRAMES, timeout=40), f"{len(box.frames)} frames arrived"
        for sender, frames in box.by_sender().items():
            assert_frames_exact(frames, sender)
            receiver.reply(frames[0].peer, bye(sender))
        assert sorted(box.by_sender()) == [1, 2]
        join_all(*procs)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
    assert box.wait(errors=2, timeout=5)
    assert {peer for peer, _ in box.errors} == {fs[0].peer for fs in box.by_sender().values()}


def test_sender_killed_mid_stream_is_reported_once(spec, inbox) -> None:  # noqa: ANN001
    box, receiver = inbox
    sent = multiprocessing.get_context("spawn").Event()
    proc = spawn(send_two_frames_then_hang, *spec, receiver.address, sent)
    try:
        assert sent.wait(timeout=30) and box.wait(frames=2)
        os.kill(proc.pid, signal.SIGKILL)
        assert box.wait(errors=1, timeout=5), "a killed sender must reach on_error"
    finally:
        proc.kill()
        proc.join(timeout=10)
    assert not box.wait(errors=2, timeout=0.2)
    assert [peer for peer, _ in box.errors] == [box.frames[0].peer]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("sink_ids", "src_ids"), [([7, 2, 11, 5], [0, 3, 1, 9]), ([15], [0])])
def test_kv_round_trip_is_exact_and_touches_nothing_else(
    spec, dtype: torch.dtype, sink_ids: list[int], src_ids: list[int]  # noqa: ANN001
) -> None:
    roundtrip(_connector(spec), dtype, sink_ids, src_ids)


def test_two_concurrent_kv_transfers_into_one_destination(spec) -> None:  # noqa: ANN001
    concurrent_roundtrip(_connector(spec))


def test_kv_pushed_from_another_process(spec) -> None:  # noqa: ANN001
    dst = make_caches(16, torch.bfloat16, seed=2)
    before = clone(dst)
    blocks = PoolBlocks(16)
    agent = TransferAgent(dst, KVLayout.of(dst, MODEL), _connector(spec), blocks.free)
    try:
        sink_ids, src_ids = [9, 4, 14], [2, 0, 7]
        sink = agent.reserve("x", sink_ids, ttl_s=60)
        join_all(spawn(push_kv, *spec, sink.to_dict(), src_ids, "bfloat16"))
        assert agent.wait_ready("x", timeout=5) and agent.release("x") == tuple(sink_ids)
        assert_blocks_equal(dst, sink_ids, make_caches(16, torch.bfloat16, seed=1), src_ids)
        assert_unchanged_except(before, dst, sink_ids)
        assert blocks.frees == []
    finally:
        agent.close()


def test_kv_sender_killed_mid_transfer_frees_the_sink(spec) -> None:  # noqa: ANN001
    name, options = spec
    dst = make_caches(16, seed=2)
    before = clone(dst)
    blocks = PoolBlocks(16)
    agent = TransferAgent(dst, KVLayout.of(dst, MODEL), _connector(spec), blocks.free)
    sent = multiprocessing.get_context("spawn").Event()
    try:
        ids = blocks.allocate(4)
        sink = agent.reserve("r", ids, ttl_s=60)  # long TTL: the disconnect must free it
        proc = spawn(send_some_layers_then_hang, name, sink.to_dict(), [0, 1, 2, 3], "float32",
                     2, sent, options)
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
