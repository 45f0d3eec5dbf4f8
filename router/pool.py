"""The router's view of its nodes: a gRPC client per node, its last health and load, and
the choice of a decode node (KV headroom and running requests, power of two choices)
and a prefill node (uncached prompt tokens on that node, weighted, plus its queue).

A node is healthy while its Health calls answer; a failed call marks it down at once
(the request retries elsewhere), the next good poll brings it back.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Sequence
from dataclasses import dataclass, field

import grpc

from tandem.protos import node_pb2 as pb
from tandem.protos import node_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

POLL_S = 1.0  # how often each node's health and load are read
CALL_TIMEOUT_S = 5.0


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

    def open(self) -> None:
        self.channel = grpc.aio.insecure_channel(self.address)
        self.stub = pb_grpc.NodeStub(self.channel)

    @property
    def name(self) -> str:
        return f"{pb.Role.Name(self.role).lower()}@{self.address}"

    async def poll(self) -> None:
        try:
            self.health = await self.stub.Health(pb.HealthRequest(), timeout=CALL_TIMEOUT_S)
            self.stats = await self.stub.Stats(pb.StatsRequest(), timeout=CALL_TIMEOUT_S)
        except grpc.aio.AioRpcError as exc:
            if self.healthy:
                log.warning("%s is down: %s", self.name, exc.details())
            self.healthy = False
            return
        up = self.health.role == self.role and self.health.accepting
        if up and not self.healthy:
            log.info("%s is up", self.name)
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
    def __init__(self, prefill: Sequence[str], decode: Sequence[str]) -> None:
        self.prefill = [NodeClient(a, pb.PREFILL) for a in prefill]
        self.decode = [NodeClient(a, pb.DECODE) for a in decode]
        self._task: asyncio.Task | None = None

    @property
    def nodes(self) -> list[NodeClient]:
        return self.prefill + self.decode

    async def start(self) -> None:
        for node in self.nodes:
            node.open()
        await self.poll()
        self._task = asyncio.create_task(self._poll_forever())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
        for node in self.nodes:
            if node.channel is not None:
                await node.channel.close()

    async def poll(self) -> None:
        await asyncio.gather(*(node.poll() for node in self.nodes))

    async def _poll_forever(self) -> None:
        while True:
            await asyncio.sleep(POLL_S)
            await self.poll()

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
