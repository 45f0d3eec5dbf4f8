"""The prefill role's push, over a real engine loop (a tiny random Llama) and real
sockets: the engine thread never waits on a receiver, the pushed KV is the prefill
node's own, an expired sink is refused, and the begin frame proves the cluster secret."""

from __future__ import annotations

import contextlib
import dataclasses
import socket
import threading
import time
from collections.abc import Iterator

import pytest
import torch
from kv_helpers import PoolBlocks, assert_blocks_equal, make_caches, wait_until

from tandem.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from tandem.engine.llm_engine import LLMEngine
from tandem.engine.request import Request
from tandem.engine.sampling_params import SamplingParams
from tandem.kvtransfer import auth
from tandem.kvtransfer.agent import SinkInfo, State, TransferAgent, TransferStatus
from tandem.kvtransfer.connector import Connector, Frame, TransferError
from tandem.kvtransfer.ipc import IpcConnector
from tandem.kvtransfer.layout import KVLayout
from tandem.kvtransfer.sender import KVPush
from tandem.kvtransfer.tcp import TcpConnector
from tandem.kvtransfer.wire import HostStaging, recv_frame, send_frame
from tandem.node.loop import EngineLoop
from tandem.prefill_node.role import PrefillRole

BLOCK_SIZE = 4  # kv_helpers' caches use it too, so a sink cache is made by make_caches
NUM_BLOCKS = 64
REPLY_TIMEOUT_S = 2.0  # a receiver that never answers fails its push after this
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
SECRET = b"cluster secret"


@dataclasses.dataclass
class Prefill:
    """A prefill role over a real engine loop; on the way to the role's hook, each
    prompt's blocks are recorded, and their KV copied as soon as its last layer is
    computed (what its push must deliver, whatever happens to the blocks later)."""

    engine: LLMEngine
    loop: EngineLoop
    role: PrefillRole
    layout: KVLayout
    pushed_from: dict[str, list[int]]
    computed_kv: dict[str, list[torch.Tensor]]  # per layer [2, blocks, bs, H, D]

    def computed(self) -> int:
        return self.loop.call(lambda e: e.num_prompt_tokens_computed, timeout=10)

    def free_blocks(self) -> int:
        return self.loop.call(lambda e: e.block_pool.num_free_blocks, timeout=10)


@dataclasses.dataclass
class Decode:
    """A real transfer agent over a sink cache of the prefill engine's layout."""

    caches: list[torch.Tensor]
    blocks: PoolBlocks
    agent: TransferAgent

    def reserve(self, rid: str, n: int, ttl_s: float = 30.0) -> SinkInfo:
        return self.agent.reserve(rid, self.blocks.allocate(n), ttl_s=ttl_s)


def _start_prefill(connector: Connector, secret: bytes | None = None,
                   num_blocks: int = NUM_BLOCKS, device: str = "cpu") -> Prefill:
    engine = LLMEngine(EngineConfig(
        # Async scheduling (CUDA's default) on the CPU too: the ipc push's callbacks run
        # as the step is launched, its first token comes as the step lands.
        model="tiny", load_format="dummy", device=device, async_scheduling=True,
        cache=CacheConfig(BLOCK_SIZE, num_blocks),
        scheduler=SchedulerConfig(max_num_batched_tokens=64)))
    loop = EngineLoop(engine)
    layout = KVLayout.of(engine.runner.kv_caches, engine.model_name)
    role = PrefillRole(loop, connector, layout, send_timeout_s=5.0, secret=secret,
                       connect_timeout_s=2.0, reply_timeout_s=REPLY_TIMEOUT_S)
    pushed_from: dict[str, list[int]] = {}
    computed_kv: dict[str, list[torch.Tensor]] = {}
    hook = engine.prefill_hook
    assert hook is not None

    def recording(req: Request):  # noqa: ANN202 - the hook's type
        rid, src = req.request_id, list(req.block_ids)
        pushed_from[rid] = src
        send = hook(req)
        if send is None:
            return None

        def each(layer: int) -> None:
            send(layer)
            if layer == layout.num_layers - 1:  # (on CUDA: enqueued after the writes)
                computed_kv[rid] = [c[:, src].clone() for c in engine.runner.kv_caches]

        return each

    engine.prefill_hook = recording
    return Prefill(engine, loop, role, layout, pushed_from, computed_kv)


def _stop_prefill(p: Prefill) -> None:
    p.role.close()
    p.loop.close()


@pytest.fixture(params=["tcp", "ipc"])
def connector(request: pytest.FixtureRequest) -> Iterator[Connector]:
    c = TcpConnector() if request.param == "tcp" else IpcConnector()
    yield c
    c.close()


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU"))])
def device(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture
def prefill(connector: Connector, device: str) -> Iterator[Prefill]:
    p = _start_prefill(connector, device=device)
    yield p
    _stop_prefill(p)


def _start_decode(prefill: Prefill, connector: Connector) -> Decode:
    shape = prefill.layout
    caches = make_caches(32, seed=7, num_layers=shape.num_layers, heads=shape.num_kv_heads,
                         head_dim=shape.head_dim,
                         device=str(prefill.engine.runner.kv_caches[0].device))
    blocks = PoolBlocks(32)
    agent = TransferAgent(caches, prefill.layout, connector, blocks.free)
    return Decode(caches, blocks, agent)


@pytest.fixture
def decode(prefill: Prefill, connector: Connector) -> Iterator[Decode]:
    d = _start_decode(prefill, connector)
    yield d
    d.agent.close()


def _request(rid: str, n: int, seed: int = 0) -> Request:
    g = torch.Generator().manual_seed(seed)
    return Request(rid, torch.randint(3, 500, (n,), generator=g).tolist(), GREEDY)


def _listener() -> tuple[socket.socket, str]:
    """A raw listening socket that answers nothing on its own, and its tcp address."""
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(10)
    return server, f"tcp://127.0.0.1:{server.getsockname()[1]}"


def _sink(rid: str, address: str, n: int, layout: KVLayout, expires_in: float = 30.0
          ) -> SinkInfo:
    return SinkInfo(rid, address, tuple(range(n)), layout.to_dict(), time.time() + expires_in)


def _in_thread(fn) -> tuple[threading.Thread, list]:  # noqa: ANN001
    """Run fn() on a thread; the list gets its result or its exception."""
    out: list = []

    def run() -> None:
        try:
            out.append(fn())
        except BaseException as exc:  # noqa: BLE001 - looked at by the test
            out.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, out


def _alloc(header: dict) -> torch.Tensor:
    return torch.empty(header["shape"], dtype=getattr(torch, header["dtype"]))


# -- the pushed KV -------------------------------------------------------------------------


@pytest.mark.parametrize("first_block", [0, 2])
def test_the_pushed_kv_is_the_prefill_nodes_own(prefill: Prefill, decode: Decode,
                                                first_block: int) -> None:
    """18 tokens in 5 blocks of 4; the sink takes blocks first_block.. of them, which
    arrive bit-identical to the prefill engine's blocks; every counter counts, and the
    blocks the push held are free again once it ended."""
    n = 5 - first_block
    sink = decode.reserve("kv", n)
    result = prefill.role.prefill(_request("kv", 18), sink, first_block)
    assert decode.agent.wait_ready("kv", timeout=10)
    src = prefill.pushed_from["kv"][first_block:]
    assert len(src) == n
    assert_blocks_equal(decode.caches, sink.block_ids, prefill.engine.runner.kv_caches, src)
    assert_blocks_equal(decode.caches, sink.block_ids, prefill.computed_kv["kv"],
                        range(first_block, 5))
    kv_bytes = n * prefill.layout.block_bytes * prefill.layout.num_layers
    assert result.kv_bytes == kv_bytes and result.cached_tokens == 0
    assert 0 <= result.first_token < 512
    role = prefill.role
    assert (role.kv_bytes_sent, role.transfers_failed) == (kv_bytes, 0)
    assert role.kv_transfer_seconds > 0
    assert prefill.computed() == 18
    assert prefill.free_blocks() == NUM_BLOCKS


@contextlib.contextmanager
def _ipc_pair(connector: IpcConnector) -> Iterator[tuple[Prefill, Decode]]:
    """A prefill role and a transfer agent over `connector`, closed (connector too) after."""
    p = _start_prefill(connector)
    decode = _start_decode(p, connector)
    try:
        yield p, decode
    finally:
        decode.agent.close()
        _stop_prefill(p)
        connector.close()


@contextlib.contextmanager
def _one_step(p: Prefill, prompts: int) -> Iterator[None]:
    """The loop held while the block hands over `prompts` prefills, then let go: the
    step after completes them all. It lets go once every prompt's add is queued on the
    loop, not only registered with the role (a prefill registers, then queues its add:
    one queued late would run in a step of its own)."""
    held, release = threading.Event(), threading.Event()
    p.loop.submit(lambda engine: (held.set(), release.wait(10)))
    assert held.wait(10)
    try:
        yield
        assert wait_until(lambda: len(p.role.request_ids()) == prompts)
        assert wait_until(lambda: p.loop._calls.qsize() >= prompts)
    finally:
        release.set()


class _FramesSeen(IpcConnector):
    """The ipc connector, noting the thread each frame is sent from and its kind (with
    a written message's request ids)."""

    def __init__(self) -> None:
        super().__init__()
        self.sent: list[tuple[int, str, list[str]]] = []

    def sender(self, address: str, timeout: float):  # noqa: ANN201 - the connector's type
        sender = super().sender(address, timeout)
        send = sender.send

        def noted(frame: Frame, timeout: float | None = None) -> None:
            header = frame.header
            rids = [s["request_id"] for s in header.get("sinks", [])] or [header["request_id"]]
            self.sent.append((threading.get_ident(), header["kind"], rids))
            send(frame, timeout)

        sender.send = noted
        return sender


def test_whole_pushes_of_one_step_share_a_thread_and_a_message_and_each_lands_exact() -> None:
    """ipc writes a prompt once its last layer is computed. Eight prompts that one step
    completes (the loop held while they are added) are pushed from one thread (a gang,
    not a thread each), told of in one `written` message (not a begin, a layer and an
    end each), and each sink gets its own prompt's KV."""
    connector = _FramesSeen()
    with _ipc_pair(connector) as (p, decode):
        with _one_step(p, 8):
            sinks = {f"g{i}": decode.reserve(f"g{i}", 2) for i in range(8)}
            calls = [_in_thread(lambda rid=rid, sink=sink, i=i: p.role.prefill(
                _request(rid, 6, seed=10 + i), sink, 0))
                for i, (rid, sink) in enumerate(sinks.items())]
        for thread, out in calls:
            thread.join(10)
            assert out and not isinstance(out[0], BaseException), out
        assert [(kind, sorted(rids)) for _, kind, rids in connector.sent] == [
            ("written", sorted(sinks))]
        for rid, sink in sinks.items():
            assert decode.agent.wait_ready(rid, timeout=5)
            assert_blocks_equal(decode.caches, sink.block_ids, p.computed_kv[rid], range(2))
        assert p.role.transfers_failed == 0
        assert wait_until(lambda: p.free_blocks() == NUM_BLOCKS)


def test_a_stuck_receiver_holds_up_no_push_of_its_step_to_another() -> None:
    """Two prompts one step completes, over ipc: one's sink answers from a socket that
    never replies (its blocks are a real agent's, so the write goes through), the
    other's from the real agent. The second's push ends while the first still waits,
    which fails after its reply timeout."""
    server, address = _listener()
    with _ipc_pair(IpcConnector()) as (p, decode), server:
        with _one_step(p, 2):
            stuck_sink = dataclasses.replace(decode.reserve("stuck", 2), address=address)
            started = time.monotonic()
            stuck, stuck_out = _in_thread(
                lambda: p.role.prefill(_request("stuck", 6, seed=1), stuck_sink, 0))
            ok, ok_out = _in_thread(
                lambda: p.role.prefill(_request("ok", 6, seed=2), decode.reserve("ok", 2), 0))
        ok.join(REPLY_TIMEOUT_S / 2)
        assert not ok.is_alive(), "the push to the good receiver waited for the stuck one"
        assert ok_out and not isinstance(ok_out[0], BaseException), ok_out
        assert stuck.is_alive()
        stuck.join(REPLY_TIMEOUT_S + 5)
        assert isinstance(stuck_out[0], TransferError) and "no 'done'" in str(stuck_out[0])
        assert REPLY_TIMEOUT_S <= time.monotonic() - started < REPLY_TIMEOUT_S + 5
        assert decode.agent.wait_ready("ok", timeout=5)
        assert p.role.transfers_failed == 1
        assert wait_until(lambda: p.free_blocks() == NUM_BLOCKS)


def test_a_prompt_whose_id_the_engine_holds_is_refused_uncounted(prefill: Prefill,
                                                                  decode: Decode) -> None:
    """The engine has a request of that id (waiting behind a busy loop): the prefill
    gets the engine's ValueError, not a failed transfer, and nothing is left held."""
    prefill.loop.submit(lambda e: (e.add(_request("dup", 40, seed=2)), time.sleep(0.3)))
    sink = decode.reserve("dup", 3)
    with pytest.raises(ValueError, match="already in use"):
        prefill.role.prefill(_request("dup", 10), sink, 0)
    assert prefill.role.transfers_failed == 0
    assert wait_until(lambda: (prefill.role._pending, prefill.role._live) == ({}, set()))
    assert wait_until(lambda: prefill.free_blocks() == NUM_BLOCKS)


def _slow_proxy(server: socket.socket, to: str, delay_s: float) -> threading.Thread:
    """Accept one connection on `server`, wait `delay_s`, then carry its bytes both ways
    to and from `to` (a tcp address) until either side closes."""
    host, port = to.removeprefix("tcp://").rsplit(":", 1)

    def pump(a: socket.socket, b: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := a.recv(1 << 16):
                b.sendall(data)
        with contextlib.suppress(OSError):
            b.shutdown(socket.SHUT_WR)

    def run() -> None:
        conn, _ = server.accept()
        time.sleep(delay_s)
        upstream = socket.create_connection((host, int(port)), timeout=10)
        back = threading.Thread(target=pump, args=(upstream, conn), daemon=True)
        back.start()
        pump(conn, upstream)
        back.join(10)
        conn.close()
        upstream.close()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


@pytest.mark.parametrize("connector", ["tcp"], indirect=True)
def test_blocks_are_not_reused_before_a_slow_push_read_them(connector: Connector,
                                                             device: str) -> None:
    """A 12-block engine: a push held up 1 s on its way to the receiver, then a prompt
    that needs 10 blocks, more than the never-used ones. The first push still delivers
    the KV its prompt computed, and the second prompt its own."""
    p = _start_prefill(connector, num_blocks=12, device=device)
    decode = _start_decode(p, connector)
    caches, agent = decode.caches, decode.agent
    server, address = _listener()
    try:
        with server:
            slow = dataclasses.replace(decode.reserve("slow", 5), address=address)
            _slow_proxy(server, agent.address, delay_s=1.0)  # ends as the agent closes
            first, first_out = _in_thread(
                lambda: p.role.prefill(_request("slow", 18, seed=3), slow, 0))
            assert wait_until(lambda: "slow" in p.computed_kv)
            second = decode.reserve("big", 10)
            p.role.prefill(_request("big", 40, seed=4), second, 0)
            first.join(10)
        assert not isinstance(first_out[0], BaseException), first_out
        for rid, sink in (("slow", slow), ("big", second)):
            assert agent.wait_ready(rid, timeout=5)
            assert_blocks_equal(caches, sink.block_ids, p.computed_kv[rid],
                                range(len(sink.block_ids)))
        assert p.role.transfers_failed == 0
        assert wait_until(lambda: p.free_blocks() == 12)
    finally:
        agent.close()
        _stop_prefill(p)


# -- a stuck receiver -----------------------------------------------------------------------


@pytest.mark.parametrize("connector", ["tcp"], indirect=True)
def test_a_stuck_receiver_stalls_only_its_own_push(prefill: Prefill, decode: Decode) -> None:
    """One receiver accepts the connection and then neither reads nor answers. While that
    push waits for its accept, another prefill completes and the loop answers a call at
    once; the stuck push then fails with TransferError after its reply timeout, and is
    counted."""
    server, address = _listener()
    with server:
        started = time.monotonic()
        stuck, stuck_out = _in_thread(lambda: prefill.role.prefill(
            _request("stuck", 10, seed=1), _sink("stuck", address, 3, prefill.layout), 0))
        conn, _ = server.accept()  # the push connected: it now waits for an accept
        with conn:
            result = prefill.role.prefill(_request("ok", 9, seed=2), decode.reserve("ok", 3), 0)
            assert stuck.is_alive(), "the good push waited for the stuck one"
            asked = time.monotonic()
            assert prefill.loop.call(lambda e: e.num_unfinished, timeout=1.0) == 0
            assert time.monotonic() - asked < 1.0
            assert decode.agent.wait_ready("ok", timeout=5)
            assert result.kv_bytes == 3 * prefill.layout.block_bytes * prefill.layout.num_layers
            stuck.join(REPLY_TIMEOUT_S + 5)
    assert not stuck.is_alive()
    assert isinstance(stuck_out[0], TransferError) and "no 'accept'" in str(stuck_out[0])
    assert REPLY_TIMEOUT_S <= time.monotonic() - started < REPLY_TIMEOUT_S + 5
    assert prefill.role.transfers_failed == 1
    assert prefill.role.kv_bytes_sent == result.kv_bytes
    assert wait_until(lambda: prefill.free_blocks() == NUM_BLOCKS)


# -- expiry -----------------------------------------------------------------------------------


@pytest.mark.parametrize("connector", ["tcp"], indirect=True)
def test_an_expired_sink_is_refused_without_computing(prefill: Prefill, decode: Decode
                                                      ) -> None:
    sink = dataclasses.replace(decode.reserve("late", 3), expires_at=time.time() - 1)
    with pytest.raises(TransferError, match="expired"):
        prefill.role.prefill(_request("late", 10), sink, 0)
    assert prefill.computed() == 0
    assert prefill.role.transfers_failed == 1
    assert decode.agent.status("late").state is State.RESERVED  # no begin came


@pytest.mark.parametrize("connector", ["tcp"], indirect=True)
def test_a_sink_that_expires_while_its_prompt_waits_gets_no_push(prefill: Prefill,
                                                                  decode: Decode) -> None:
    """The loop is busy (a call sleeping) past the sink's expiry, so the step that
    computes the prompt finds it expired: no push is opened into it."""
    sink = dataclasses.replace(decode.reserve("waits", 3), expires_at=time.time() + 0.5)
    busy = prefill.loop.submit(lambda _: time.sleep(1.0))
    with pytest.raises(TransferError, match="expired before its prompt was computed"):
        prefill.role.prefill(_request("waits", 10), sink, 0)
    assert busy.done()
    assert decode.agent.status("waits") == TransferStatus(State.RESERVED, 0)
    assert prefill.role.transfers_failed == 1
    assert wait_until(lambda: prefill.free_blocks() == NUM_BLOCKS)


# -- the cluster secret ---------------------------------------------------------------------


@pytest.mark.parametrize("secret", [SECRET, None])
def test_the_begin_frame_proves_the_cluster_secret(secret: bytes | None) -> None:
    """Read with a raw listener: the role's begin carries auth.proof(secret, request id),
    and nothing without a secret; closing the connection then fails the push."""
    connector = TcpConnector()
    p = _start_prefill(connector, secret)
    server, address = _listener()
    try:
        with server:
            thread, out = _in_thread(lambda: p.role.prefill(
                _request("s", 10), _sink("s", address, 3, p.layout), 0))
            conn, _ = server.accept()
            with conn:
                conn.settimeout(10)
                begin = recv_frame(conn, _alloc, HostStaging())
            thread.join(REPLY_TIMEOUT_S + 5)
        assert begin is not None and begin.header["kind"] == "begin"
        assert begin.header["request_id"] == "s"
        if secret is None:
            assert "auth" not in begin.header
        else:
            assert begin.header["auth"] == auth.proof(secret, "s")
            assert begin.header["auth"] != auth.proof(secret, "t")
        assert not thread.is_alive() and isinstance(out[0], TransferError)
    finally:
        _stop_prefill(p)
        connector.close()


def test_an_abort_proves_the_cluster_secret() -> None:
    """A KVPush with the secret, accepted by a raw listener, then aborted: its abort
    frame carries the same proof as its begin."""
    caches = make_caches(8)
    layout = KVLayout.of(caches, "m")
    connector = TcpConnector()
    server, address = _listener()
    with server:
        push = KVPush(connector, _sink("x", address, 2, layout), caches, [3, 5], layout,
                      secret=SECRET, reply_timeout=5)
        thread, out = _in_thread(push.start)
        conn, _ = server.accept()
        with conn:
            conn.settimeout(10)
            begin = recv_frame(conn, _alloc, HostStaging())
            send_frame(conn, Frame({"kind": "accept", "request_id": "x"}), HostStaging())
            thread.join(10)
            assert out == [None]
            push.abort("changed my mind")
            abort = recv_frame(conn, _alloc, HostStaging())
    connector.close()
    assert begin is not None and abort is not None
    assert begin.header["auth"] == abort.header["auth"] == auth.proof(SECRET, "x")
    assert abort.header["kind"] == "abort" and abort.header["reason"] == "changed my mind"
