"""Shared helpers for KV transfer tests, whatever the connector: random caches, exact
comparisons, a thread-safe view of a real BlockPool, bounded waits, and the round trip
every connector must pass (`roundtrip`, `concurrent_roundtrip`)."""

from __future__ import annotations

import multiprocessing
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from tandem.engine.block_pool import BlockPool
from tandem.kvtransfer.agent import SinkInfo, TransferAgent
from tandem.kvtransfer.connector import Connector, Frame, payload_spec
from tandem.kvtransfer.layout import KVLayout
from tandem.kvtransfer.sender import KVPush, push

MODEL = "test-model"
# Small but real: several layers, GQA heads, multi-token blocks.
LAYERS, HEADS, HEAD_DIM, BLOCK_SIZE = 4, 2, 8, 4


def make_caches(
    num_blocks: int,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    device: str = "cpu",
    num_layers: int = LAYERS,
    heads: int = HEADS,
    head_dim: int = HEAD_DIM,
    one_tensor: bool = True,
) -> list[torch.Tensor]:
    """Per-layer caches [2, num_blocks, BLOCK_SIZE, heads, head_dim] of random values:
    views of one tensor, as the engine allocates them (`one_tensor`), or separate ones."""
    g = torch.Generator().manual_seed(seed)
    shape = (num_layers, 2, num_blocks, BLOCK_SIZE, heads, head_dim)
    base = torch.randn(shape, generator=g).to(dtype).to(device)
    layers = list(base.unbind(0))
    return layers if one_tensor else [c.clone() for c in layers]


def clone(caches: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    return [c.clone() for c in caches]


def assert_blocks_equal(
    dst: Sequence[torch.Tensor], dst_ids: Sequence[int],
    src: Sequence[torch.Tensor], src_ids: Sequence[int],
) -> None:
    """Block dst_ids[i] of every layer of dst is bit-identical to block src_ids[i] of src."""
    for layer, (d, s) in enumerate(zip(dst, src)):
        for di, si in zip(dst_ids, src_ids):
            assert torch.equal(d[:, di].cpu(), s[:, si].cpu()), f"layer {layer} block {di}"


def assert_unchanged_except(
    before: Sequence[torch.Tensor], after: Sequence[torch.Tensor], changed: Sequence[int]
) -> None:
    """Every block not in `changed` is bit-identical to the copy taken before."""
    keep = [b for b in range(before[0].shape[1]) if b not in set(changed)]
    for layer, (b, a) in enumerate(zip(before, after)):
        assert torch.equal(b[:, keep].cpu(), a[:, keep].cpu()), f"layer {layer} changed"


def wait_until(pred: Callable[[], bool], timeout: float = 5.0, interval: float = 0.005) -> bool:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            return False
        time.sleep(interval)
    return True


class PoolBlocks:
    """A real BlockPool handing block ids to a TransferAgent; frees are counted and
    serialized, since the agent frees from its reaper and connection threads."""

    def __init__(self, num_blocks: int) -> None:
        self.pool = BlockPool(num_blocks)
        self.frees: list[list[int]] = []
        self._lock = threading.Lock()

    def allocate(self, n: int) -> list[int]:
        with self._lock:
            return [b.block_id for b in self.pool.allocate(n)]

    def free(self, block_ids: list[int]) -> None:
        with self._lock:
            self.frees.append(list(block_ids))
            self.pool.free(self.pool.blocks[i] for i in block_ids)

    @property
    def num_free(self) -> int:
        with self._lock:
            return self.pool.num_free_blocks


def roundtrip(
    connector: Connector,
    dtype: torch.dtype,
    sink_ids: Sequence[int],
    src_ids: Sequence[int],
    num_blocks: int = 16,
    device: str = "cpu",
    one_tensor: bool = True,
) -> None:
    """Push src blocks into sink blocks of a fresh destination: the sink blocks arrive
    bit-identical, every other block is untouched, the agent frees nothing."""
    src = make_caches(num_blocks, dtype, seed=1, device=device, one_tensor=one_tensor)
    dst = make_caches(num_blocks, dtype, seed=2, device=device, one_tensor=one_tensor)
    before = clone(dst)
    layout = KVLayout.of(dst, MODEL)
    freed: list[list[int]] = []
    agent = TransferAgent(dst, layout, connector, freed.append)
    try:
        sink = agent.reserve("rt", sink_ids, ttl_s=30)
        push(connector, sink, src, src_ids, layout)
        assert agent.wait_ready("rt", timeout=10)
        assert agent.release("rt") == tuple(sink_ids)
    finally:
        agent.close()
    assert_blocks_equal(dst, sink_ids, src, src_ids)
    assert_unchanged_except(before, dst, sink_ids)
    assert freed == []


def concurrent_roundtrip(connector: Connector) -> None:
    """Two transfers pushed at once, from two threads, into one destination: each
    arrives bit-identical in its own blocks, every other block is untouched."""
    dst = make_caches(24, torch.bfloat16, seed=3)
    before = clone(dst)
    layout = KVLayout.of(dst, MODEL)
    srcs = [make_caches(8, torch.bfloat16, seed=s) for s in (4, 5)]
    ids = {"a": [7, 2, 11, 5, 20], "b": [0, 23, 13, 8, 1]}
    agent = TransferAgent(dst, layout, connector, lambda ids: None)
    errors: list[BaseException] = []

    def run(rid: str, src: list[torch.Tensor]) -> None:
        try:
            push(connector, agent.reserve(rid, ids[rid], ttl_s=30), src, [0, 1, 2, 3, 4], layout)
        except BaseException as exc:  # noqa: BLE001 - surfaced in the main thread
            errors.append(exc)

    try:
        threads = [threading.Thread(target=run, args=(r, s)) for r, s in zip(ids, srcs)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=20)
        assert not any(t.is_alive() for t in threads) and errors == []
        for rid, src in zip(ids, srcs):
            assert agent.wait_ready(rid, timeout=5)
            assert_blocks_equal(dst, ids[rid], src, [0, 1, 2, 3, 4])
        assert_unchanged_except(before, dst, ids["a"] + ids["b"])
    finally:
        agent.close()


def send_some_layers_then_hang(
    connector_name: str, sink: dict, src_ids: list[int], dtype_name: str, layers: int,
    sent: object, options: dict[str, Any] | None = None,
) -> None:
    """Subprocess body (spawn): open a transfer, send `layers` layers, report through the
    `sent` Event, then wait to be killed. `options` go to get_connector."""
    from tandem.kvtransfer.connector import get_connector

    caches = make_caches(16, getattr(torch, dtype_name), seed=1)
    connector = get_connector(connector_name, **(options or {}))
    p = KVPush(connector, SinkInfo.from_dict(sink), caches, src_ids, KVLayout.of(caches, MODEL),
               connect_timeout=20)
    p.start()
    for layer in range(layers):
        p.send_layer(layer)
    sent.set()  # type: ignore[attr-defined]
    time.sleep(60)  # the parent SIGKILLs us long before this


class Inbox:
    """What a Receiver delivered, for the test thread to wait on."""

    def __init__(self, device: str = "cpu") -> None:
        self.device = device
        self.frames: list[Frame] = []
        self.errors: list[tuple[str, Exception]] = []
        self._cond = threading.Condition()

    def alloc(self, header: dict[str, Any]) -> torch.Tensor:
        dtype, shape = payload_spec(header)
        return torch.empty(shape, dtype=dtype, device=self.device)

    def on_frame(self, frame: Frame) -> None:
        with self._cond:
            self.frames.append(frame)
            self._cond.notify_all()

    def on_error(self, peer: str, exc: Exception) -> None:
        with self._cond:
            self.errors.append((peer, exc))
            self._cond.notify_all()

    def wait(self, frames: int = 0, errors: int = 0, timeout: float = 20.0) -> bool:
        with self._cond:
            return self._cond.wait_for(
                lambda: len(self.frames) >= frames and len(self.errors) >= errors, timeout
            )

    def by_sender(self) -> dict[int, list[Frame]]:
        out: dict[int, list[Frame]] = {}
        for f in self.frames:
            out.setdefault(int(f.header["request_id"]), []).append(f)
        return out


def spawn(target: Any, *args: Any) -> multiprocessing.Process:
    proc = multiprocessing.get_context("spawn").Process(target=target, args=args, daemon=True)
    proc.start()
    return proc


def join_all(*procs: multiprocessing.Process, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    for p in procs:
        p.join(timeout=max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
