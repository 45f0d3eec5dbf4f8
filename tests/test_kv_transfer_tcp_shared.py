"""Pushes share connections: many KV pushes in flight from one process to one transfer
agent ride a handful of tcp connections, every sink gets exactly its own bytes, and a
failure stays with the pushes it belongs to (a killed sender process fails its sinks and
only theirs; one push giving up on a shared connection fails only its own sink)."""

from __future__ import annotations

import multiprocessing
import os
import signal
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
    PoolBlocks,
    assert_blocks_equal,
    assert_unchanged_except,
    clone,
    make_caches,
    spawn,
    wait_until,
)

from tandem.kvtransfer.agent import SinkInfo, State, TransferAgent
from tandem.kvtransfer.connector import Frame, TransferError
from tandem.kvtransfer.layout import KVLayout
from tandem.kvtransfer.sender import KVPush, push
from tandem.kvtransfer.tcp import TcpConnector, TcpReceiver

PUSHES = 200
BLOCKS_PER_PUSH = 2
MAX_LINKS = 4
SECRET = b"cluster secret"


class CountingTcp(TcpConnector):
    """The receiving side's tcp connector, noting the connection (peer) of every frame
    its receiver delivers and the most connections it held open at once."""

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self.peers: set[str] = set()
        self.most_open = 0
        self.receivers: list[TcpReceiver] = []
        self._lock = threading.Lock()

    def receiver(self, host, alloc, on_frame, on_error, port=0):  # noqa: ANN001, ANN201
        def noted(frame: Frame) -> None:
            with self._lock:
                self.peers.add(frame.peer or "")
                self.most_open = max(self.most_open, receiver.connections)
            on_frame(frame)

        receiver = super().receiver(host, alloc, noted, on_error, port)
        self.receivers.append(receiver)
        return receiver


@dataclass
class Dest:
    agent: TransferAgent
    caches: list[torch.Tensor]
    blocks: PoolBlocks
    layout: KVLayout
    connector: CountingTcp


@contextmanager
def _dest(num_blocks: int, secret: bytes | None = None, **options: Any) -> Iterator[Dest]:
    caches = make_caches(num_blocks, seed=2)
    blocks = PoolBlocks(num_blocks)
    layout = KVLayout.of(caches, MODEL)
    connector = CountingTcp(**options)
    agent = TransferAgent(caches, layout, connector, blocks.free, secret=secret)
    try:
        yield Dest(agent, caches, blocks, layout, connector)
    finally:
        agent.close()
        connector.close()


def _push_layer_by_layer(p: KVPush, start: threading.Barrier | None = None) -> None:
    """What the prefill role's transfer thread does with its push."""
    with p:
        if start is not None:
            start.wait(timeout=30)
        p.start()
        for layer in range(p.layout.num_layers):
            p.send_layer(layer)
        p.finish()


def test_200_pushes_at_once_share_a_handful_of_connections() -> None:
    """200 pushes, each on its own thread, all started together from one connector into
    one agent whose receiver would refuse a fifth connection: every one lands exactly
    its own random KV, over at most MAX_LINKS connections."""
    n = PUSHES * BLOCKS_PER_PUSH
    src = make_caches(n, seed=7)  # every source block distinct random KV
    with _dest(n + 8, max_connections=MAX_LINKS) as d:
        before = clone(d.caches)
        sender_side = TcpConnector(max_links=MAX_LINKS)
        sinks: list[SinkInfo] = []
        errors: list[BaseException] = []
        start = threading.Barrier(PUSHES)

        def run(i: int) -> None:
            src_ids = list(range(BLOCKS_PER_PUSH * i, BLOCKS_PER_PUSH * (i + 1)))
            try:
                _push_layer_by_layer(KVPush(sender_side, sinks[i], src, src_ids, d.layout,
                                            reply_timeout=30), start)
            except BaseException as exc:  # noqa: BLE001 - surfaced in the main thread
                errors.append(exc)

        try:
            for i in range(PUSHES):
                sinks.append(d.agent.reserve(f"r{i}", d.blocks.allocate(BLOCKS_PER_PUSH),
                                             ttl_s=60))
            threads = [threading.Thread(target=run, args=(i,)) for i in range(PUSHES)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(timeout=45)
            assert not any(t.is_alive() for t in threads)
        finally:
            sender_side.close()
        assert errors == []
        for i, sink in enumerate(sinks):
            assert d.agent.status(f"r{i}").state is State.READY
            assert d.agent.release(f"r{i}") == sink.block_ids
            assert_blocks_equal(d.caches, sink.block_ids, src,
                                range(BLOCKS_PER_PUSH * i, BLOCKS_PER_PUSH * (i + 1)))
        assert_unchanged_except(before, d.caches, [b for s in sinks for b in s.block_ids])
        assert d.blocks.frees == []
        assert 1 <= len(d.connector.peers) <= MAX_LINKS, d.connector.peers
        assert d.connector.most_open <= MAX_LINKS


def _pushes_then_hang(sinks: list[dict], layers: int, sent: Any) -> None:
    """Subprocess body (spawn): open one push per sink, all on one shared connection, send
    `layers` layers of each, report through `sent`, wait to be killed."""
    caches = make_caches(16, seed=1)
    connector = TcpConnector(max_links=1)
    layout = KVLayout.of(caches, MODEL)
    pushes = [KVPush(connector, SinkInfo.from_dict(s), caches, [2 * i, 2 * i + 1], layout,
                     connect_timeout=20) for i, s in enumerate(sinks)]
    for p in pushes:
        p.start()
    for p in pushes:
        for layer in range(layers):
            p.send_layer(layer)
    sent.set()
    time.sleep(60)  # the parent SIGKILLs us long before this


def test_a_killed_sender_process_fails_its_sinks_and_only_theirs() -> None:
    with _dest(16) as d:
        before = clone(d.caches)
        src = make_caches(16, seed=1)
        theirs = [d.blocks.allocate(2) for _ in range(3)]
        sinks = [d.agent.reserve(f"k{i}", ids, ttl_s=60) for i, ids in enumerate(theirs)]
        mine = d.blocks.allocate(2)
        connector = TcpConnector()
        p = KVPush(connector, d.agent.reserve("mine", mine, ttl_s=60), src, [8, 9], d.layout)
        sent = multiprocessing.get_context("spawn").Event()
        proc = spawn(_pushes_then_hang, [s.to_dict() for s in sinks], 2, sent)
        try:
            with p:
                p.start()
                p.send_layer(0)
                assert sent.wait(timeout=30)
                assert wait_until(lambda: all(
                    d.agent.status(f"k{i}").layers_received == 2 for i in range(3)))
                os.kill(proc.pid, signal.SIGKILL)
                assert wait_until(lambda: len(d.blocks.frees) == 3), "sinks not freed"
                for layer in range(1, d.layout.num_layers):
                    p.send_layer(layer)
                p.finish()
        finally:
            proc.kill()
            proc.join(timeout=10)
            connector.close()
        for i in range(3):
            status = d.agent.status(f"k{i}")
            assert status.state is State.FAILED
            assert "sender connection lost" in (status.reason or "")
        assert sorted(d.blocks.frees) == sorted(theirs)
        assert d.agent.release("mine") == tuple(mine)
        assert_blocks_equal(d.caches, mine, src, [8, 9])
        # The killed pushes' first layers landed in their own sinks; nothing else changed.
        assert_unchanged_except(before, d.caches, mine + [b for ids in theirs for b in ids])
        assert len(d.connector.peers) == 2  # theirs, which three pushes shared, and mine


def test_a_push_giving_up_on_a_shared_connection_fails_only_its_own_sink() -> None:
    with _dest(16) as d:
        src = make_caches(16, seed=1)
        connector = TcpConnector(max_links=1)
        failing, fine = d.blocks.allocate(2), d.blocks.allocate(2)
        other = KVPush(connector, d.agent.reserve("fine", fine, ttl_s=60), src, [0, 1],
                       d.layout)
        try:
            with other:
                other.start()
                other.send_layer(0)
                with pytest.raises(RuntimeError, match="prefill crashed"):
                    with KVPush(connector, d.agent.reserve("x", failing, ttl_s=60), src,
                                [2, 3], d.layout) as p:
                        p.start()
                        p.send_layer(0)
                        raise RuntimeError("prefill crashed")
                assert wait_until(lambda: d.blocks.frees == [failing])
                for layer in range(1, d.layout.num_layers):
                    other.send_layer(layer)
                other.finish()
        finally:
            connector.close()
        assert d.agent.status("x").reason == "aborted by sender: RuntimeError: prefill crashed"
        assert d.agent.release("fine") == tuple(fine)
        assert_blocks_equal(d.caches, fine, src, [0, 1])
        assert len(d.connector.peers) == 1


def test_closing_a_push_mid_transfer_frees_its_sink_at_once() -> None:
    """A push closed with its transfer open (no finish, no exception) leaves the shared
    connection open, so the receiver learns of it by the abort its sender sends."""
    with _dest(16) as d:
        src = make_caches(16, seed=1)
        connector = TcpConnector()
        ids = d.blocks.allocate(2)
        try:
            p = KVPush(connector, d.agent.reserve("left", ids, ttl_s=60), src, [0, 1],
                       d.layout)
            p.start()
            p.send_layer(0)
            p.close()
            assert wait_until(lambda: d.blocks.frees == [ids], timeout=2)
            assert d.agent.status("left").reason == "aborted by sender: sender closed the transfer"
            push(connector, d.agent.reserve("next", d.blocks.allocate(2), ttl_s=60), src,
                 [2, 3], d.layout)
            assert d.agent.wait_ready("next", timeout=5)
        finally:
            connector.close()
        assert len(d.connector.peers) == 1


def test_each_transfer_on_a_shared_connection_proves_the_secret_itself() -> None:
    """Two pushes on one connection, one with the cluster secret and one without: the
    one without is refused and its sink left as it was, the other lands."""
    with _dest(16, secret=SECRET) as d:
        src = make_caches(16, seed=1)
        connector = TcpConnector(max_links=1)
        proven, unproven = d.blocks.allocate(2), d.blocks.allocate(2)
        good = KVPush(connector, d.agent.reserve("good", proven, ttl_s=60), src, [0, 1],
                      d.layout, secret=SECRET)
        try:
            with good:
                good.start()
                with pytest.raises(TransferError, match="without a valid proof"):
                    push(connector, d.agent.reserve("bad", unproven, ttl_s=60), src, [2, 3],
                         d.layout)
                for layer in range(d.layout.num_layers):
                    good.send_layer(layer)
                good.finish()
        finally:
            connector.close()
        assert d.agent.status("bad").state is State.RESERVED and d.blocks.frees == []
        assert d.agent.release("good") == tuple(proven)
        assert_blocks_equal(d.caches, proven, src, [0, 1])
        assert len(d.connector.peers) == 1
