"""The ipc connector: the receiving agent maps the sender's KV cache (shared memory on
CPU, CUDA IPC on GPU) and copies the sink's blocks out of it itself. Round trips in one
process and across processes, layer by layer, the checks that refuse what it can't read,
and the mapping's lifetime. Its failure cases run in test_kv_transfer_failures.py, with
tcp's; the CUDA tests at the end need a GPU (two for the cross-GPU one)."""

from __future__ import annotations

import multiprocessing
from typing import Any

import pytest
import torch
from kv_helpers import (
    MODEL,
    PoolBlocks,
    assert_blocks_equal,
    assert_unchanged_except,
    clone,
    concurrent_roundtrip,
    make_caches,
    roundtrip,
    wait_until,
)

from tandem.kvtransfer.agent import SinkInfo, State, TransferAgent
from tandem.kvtransfer.connector import Frame, TransferError
from tandem.kvtransfer.ipc import IpcConnector
from tandem.kvtransfer.layout import KVLayout
from tandem.kvtransfer.sender import KVPush, push
from tandem.kvtransfer.tcp import TcpConnector

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("sink_ids", "src_ids"),
    [([4, 5, 6], [0, 1, 2]), ([7, 2, 11, 5], [0, 3, 1, 9]), ([15], [0])],
    ids=["contiguous", "scattered", "one-block"],
)
def test_round_trip_is_exact_and_touches_nothing_else(
    dtype: torch.dtype, sink_ids: list[int], src_ids: list[int]
) -> None:
    connector = IpcConnector()
    roundtrip(connector, dtype, sink_ids, src_ids)
    connector.close()


def test_two_concurrent_transfers_into_one_destination() -> None:
    connector = IpcConnector()
    concurrent_roundtrip(connector)
    connector.close()


def push_from_another_process(sink: dict, src_ids: list[int], device: str, slow: bool,
                              result: Any) -> None:
    """Subprocess body (spawn): push caches made with seed 1 into `sink`. `slow`: each
    layer is "computed" (doubled) behind a long GPU sleep just before it is sent, so a
    receiver that copied before the sender's event would read the old values."""
    try:
        caches = make_caches(16, torch.bfloat16, seed=1, device=device)
        connector = IpcConnector()
        layout = KVLayout.of(caches, MODEL)
        with KVPush(connector, SinkInfo.from_dict(sink), caches, src_ids, layout) as p:
            p.start()
            for layer in range(layout.num_layers):
                if slow:
                    torch.cuda._sleep(20_000_000)
                    caches[layer].mul_(2)
                p.send_layer(layer)
            p.finish()
        result.put("ok")
    except BaseException as exc:  # noqa: BLE001 - reported to the test
        result.put(f"{type(exc).__name__}: {exc}")


def _cross_process(sender_device: str, receiver_device: str, slow: bool) -> None:
    dst = make_caches(24, torch.bfloat16, seed=2, device=receiver_device)
    before = clone(dst)
    connector = IpcConnector()
    agent = TransferAgent(dst, KVLayout.of(dst, MODEL), connector, lambda ids: None)
    ctx = multiprocessing.get_context("spawn")
    result = ctx.Queue()
    sink_ids, src_ids = [20, 3, 9, 14], [5, 0, 12, 7]
    try:
        sink = agent.reserve("x", sink_ids, ttl_s=60)
        proc = ctx.Process(target=push_from_another_process,
                           args=(sink.to_dict(), src_ids, sender_device, slow, result))
        proc.start()
        assert result.get(timeout=120) == "ok"
        proc.join(timeout=30)
        assert proc.exitcode == 0
        assert agent.wait_ready("x", timeout=5)
        agent.release("x")
        src = make_caches(16, torch.bfloat16, seed=1)
        if slow:
            src = [c * 2 for c in src]
        assert_blocks_equal(dst, sink_ids, src, src_ids)
        assert_unchanged_except(before, dst, sink_ids)
        # The sender is gone and nothing reads its cache any more: it is unmapped.
        assert len(connector.mapped) == 1
        connector.mapped.prune()
        assert len(connector.mapped) == 0
    finally:
        agent.close()
        connector.close()


def test_round_trip_from_another_process() -> None:
    _cross_process("cpu", "cpu", slow=False)


def test_each_layer_is_copied_as_it_is_announced() -> None:
    src, dst = make_caches(16, seed=1), make_caches(16, seed=2)
    layout = KVLayout.of(dst, MODEL)
    connector = IpcConnector()
    agent = TransferAgent(dst, layout, connector, lambda ids: None)
    try:
        sink = agent.reserve("r", [9, 4], ttl_s=30)
        with KVPush(connector, sink, src, [1, 2], layout) as p:
            p.start()
            for layer in range(layout.num_layers):
                p.send_layer(layer)
                assert wait_until(lambda n=layer + 1: agent.status("r").layers_received == n)
                assert_blocks_equal(dst[:layer + 1], [9, 4], src[:layer + 1], [1, 2])
            p.finish()
        assert agent.status("r").state is State.READY
    finally:
        agent.close()
        connector.close()


def _forged_begin(source_changes: dict[str, Any], num_src_blocks: int = 16) -> str:
    """Open a transfer by hand with an ipc source altered by `source_changes`: the abort
    reason the agent replies with. The sink is freed and the destination unchanged."""
    src, dst = make_caches(num_src_blocks, seed=1), make_caches(16, seed=2)
    before = clone(dst)
    layout = KVLayout.of(dst, MODEL)
    connector = IpcConnector()
    blocks = PoolBlocks(16)
    agent = TransferAgent(dst, layout, connector, blocks.free)
    try:
        ids = blocks.allocate(2)
        sink = agent.reserve("r", ids, ttl_s=30)
        sender = connector.sender(sink.address)
        rows = torch.stack(src).flatten(-3).flatten(0, 1)  # [2L, N, E], as KVRows sees it
        source = {**connector.export(rows), "block_ids": [0, 1], **source_changes}
        sender.send(Frame({"kind": "begin", "request_id": "r", "layout": layout.to_dict(),
                           "num_blocks": 2, "source": source}))
        reply = sender.poll(timeout=5)
        sender.close()
        assert reply is not None and reply.header["kind"] == "abort"
        assert wait_until(lambda: blocks.num_free == 16) and blocks.frees == [ids]
        assert agent.status("r").state is State.FAILED
        assert_unchanged_except(before, dst, [])
        return reply.header["reason"]
    finally:
        agent.close()
        connector.close()


def test_a_sender_on_another_host_is_refused_before_any_copy() -> None:
    reason = _forged_begin({"host": "another-boot-id"})
    assert "the sender is on another host" in reason


@pytest.mark.parametrize("ids", [[2, 4], [1, 1], [0, 1, 2]], ids=["outside", "twice", "extra"])
def test_sender_block_ids_that_do_not_fit_are_refused(ids: list[int]) -> None:
    reason = _forged_begin({"block_ids": ids}, num_src_blocks=4)
    assert f"sender block ids out of range, repeated or not 2: {ids}" in reason


def test_a_cache_that_does_not_hold_the_layout_is_refused() -> None:
    reason = _forged_begin({"shape": [4, 16, 128]})
    assert "does not hold this layout's blocks" in reason


def test_a_receiver_without_ipc_refuses_an_ipc_sender() -> None:
    src, dst = make_caches(16, seed=1), make_caches(16, seed=2)
    layout = KVLayout.of(dst, MODEL)
    blocks = PoolBlocks(16)
    agent = TransferAgent(dst, layout, TcpConnector(), blocks.free)
    connector = IpcConnector()
    try:
        sink = agent.reserve("r", blocks.allocate(2), ttl_s=30)
        with pytest.raises(TransferError, match="reads through ipc, this receiver through tcp"):
            push(connector, sink, src, [0, 1], layout)
        assert wait_until(lambda: blocks.num_free == 16)
    finally:
        agent.close()
        connector.close()


def test_separately_allocated_layers_are_refused_by_the_sender() -> None:
    src = make_caches(16, seed=1, one_tensor=False)
    sink = SinkInfo("r", "tcp://127.0.0.1:1", (0,), KVLayout.of(src, MODEL).to_dict(), 0.0)
    with pytest.raises(ValueError, match="reads the KV cache as one tensor"):
        KVPush(IpcConnector(), sink, src, [0], KVLayout.of(src, MODEL))


def test_a_receiver_reads_separately_allocated_layers() -> None:
    src = make_caches(16, seed=1)
    dst = make_caches(16, seed=2, one_tensor=False)
    layout = KVLayout.of(dst, MODEL)
    connector = IpcConnector()
    agent = TransferAgent(dst, layout, connector, lambda ids: None)
    try:
        push(connector, agent.reserve("r", [3, 8], ttl_s=30), src, [1, 0], layout)
        assert agent.wait_ready("r", timeout=5)
        assert_blocks_equal(dst, [3, 8], src, [1, 0])
    finally:
        agent.close()
        connector.close()


@needs_cuda
def test_round_trip_on_cuda() -> None:
    connector = IpcConnector()
    roundtrip(connector, torch.bfloat16, [7, 2, 11, 5], [0, 3, 1, 9], device="cuda")
    connector.close()


@needs_cuda
def test_cross_process_cuda_copy_waits_for_the_senders_compute() -> None:
    receiver = "cuda:1" if torch.cuda.device_count() > 1 else "cuda:0"
    _cross_process("cuda:0", receiver, slow=True)
