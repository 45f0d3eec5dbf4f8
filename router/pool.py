"""The router's view of its nodes: a gRPC client per node, its last health and load, and
the choice of a decode node (KV headroom and running requests, power of two choices)
and a prefill node (uncached prompt tokens on that node, weighted, plus its queue).

A node is healthy while its Health calls answer and say its engine is alive; a failed
call marks it down at once (the request retries elsewhere), the next good poll brings it
back. A node whose Health poll fails also ends the streams this router waits on there.

Each decode node's generated chunks come through one `Outputs` stream per router
(`NodeClient.follow_outputs`), batched per engine step, and are handed to each request's
queue here; while that stream is not open, requests stream in their own Generate calls.
"""

from __future__ import annotations

import asyncio
import logging
import random
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field

import grpc

from tandem.node import auth
from tandem.node.timeouts import TIMEOUTS
from tandem.protos import node_pb2 as pb
from tandem.protos import node_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

POLL_S = 1.0  # how often each node's health and load are read
OUTPUTS_RETRY_S = 1.0  # a closed Outputs stream is opened again this long after


class OutputsClosed:
    """Put in each waiting request's queue when its node's Outputs stream ends."""

    def __init__(self, why: str) -> None:
        self.why = why


@dataclass(eq=False)
class NodeClient:
    address: str  # host:port of its gRPC server
    role: int  # pb.PREFILL or pb.DECODE, as configured
    channel: grpc.aio.Channel | None = None  # opened on the event loop that uses it
    stub: pb_grpc.NodeStub = field(init=False)
    healthy: bool = False
    health: pb.HealthReply | None = None
    stats: pb.StatsReply | None = None
    in_flight: int = 0  # requests this router has on it now
    # Decode nodes: this router's Outputs stream there, and the requests it feeds.
    subscriber: str = field(default_factory=lambda: f"router-{uuid.uuid4().hex[:12]}")
    outputs_open: bool = False
    waiting: dict[str, asyncio.Queue] = field(default_factory=dict)
    secret: bytes | None = None  # the cluster secret its calls carry

    def open(self) -> None:
        self.channel = grpc.aio.insecure_channel(
            self.address, interceptors=auth.aio_interceptors(self.secret))
        self.stub = pb_grpc.NodeStub(self.channel)

    async def follow_outputs(self) -> None:
        """Keep this router's Outputs stream open and hand each chunk to its request's
        queue; when the stream ends, every waiting request gets `OutputsClosed`."""
        while True:
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
        return f"{pb.Role.Name(self.role).lower()}@{self.address}"

    async def poll(self) -> None:
        try:
            self.health = await self.stub.Health(pb.HealthRequest(), timeout=TIMEOUTS.control_s)
            self.stats = await self.stub.Stats(pb.StatsRequest(), timeout=TIMEOUTS.control_s)
        except grpc.aio.AioRpcError as exc:
            if self.healthy:
                log.warning("%s is down: %s", self.name, exc.details())
            self.healthy = False
            # A node that does not answer Health (stopped, partitioned) may keep its
            # streams open without a word: end them here, so none hangs (those before
            # their first token are retried elsewhere).
            for waiting in self.waiting.values():
                waiting.put_nowait(OutputsClosed(f"{self.name} does not answer: "
                                                 f"{exc.details()}"))
            return
        h = self.health
        up = h.role == self.role and h.accepting and h.engine_alive
        if up and not self.healthy:
            log.info("%s is up", self.name)
        elif self.healthy and not h.engine_alive:
            log.warning("%s is down: its engine is not alive (%s)", self.name, h.engine_error)
        self.healthy = up

    def mark_down(self, why: str) -> None:
        if self.healthy:
            log.warning("%s marked down: %s", self.name, why)
        self.healthy = False

    def load(self) -> float:
        """Lower is better: requests running or waiting here, and how full its KV is."""
        s = self.stats
        busy = self.in_flight + (s.num_running + s.num_waiting + s.num_reserved if s else 0)
        used = 1.0 - s.kv_blocks_free / s.kv_blocks_total if s and s.kv_blocks_total else 0.0
        return busy + 10.0 * used

    def queued_prefill_tokens(self) -> int:
        return self.stats.queued_prefill_tokens if self.stats else 0


class Pool:
    def __init__(self, prefill: Sequence[str], decode: Sequence[str],
                 secret: bytes | None = None) -> None:
        self.prefill = [NodeClient(a, pb.PREFILL, secret=secret) for a in prefill]
        self.decode = [NodeClient(a, pb.DECODE, secret=secret) for a in decode]
        self._polls: list[asyncio.Task] = []
        self._outputs: list[asyncio.Task] = []

    @property
    def nodes(self) -> list[NodeClient]:
        return self.prefill + self.decode

    async def start(self) -> None:
        for node in self.nodes:
            node.open()
        await self.poll()
        # One loop per node: a node slow to answer (stopped, partitioned) leaves the
        # others' health and load fresh.
        self._polls = [asyncio.create_task(self._poll_forever(n)) for n in self.nodes]
        self._outputs = [asyncio.create_task(n.follow_outputs()) for n in self.decode]

    async def close(self) -> None:
        for task in [*self._polls, *self._outputs]:
            task.cancel()
        for node in self.nodes:
            if node.channel is not None:
                await node.channel.close()

    async def poll(self) -> None:
        await asyncio.gather(*(node.poll() for node in self.nodes))

    @staticmethod
    async def _poll_forever(node: NodeClient) -> None:
        while True:
            await asyncio.sleep(POLL_S)
            await node.poll()

    def pick_decode(self, exclude: set[NodeClient] = frozenset()) -> NodeClient | None:
        """Power of two choices among the healthy decode nodes, by load."""
        up = [n for n in self.decode if n.healthy and n not in exclude]
        if len(up) <= 2:
            return min(up, key=NodeClient.load, default=None)
        return min(random.sample(up, 2), key=NodeClient.load)

    def pick_prefill(self, num_tokens: int, cached: dict[str, int] | None = None,
                     token_weight: float = 1.0,
                     exclude: set[NodeClient] = frozenset()) -> NodeClient | None:
        """The healthy prefill node with the least work for a `num_tokens` prompt: the
        tokens it would compute (less what it holds of the prompt, `cached`, by
        address) times `token_weight`, plus the prefill tokens queued there."""
        cached = cached or {}

        def cost(n: NodeClient) -> float:
            uncached = num_tokens - cached.get(n.address, 0)
            return uncached * token_weight + n.queued_prefill_tokens() + n.in_flight

        up = [n for n in self.prefill if n.healthy and n not in exclude]
        return min(up, key=lambda n: (cost(n), random.random()), default=None)  # ties: any
