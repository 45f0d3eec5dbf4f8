"""The ipc connector: the sender maps the receiving agent's KV cache (shared memory on
CPU, CUDA IPC on GPU) and writes the sink's blocks into it itself. Round trips in one
process and across processes, layer by layer, the checks that refuse what it can't
write, the write guard that stops a late push, and the mapping's lifetime. Its failure
cases run in test_kv_transfer_failures.py, with tcp's; the CUDA tests at the end need a
GPU (two for the cross-GPU one)."""

from __future__ import annotations

import dataclasses
import multiprocessing
from collections.abc import Iterator
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
from tandem.kvtransfer.ipc import IpcConnector, Target
from tandem.kvtransfer.layout import KVLayout
from tandem.kvtransfer.sender import KVPush, push, send_written, write_together
from tandem.kvtransfer.tcp import TcpConnector

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@dataclasses.dataclass
class Dest:
    """An ipc receiver over a 16-block pool, and a source cache to push from."""

    src: list[torch.Tensor]
    dst: list[torch.Tensor]
    layout: KVLayout
    connector: IpcConnector
    blocks: PoolBlocks
    agent: TransferAgent


@pytest.fixture
def dest() -> Iterator[Dest]:
    src, dst = make_caches(16, seed=1), make_caches(16, seed=2)
    layout, connector, blocks = KVLayout.of(dst, MODEL), IpcConnector(), PoolBlocks(16)
    agent = TransferAgent(dst, layout, connector, blocks.free)
    yield Dest(src, dst, layout, connector, blocks, agent)
    agent.close()
    connector.close()


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
    finally:
        agent.close()
        connector.close()


def test_round_trip_from_another_process() -> None:
    _cross_process("cpu", "cpu", slow=False)


def test_each_layer_is_copied_as_it_is_announced(dest: Dest) -> None:
    src, dst, agent = dest.src, dest.dst, dest.agent
    sink = agent.reserve("r", [9, 4], ttl_s=30)
    with KVPush(dest.connector, sink, src, [1, 2], dest.layout) as p:
        p.start()
        for layer in range(dest.layout.num_layers):
            p.send_layer(layer)
            assert wait_until(lambda n=layer + 1: agent.status("r").layers_received == n)
            assert_blocks_equal(dst[:layer + 1], [9, 4], src[:layer + 1], [1, 2])
        p.finish()
    assert agent.status("r").state is State.READY


def receive_in_another_process(result: Any, go: Any) -> None:
    """Subprocess body (spawn): an agent that hands out one sink, checks what lands."""
    try:
        dst = make_caches(16, seed=2)
        connector = IpcConnector()
        agent = TransferAgent(dst, KVLayout.of(dst, MODEL), connector, lambda ids: None)
        result.put(agent.reserve("r", [6, 1], ttl_s=60).to_dict())
        ok = agent.wait_ready("r", timeout=60)
        assert_blocks_equal(dst, [6, 1], make_caches(16, seed=1), [2, 3])
        result.put("ok" if ok else f"not ready: {agent.status('r')}")
        go.wait(60)  # until the test has looked at its mapping of this cache
        agent.close()
        connector.close()
    except BaseException as exc:  # noqa: BLE001 - reported to the test
        result.put(f"{type(exc).__name__}: {exc}")


def test_a_mapping_lives_until_its_receiver_is_gone() -> None:
    ctx = multiprocessing.get_context("spawn")
    result, go = ctx.Queue(), ctx.Event()
    proc = ctx.Process(target=receive_in_another_process, args=(result, go))
    proc.start()
    connector = IpcConnector()
    try:
        src = make_caches(16, seed=1)
        sink = SinkInfo.from_dict(result.get(timeout=120))
        push(connector, sink, src, [2, 3], KVLayout.of(src, MODEL))
        assert result.get(timeout=60) == "ok"
        assert len(connector.mapped) == 2  # its cache and its tags, kept for the next push
        connector.mapped.prune()
        assert len(connector.mapped) == 2  # still alive
        go.set()
        proc.join(timeout=30)
        assert proc.exitcode == 0
        connector.mapped.prune()
        assert len(connector.mapped) == 0
    finally:
        go.set()
        if proc.is_alive():
            proc.kill()
        connector.close()


def _forged_target(dest: Dest, changes: dict[str, Any], sink_ids: list[int] | None = None,
                   cache: dict[str, Any] | None = None) -> str:
    """Push into a sink whose target (`changes`, and `cache`: changes to the cache's
    description) or block ids were altered: the error the sender raises. The sink is
    freed at once and the destination unchanged."""
    before = clone(dest.dst)
    ids = dest.blocks.allocate(2)
    sink = dest.agent.reserve("r", ids, ttl_s=30)
    assert sink.target is not None
    target = {**sink.target, **changes}
    target["cache"] = {**target["cache"], **(cache or {})}
    forged = dataclasses.replace(sink, target=target, block_ids=tuple(sink_ids or sink.block_ids))
    with pytest.raises(TransferError) as raised:
        push(dest.connector, forged, dest.src, [0, 1][:len(forged.block_ids)], dest.layout)
    assert wait_until(lambda: dest.blocks.num_free == 16) and dest.blocks.frees == [ids]
    assert dest.agent.status("r").state is State.FAILED
    assert_unchanged_except(before, dest.dst, [])
    return str(raised.value)


def test_a_receiver_on_another_host_is_refused_before_any_write(dest: Dest) -> None:
    reason = _forged_target(dest, {}, cache={"host": "another-boot"})
    assert "the peer is on another host" in reason


def test_sink_block_ids_out_of_range_are_refused(dest: Dest) -> None:
    assert "sink block ids out of range: [3, 16]" in _forged_target(dest, {}, sink_ids=[3, 16])


def test_a_cache_that_does_not_hold_the_layout_is_refused(dest: Dest) -> None:
    reason = _forged_target(dest, {}, cache={"shape": [4, 16, 128]})
    assert "does not hold this layout's blocks" in reason


def test_a_target_of_another_layout_is_refused(dest: Dest) -> None:
    other = make_caches(16, seed=1, head_dim=4, heads=4)  # same bytes per block
    reason = _forged_target(dest, {"layout": KVLayout.of(other, MODEL).to_dict()})
    assert "num_kv_heads: 4 on the receiver vs 2 on the sender" in reason


def test_a_late_push_writes_nothing(dest: Dest) -> None:
    """The write guard: a push after its sink expired, into blocks reserved again for
    another request, changes none of them; the new owner's push still lands, and a
    second push with its SinkInfo after the blocks were released writes nothing."""
    src, dst, agent = dest.src, dest.dst, dest.agent
    ids = dest.blocks.allocate(2)
    stale = agent.reserve("old", ids, ttl_s=0.2)
    assert wait_until(lambda: dest.blocks.num_free == 16)
    fresh = agent.reserve("new", ids, ttl_s=30)  # the same blocks, a new owner
    before = clone(dst)
    with pytest.raises(TransferError, match="no open reservation for 'old'"):
        push(dest.connector, stale, src, [0, 1], dest.layout)
    assert_unchanged_except(before, dst, [])
    push(dest.connector, fresh, src, [4, 5], dest.layout)
    assert agent.wait_ready("new", timeout=5)
    assert_blocks_equal(dst, ids, src, [4, 5])
    agent.release("new")
    landed = clone(dst)
    with pytest.raises(TransferError, match="no open reservation for 'new'"):
        push(dest.connector, fresh, src, [6, 7], dest.layout)
    assert_unchanged_except(landed, dst, [])


def _reserve_many_and_push(device: str) -> None:
    """Sinks opened together (`reserve_many`, as a decode node's prealloc queue opens a
    burst's) each get their own ticket; a bad entry fails alone, in its place; each sink
    takes its own push, and only into its own blocks."""
    src, dst = make_caches(16, seed=1, device=device), make_caches(16, seed=2, device=device)
    before = clone(dst)
    layout, connector = KVLayout.of(dst, MODEL), IpcConnector()
    agent = TransferAgent(dst, layout, connector, lambda ids: None)
    try:
        agent.reserve("held", [9], ttl_s=30)
        made = agent.reserve_many([("a", [2, 7], 30), ("bad", [99], 30), ("b", [4], 30),
                                   ("taken", [9, 10], 30), ("a", [11], 30), ("c", [0, 5, 6], 30)])
        assert isinstance(made[1], ValueError) and "distinct, in [0, 16)" in str(made[1])
        assert isinstance(made[3], ValueError) and "[9] are already reserved" in str(made[3])
        assert isinstance(made[4], ValueError) and "already holds a reservation" in str(made[4])
        sinks = {m.request_id: m for m in made if isinstance(m, SinkInfo)}
        assert sorted(sinks) == ["a", "b", "c"]
        assert len({s.target["ticket"] for s in sinks.values()}) == 3
        sources = {"a": [0, 1], "b": [3], "c": [12, 13, 14]}
        for rid in ("c", "a", "b"):
            push(connector, sinks[rid], src, sources[rid], layout)
            assert agent.wait_ready(rid, timeout=5)
            agent.release(rid)
        for rid, sink in sinks.items():
            assert_blocks_equal(dst, list(sink.block_ids), src, sources[rid])
        assert_unchanged_except(before, dst, [2, 7, 4, 0, 5, 6])
    finally:
        agent.close()
        connector.close()


def test_sinks_reserved_together_take_their_own_pushes() -> None:
    _reserve_many_and_push("cpu")


def _written_together(device: str) -> None:
    """Whole pushes told of in one `written` message (the prefill role's pushes of one
    step): each sink is answered alone. Two land exact, their first tokens heard; one
    whose reservation was aborted meanwhile, and one without the cluster secret's proof,
    are refused, the second leaving its sink reserved (a forged begin takes nothing
    over). The two done are answered in one frame."""
    src, dst = make_caches(16, seed=1, device=device), make_caches(16, seed=2, device=device)
    layout, connector, blocks = KVLayout.of(dst, MODEL), IpcConnector(), PoolBlocks(16)
    firsts: dict[str, int] = {}
    agent = TransferAgent(dst, layout, connector, blocks.free, secret=b"s",
                          on_end=lambda rid, token: firsts.__setitem__(rid, token))
    try:
        sinks = {rid: agent.reserve(rid, blocks.allocate(2), ttl_s=30)
                 for rid in ("a", "gone", "forged", "b")}
        sources = {"a": [0, 1], "gone": [2, 3], "forged": [4, 5], "b": [6, 7]}
        pushes = [KVPush(connector, sinks[rid], src, sources[rid], layout, all_computed=True,
                         secret=b"wrong" if rid == "forged" else b"s") for rid in sinks]
        for p in pushes:
            p.write()
        assert agent.abort("gone")
        sent, reply = [], agent._receiver.reply  # the frames the receiver answers with
        agent._receiver.reply = lambda peer, frame: (sent.append(frame.header),
                                                     reply(peer, frame))
        ends = dict(zip(sinks, send_written(pushes, [5, 8, 9, 6]), strict=True))
        assert ends["a"] is None and ends["b"] is None, ends
        assert isinstance(ends["gone"], TransferError) and "no open reservation" in str(
            ends["gone"])
        assert isinstance(ends["forged"], TransferError) and "valid proof" in str(
            ends["forged"])
        assert firsts == {"a": 5, "b": 6}
        assert [h for h in sent if h["kind"] == "done"] == [
            {"kind": "done", "request_id": "a", "more": ["b"]}]  # one frame for both
        assert agent.status("forged").state is State.RESERVED
        for rid in ("a", "b"):
            assert agent.status(rid).state is State.READY
            assert_blocks_equal(dst, list(sinks[rid].block_ids), src, sources[rid])
        assert blocks.num_free == 16 - 6  # gone's went back
    finally:
        agent.close()
        connector.close()


def test_whole_pushes_told_together_are_answered_each_alone() -> None:
    _written_together("cpu")


def _written_in_one_copy(device: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """`write_together`: the pushes into one receiver's cache are written by one copy,
    each block against its own sink's ticket. A sink aborted before the copy keeps its
    blocks as they were (its tags are cleared); a push whose sink can't be written
    fails alone; the others land exact once told of (`send_written`)."""
    src, dst = make_caches(16, seed=1, device=device), make_caches(16, seed=2, device=device)
    layout, connector, blocks = KVLayout.of(dst, MODEL), IpcConnector(), PoolBlocks(16)
    agent = TransferAgent(dst, layout, connector, blocks.free)
    planned = []
    plan_write = Target.plan_write
    monkeypatch.setattr(Target, "plan_write",
                        lambda self, *a: planned.append(a) or plan_write(self, *a))
    try:
        sinks = {rid: agent.reserve(rid, blocks.allocate(n), ttl_s=30)
                 for rid, n in (("a", 2), ("gone", 3), ("bad", 1), ("b", 1))}
        sinks["bad"] = dataclasses.replace(sinks["bad"], block_ids=[99])
        sources = {"a": [0, 1], "gone": [2, 3, 4], "bad": [5], "b": [9]}
        before = clone(dst)
        assert agent.abort("gone")
        pushes = [KVPush(connector, sinks[rid], src, sources[rid], layout, all_computed=True)
                  for rid in sinks]
        ends = dict(zip(sinks, write_together(pushes), strict=True))
        assert isinstance(ends.pop("bad"), TransferError)
        assert ends == {"a": None, "gone": None, "b": None}
        assert len(planned) == 1 and planned[0][1].shape == (2, 6)  # a's, gone's, b's
        told = [p for p in pushes if p.sink.request_id != "bad"]
        replies = dict(zip(["a", "gone", "b"], send_written(told, [1, 2, 3]), strict=True))
        assert replies["a"] is None and replies["b"] is None, replies
        assert "no open reservation" in str(replies["gone"])
        for rid in ("a", "b"):
            assert agent.status(rid).state is State.READY
            assert_blocks_equal(dst, list(sinks[rid].block_ids), src, sources[rid])
        assert_unchanged_except(before, dst, [*sinks["a"].block_ids, *sinks["b"].block_ids])
    finally:
        agent.close()
        connector.close()


def test_whole_pushes_into_one_cache_are_written_by_one_copy(
        monkeypatch: pytest.MonkeyPatch) -> None:
    _written_in_one_copy("cpu", monkeypatch)


def test_a_receiver_without_ipc_refuses_an_ipc_sender() -> None:
    src, dst = make_caches(16, seed=1), make_caches(16, seed=2)
    layout = KVLayout.of(dst, MODEL)
    blocks = PoolBlocks(16)
    agent = TransferAgent(dst, layout, TcpConnector(), blocks.free)
    connector = IpcConnector()
    try:
        sink = agent.reserve("r", blocks.allocate(2), ttl_s=30)
        with pytest.raises(TransferError, match="takes no ipc writes: its receiver's "
                                                "connector is not ipc"):
            push(connector, sink, src, [0, 1], layout)
        assert wait_until(lambda: blocks.num_free == 16)
    finally:
        agent.close()
        connector.close()


def test_a_tcp_receiver_refuses_ipc_writes() -> None:
    """An ipc sender's begin reaching a receiver that takes no writes is refused."""
    dst = make_caches(16, seed=2)
    layout = KVLayout.of(dst, MODEL)
    blocks = PoolBlocks(16)
    agent = TransferAgent(dst, layout, TcpConnector(), blocks.free)
    connector = TcpConnector()
    try:
        sink = agent.reserve("r", blocks.allocate(2), ttl_s=30)
        sender = connector.sender(sink.address)
        sender.send(Frame({"kind": "begin", "request_id": "r", "layout": layout.to_dict(),
                           "num_blocks": 2, "writer": {"pid": 1, "event": None}}))
        reply = sender.poll(timeout=5)
        sender.close()
        assert reply is not None and reply.header["kind"] == "abort"
        assert "the sender writes through ipc, this receiver takes tcp" in reply.header["reason"]
        assert wait_until(lambda: blocks.num_free == 16)
    finally:
        agent.close()
        connector.close()


def test_separately_allocated_layers_are_refused_by_the_sender() -> None:
    src = make_caches(16, seed=1, one_tensor=False)
    sink = SinkInfo("r", "tcp://127.0.0.1:1", (0,), KVLayout.of(src, MODEL).to_dict(), 0.0)
    with pytest.raises(ValueError, match="reads the KV cache as one tensor"):
        KVPush(IpcConnector(), sink, src, [0], KVLayout.of(src, MODEL))


def test_separately_allocated_layers_are_refused_by_the_receiver() -> None:
    dst = make_caches(16, seed=2, one_tensor=False)
    with pytest.raises(ValueError, match="writes into the KV cache as one tensor"):
        TransferAgent(dst, KVLayout.of(dst, MODEL), IpcConnector(), lambda ids: None)


@needs_cuda
def test_round_trip_on_cuda() -> None:
    connector = IpcConnector()
    roundtrip(connector, torch.bfloat16, [7, 2, 11, 5], [0, 3, 1, 9], device="cuda")
    connector.close()


@needs_cuda
def test_sinks_reserved_together_take_their_own_pushes_on_cuda() -> None:
    _reserve_many_and_push("cuda")


@needs_cuda
def test_whole_pushes_told_together_are_answered_each_alone_on_cuda() -> None:
    _written_together("cuda")


@needs_cuda
def test_whole_pushes_into_one_cache_are_written_by_one_copy_on_cuda(
        monkeypatch: pytest.MonkeyPatch) -> None:
    _written_in_one_copy("cuda", monkeypatch)


@needs_cuda
def test_cross_process_cuda_copy_waits_for_the_senders_compute() -> None:
    receiver = "cuda:1" if torch.cuda.device_count() > 1 else "cuda:0"
    _cross_process("cuda:0", receiver, slow=True)
