"""The router's registry of nodes: a gRPC client per node, its role (learned from the
node, which may switch it in place), its state, its last health and load, what it did
over the last minutes, and the choice of a decode node (KV headroom and running
requests, power of two choices) and a prefill node (uncached prompt tokens on that node,
weighted, plus its queue).

Nodes come from the command line and, at run time, from the admin API (`add`, `remove`).
A node's state:
- `up`: its Health answers, its engine is alive and it takes new requests;
- `draining`: it answers but takes no new request (an operator drained it, or it is
  switching role): its running requests finish;
- `down`: its Health does not answer, says its engine failed, or a call to it just
  failed (the request retries elsewhere); the next good poll brings it back.
A node whose Health poll fails also ends the streams this router waits on there.

Each decode node's generated chunks come through one `Outputs` stream per router
(`NodeClient.follow_outputs`), batched per engine step, and are handed to each request's
queue here; while that stream is not open, requests stream in their own Generate calls.
While it is, they go to the node on this router's one Submit stream there (node/submit.py),
or, where the node serves none, each in a call of its own made on a synchronous channel.
"""

from __future__ import annotations

import asyncio
import logging
import random
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import grpc

from tandem.node import auth
from tandem.node.submit import Submitter
from tandem.node.timeouts import TIMEOUTS
from tandem.protos import node_pb2 as pb
from tandem.protos import node_pb2_grpc as pb_grpc
from tandem.router.window import Rates, Window

log = logging.getLogger(__name__)

POLL_S = 1.0  # how often each node's health and load are read
# The Outputs stream reads at most gRPC's default 64 KiB ahead of this router (no growing
# window): a node whose tokens this router is behind on waits to send, and meanwhile
# merges each request's tokens into one chunk, so a router behind costs fewer chunks,
# not more of them queued.
CHANNEL_OPTIONS = [("grpc.http2.bdp_probe", 0)]
OUTPUTS_RETRY_S = 1.0  # a closed Outputs stream is opened again this long after
UP, DRAINING, DOWN = "up", "draining", "down"


@dataclass(frozen=True)
class Cached:
    """A node's leading tokens of a prompt in its prefix cache, and of them the leading
    ones on its device (the rest are in its host tier)."""

    tokens: int
    device_tokens: int


class OutputsClosed:
    """Put in each waiting request's queue when its node's Outputs stream ends."""

    def __init__(self, why: str) -> None:
        self.why = why


def role_name(role: int) -> str | None:
    return pb.Role.Name(role).lower() if role != pb.ROLE_UNSPECIFIED else None


@dataclass(eq=False)
class NodeClient:
    address: str  # host:port of its gRPC server
    role: int = pb.ROLE_UNSPECIFIED  # what its Health says (the start flag's, until then)
    secret: bytes | None = None  # the cluster secret its calls carry
    channel: grpc.aio.Channel | None = None  # opened on the event loop that uses it
    stub: auth.AuthedStub = field(init=False)
    # Generate calls whose chunks come by the Outputs stream start on a synchronous channel
    # (`start_generate`): a grpc.aio call sends its request from a task of its own, which
    # in a burst runs only after every other arrival's handler of that loop round.
    starter: grpc.Channel | None = None
    _start: Callable[..., grpc.Future] | None = field(default=None, init=False, repr=False)
    # Or, where the node serves it, all on this router's one Submit stream there.
    submitter: Submitter | None = field(default=None, init=False, repr=False)
    reachable: bool = False  # its last poll answered, and no call failed since
    health: pb.HealthReply | None = None
    stats: pb.StatsReply | None = None
    in_flight: int = 0  # requests this router has on it now
    # time.monotonic() when the prompts this router sent it would all be computed, at its
    # measured rate (`take_prompt`): its prompt queue's length, as --prefill-overflow-ms
    # judges it.
    prompts_done_at: float = 0.0
    busy_until: float = 0.0  # time.monotonic(): it refused a request for want of room
    switching_to: int | None = None  # an admin role switch in progress
    drains: int = 0  # Drain calls answered: a poll begun before one reads a stale Health
    # Decode nodes: this router's Outputs stream there, and the requests it feeds.
    subscriber: str = field(default_factory=lambda: f"router-{uuid.uuid4().hex[:12]}")
    outputs_open: bool = False
    waiting: dict[str, asyncio.Queue] = field(default_factory=dict)
    # Over the last minutes: request latencies (seconds) and the node's token counters.
    ttft: Window = field(default_factory=Window)
    itl: Window = field(default_factory=Window)
    rates: Rates = field(default_factory=Rates)

    def open(self) -> None:
        self.channel = grpc.aio.insecure_channel(self.address, options=CHANNEL_OPTIONS)
        self.stub = auth.AuthedStub(pb_grpc.NodeStub(self.channel), self.secret)
        self.submitter = Submitter(self.stub, self.address)
        self.open_starter()

    def open_starter(self) -> None:
        self.starter = grpc.insecure_channel(self.address, options=CHANNEL_OPTIONS)
        self._start = auth.AuthedStub(pb_grpc.NodeStub(self.starter), self.secret).Generate

    def start_generate(self, msg: pb.GenerateRequest, timeout: float) -> grpc.Future:
        """A Generate call, its request sent before this returns: a grpc.Future (and
        grpc.Call) whose callbacks run on a gRPC thread. Only for a call that carries no
        chunk (they come by the Outputs stream): its messages are never read."""
        return self._start(msg, timeout=timeout)

    async def close(self) -> None:
        if self.channel is not None:
            await self.channel.close()
        self.close_starter()

    def close_starter(self) -> None:
        if self.starter is not None:
            self.starter.close()
            self.starter = None

    @property
    def state(self) -> str:
        h = self.health
        if not self.reachable or h is None or not h.engine_alive:
            return DOWN
        return UP if h.accepting else DRAINING

    @property
    def healthy(self) -> bool:
        """New requests may go here."""
        return self.state == UP

    async def follow_outputs(self) -> None:
        """While the node is in the decode role, keep this router's Outputs stream open
        and hand each chunk to its request's queue; when the stream ends, every waiting
        request gets `OutputsClosed`."""
        while True:
            if self.role != pb.DECODE or not self.reachable:
                await asyncio.sleep(OUTPUTS_RETRY_S)
                continue
            why = "the Outputs stream ended"
            try:
                async for batch in self.stub.Outputs(
                        pb.OutputsRequest(subscriber=self.subscriber)):
                    self.outputs_open = True
                    for chunk in batch.chunks:
                        waiting = self.waiting.get(chunk.request_id)
                        if waiting is not None:
                            waiting.put_nowait(chunk)
            except grpc.aio.AioRpcError as exc:
                why = f"the Outputs stream failed: {exc.details()}"
            finally:
                if self.outputs_open:
                    log.info("%s: %s", self.name, why)
                self.outputs_open = False
                for waiting in self.waiting.values():
                    waiting.put_nowait(OutputsClosed(why))
            await asyncio.sleep(OUTPUTS_RETRY_S)

    @property
    def name(self) -> str:
        return f"{role_name(self.role) or 'node'}@{self.address}"

    async def poll(self) -> None:
        before, drains = self.state, self.drains
        try:
            health = await self.stub.Health(pb.HealthRequest(), timeout=TIMEOUTS.control_s)
            self.stats = await self.stub.Stats(pb.StatsRequest(), timeout=TIMEOUTS.control_s)
        except grpc.aio.AioRpcError as exc:
            if before != DOWN:
                log.warning("%s is down: %s", self.name, exc.details())
            self.reachable = False
            # A node that does not answer Health (stopped, partitioned) may keep its
            # streams open without a word: end them here, so none hangs (those before
            # their first token are retried elsewhere).
            for waiting in self.waiting.values():
                waiting.put_nowait(OutputsClosed(f"{self.name} does not answer: "
                                                 f"{exc.details()}"))
            return
        if drains != self.drains and self.health is not None:
            health.accepting = self.health.accepting  # the drain's word, not the older poll's
        if health.role != self.role and self.role != pb.ROLE_UNSPECIFIED:
            log.info("%s now serves the %s role", self.name, role_name(health.role))
        self.role, self.health, self.reachable = health.role, health, True
        s = self.stats
        self.rates.read((s.prompt_tokens_computed, s.generation_tokens))
        after = self.state
        if after != before:
            why = f": its engine is not alive ({health.engine_error})" if after == DOWN else ""
            log.log(logging.WARNING if after == DOWN else logging.INFO, "%s is %s%s",
                    self.name, after, why)

    def mark_down(self, why: str) -> None:
        if self.reachable:
            log.warning("%s marked down: %s", self.name, why)
        self.reachable = False

    def load(self) -> float:
        """Lower is better: requests running or waiting here, and how full its KV is."""
        s = self.stats
        busy = self.in_flight + (s.num_running + s.num_waiting + s.num_reserved if s else 0)
        used = 1.0 - s.kv_blocks_free / s.kv_blocks_total if s and s.kv_blocks_total else 0.0
        return busy + 10.0 * used

    def queued_prefill_tokens(self) -> int:
        return self.stats.queued_prefill_tokens if self.stats else 0

    def prefill_rate(self) -> float | None:
        """Prompt tokens a second its steps computed, as it last said; None until it has
        computed any."""
        s = self.stats
        if s is None or not s.prompt_step_seconds:
            return None
        return s.prompt_tokens_timed / s.prompt_step_seconds

    def prompt_wait(self, tokens: int, rate: float, now: float) -> float:
        """Seconds until `tokens` more prompt tokens would be computed here, at `rate` a
        second, after the prompts this router sent before them."""
        return max(0.0, self.prompts_done_at - now) + tokens / rate

    def take_prompt(self, tokens: int, rate: float | None, now: float) -> None:
        """`tokens` prompt tokens sent here, to be computed after the others at `rate` a
        second (none counted without a rate). A clock rather than a count of prompts not
        yet answered: a prompt is done here when its last step is, while its first token
        reaches this router only after its KV's transfer and the decode node's next step,
        which a count would add to the queue."""
        if rate:
            self.prompts_done_at = max(now, self.prompts_done_at) + tokens / rate

    def host_token_cost(self) -> float:
        """What a prompt token copied back from its host tier costs here, in computed
        tokens: its measured prefill rate over its measured host-tier rate; 0 (as good
        as a device hit) until both are measured."""
        s, h, computed_per_s = self.stats, self.health, self.prefill_rate()
        if s is None or h is None or computed_per_s is None or not s.host_load_seconds:
            return 0.0
        loaded_per_s = s.host_blocks_timed * h.layout.block_size / s.host_load_seconds
        return computed_per_s / loaded_per_s


    def pull_token_cost(self) -> float:
        """What a prompt token pulled here from a peer costs, in tokens computed here: its
        KV bytes over this node's measured pull rate (call to arrival), against its
        measured prefill rate; 0 (as good as a hit) until both are measured."""
        s, h, computed_per_s = self.stats, self.health, self.prefill_rate()
        if s is None or h is None or computed_per_s is None or not s.kv_pull_seconds:
            return 0.0
        pulled_per_s = s.kv_bytes_pulled / s.kv_pull_seconds
        return computed_per_s * token_bytes(h.layout) / pulled_per_s


# A prefix pull from a peer is asked for only where it brings at least this many tokens
# more than the prefill node holds (node/pull.py pulls whole blocks, two at least).
MIN_PULL_TOKENS = 32
# What a pulled token costs at least, in computed tokens: a node holding a prefix itself
# beats one that would pull it, all else equal.
_PULL_OVER_HIT = 1e-3


def token_bytes(layout: pb.KVLayout) -> int:
    """One token's KV, every layer, keys and values."""
    size = _DTYPE_BYTES.get(layout.dtype.removeprefix("torch."), 2)
    return 2 * layout.num_layers * layout.num_kv_heads * layout.head_dim * size


_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1,
                "float8_e5m2": 1}


class PoolListener(Protocol):
    def added(self, node: NodeClient) -> None: ...
    def removed(self, node: NodeClient) -> None: ...


class Pool:
    def __init__(self, prefill: Sequence[str], decode: Sequence[str],
                 secret: bytes | None = None, nodes: Sequence[str] = ()) -> None:
        """`prefill` and `decode`: nodes expected in that role (their Health has the last
        word); `nodes`: nodes whose role is learned from their Health."""
        self.secret = secret
        self.nodes: list[NodeClient] = (
            [NodeClient(a, pb.PREFILL, secret) for a in prefill]
            + [NodeClient(a, pb.DECODE, secret) for a in decode]
            + [NodeClient(a, pb.ROLE_UNSPECIFIED, secret) for a in nodes])
        self.listeners: list[PoolListener] = []  # told of each node added or removed
        self.ttft, self.itl = Window(), Window()  # this router's requests, all nodes
        self._tasks: dict[NodeClient, list[asyncio.Task]] = {}

    @property
    def prefill(self) -> list[NodeClient]:
        return [n for n in self.nodes if n.role == pb.PREFILL]

    @property
    def decode(self) -> list[NodeClient]:
        return [n for n in self.nodes if n.role == pb.DECODE]

    def find(self, address: str) -> NodeClient | None:
        return next((n for n in self.nodes if n.address == address), None)

    async def start(self) -> None:
        for node in self.nodes:
            node.open()
        await self.poll()
        for node in self.nodes:
            self._watch(node)

    async def close(self) -> None:
        for node in list(self.nodes):
            self.remove(node)
            await node.close()

    async def add(self, address: str, role: int = pb.ROLE_UNSPECIFIED) -> NodeClient:
        """A node put in service at run time, once its Health answers. Raises
        ValueError (already known; a different role than `role`) or LookupError (no
        answer)."""
        if self.find(address) is not None:
            raise ValueError(f"{address} is already a node of this router")
        node = NodeClient(address, role, self.secret)
        node.open()
        await node.poll()
        try:
            if not node.reachable:
                raise LookupError(f"no node answers at {address}")
            if role not in (pb.ROLE_UNSPECIFIED, node.health.role):
                raise ValueError(f"{address} is in the {role_name(node.health.role)} role, "
                                 f"not {role_name(role)}")
        except (LookupError, ValueError):
            await node.channel.close()
            raise
        if self.find(address) is not None:  # added meanwhile by another call
            await node.channel.close()
            raise ValueError(f"{address} is already a node of this router")
        self.nodes.append(node)
        self._watch(node)
        for listener in self.listeners:
            listener.added(node)
        log.info("%s added (%s)", node.name, node.state)
        return node

    def remove(self, node: NodeClient) -> None:
        """Nothing more goes to `node` or is read from it; its channel stays open for
        the caller's last calls (`NodeClient.close`)."""
        for task in self._tasks.pop(node, []):
            task.cancel()
        if node in self.nodes:
            self.nodes.remove(node)
            for listener in self.listeners:
                listener.removed(node)

    def _watch(self, node: NodeClient) -> None:
        # One poll loop per node: a node slow to answer (stopped, partitioned) leaves the
        # others' health and load fresh.
        self._tasks[node] = [asyncio.create_task(self._poll_forever(node)),
                             asyncio.create_task(node.follow_outputs()),
                             asyncio.create_task(node.submitter.run(
                                 lambda: node.outputs_open and node.reachable))]

    def record_ttft(self, seconds: float, *nodes: NodeClient | None) -> None:
        self.ttft.add(seconds)
        for node in nodes:
            if node is not None:
                node.ttft.add(seconds)

    def record_itl(self, seconds: float, decode: NodeClient) -> None:
        self.itl.add(seconds)
        decode.itl.add(seconds)

    async def poll(self) -> None:
        await asyncio.gather(*(node.poll() for node in self.nodes))

    @staticmethod
    async def _poll_forever(node: NodeClient) -> None:
        while True:
            await asyncio.sleep(POLL_S)
            await node.poll()

    def peer_prefixes(self, cached: dict[str, Cached]) -> list[tuple[int, bool, NodeClient]]:
        """The reachable nodes that hold some of a prompt (`cached`, by address), most
        first (ties: prefill nodes first): (tokens held, in either tier; is a prefill
        node; the node)."""
        held = [(cached[n.address].tokens, n in self.prefill, n) for n in self.nodes
                if n.reachable and n.address in cached]
        return sorted(held, key=lambda h: h[:2], reverse=True)

    def pick_decode(self, exclude: set[NodeClient] = frozenset()) -> NodeClient | None:
        """Power of two choices among the healthy decode nodes, by load."""
        up = [n for n in self.decode if n.healthy and n not in exclude]
        if len(up) <= 2:
            return min(up, key=NodeClient.load, default=None)
        return min(random.sample(up, 2), key=NodeClient.load)

    def pick_prefill(self, num_tokens: int, cached: dict[str, Cached] | None = None,
                     token_weight: float = 1.0, exclude: set[NodeClient] = frozenset(),
                     pull: str = "never") -> NodeClient | None:
        """The healthy prefill node with the least work for a `num_tokens` prompt: the
        tokens it would compute (less what it holds of the prompt, `cached`, by
        address), those it holds in its host tier at their measured cost
        (`host_token_cost`), and with `pull` (auto, always) those it would pull from the
        peer that holds the most of them at theirs (`pull_token_cost`; always: none),
        times `token_weight`, plus the prefill tokens queued there."""
        cached = cached or {}
        peers = self.peer_prefixes(cached) if pull != "never" else []

        def cost(n: NodeClient) -> float:
            held = cached.get(n.address, Cached(0, 0))
            host = held.tokens - held.device_tokens
            work = num_tokens - held.tokens + host * n.host_token_cost()
            pullable = next((t for t, _, peer in peers if peer is not n), 0) - held.tokens
            if pullable >= MIN_PULL_TOKENS:  # dearer than a hit here, whatever is measured
                price = 0.0 if pull == "always" else min(1.0, n.pull_token_cost())
                work -= pullable * (1.0 - max(price, _PULL_OVER_HIT))
            return work * token_weight + n.queued_prefill_tokens() + n.in_flight

        up = [n for n in self.prefill if n.healthy and n not in exclude]
        return min(up, key=lambda n: (cost(n), random.random()), default=None)  # ties: any
