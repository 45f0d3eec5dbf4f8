"""One request through the pools (DESIGN.md, request flow, steps 2 to 7):

1. pick a decode node and reserve the prompt's blocks there (its prefix cache counts);
2. if the tokens it lacks are fewer than `local_prefill_threshold`, it prefills itself;
   else pick a prefill node, which computes the prompt and pushes its KV into the sink;
3. stream the tokens the decode node generates.

Failures: a decode node that fails before the first token reached the client is marked
down and the request starts over on another; a prefill node or transfer that fails
leaves the prompt to the decode node (`on_transfer_failure="recompute"`, the default)
or fails the request ("fail"). A client that goes away, or any other end before the
last token, aborts the request on every node it touched, which frees its blocks.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc

from tandem.protos import node_pb2 as pb
from tandem.router.index import RouterIndex
from tandem.router.metrics import RouterMetrics
from tandem.router.pool import NodeClient, Pool
from tandem.router.protocol import APIError

log = logging.getLogger(__name__)

_RETRY_CODES = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
                grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.FAILED_PRECONDITION,
                grpc.StatusCode.CANCELLED, grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL}


class StreamBroken(Exception):
    """The decode node failed after tokens reached the client: the stream ends in error."""


@dataclass(frozen=True)
class FlowConfig:
    local_prefill_threshold: int = 0  # uncached tokens below this: prefill on the decode node
    on_transfer_failure: str = "recompute"  # or "fail"
    reserve_ttl_s: float = 30.0
    prefill_timeout_s: float = 300.0
    max_attempts: int = 3  # decode nodes tried per request


class Flow:
    def __init__(self, pool: Pool, config: FlowConfig, metrics: RouterMetrics,
                 index: RouterIndex) -> None:
        self.pool, self.config, self.metrics, self.index = pool, config, metrics, index
        self._cleanup: set[asyncio.Task] = set()

    async def run(self, request: pb.Request) -> AsyncIterator[pb.GenerateChunk]:
        """The decode node's chunks for `request`. Raises APIError before the first
        chunk (no node, a bad request), StreamBroken after it."""
        tried: set[NodeClient] = set()
        last_error = "no decode node is available"
        for _ in range(self.config.max_attempts):
            decode = self.pool.pick_decode(tried)
            if decode is None:
                break
            tried.add(decode)
            started = False
            try:
                async for chunk in self._on(decode, request):
                    started = True
                    yield chunk
                return
            except grpc.aio.AioRpcError as exc:
                if exc.code() == grpc.StatusCode.INVALID_ARGUMENT:
                    raise APIError(exc.details() or "invalid request") from None
                if started:
                    raise StreamBroken(f"the decode node failed: {exc.details()}") from None
                if exc.code() not in _RETRY_CODES:
                    raise APIError(f"the decode node failed: {exc.details()}", status=500,
                                   kind="server_error") from None
                last_error = f"{decode.name}: {exc.details()}"
                if exc.code() == grpc.StatusCode.UNAVAILABLE:
                    decode.mark_down(exc.details() or "unavailable")
                self.metrics.retries.labels("decode").inc()
        raise APIError(f"no decode node could serve the request ({last_error})", status=503,
                       kind="service_unavailable", code="no_capacity")

    async def _on(self, decode: NodeClient, request: pb.Request
                  ) -> AsyncIterator[pb.GenerateChunk]:
        rid = request.request_id
        touched: list[NodeClient] = [decode]
        finished = False
        decode.in_flight += 1
        try:
            reserved = await decode.stub.Reserve(
                pb.ReserveRequest(request=request, ttl_s=self.config.reserve_ttl_s),
                timeout=30)
            uncached = len(request.prompt_token_ids) - reserved.cached_tokens
            first = None
            if uncached >= self.config.local_prefill_threshold:
                first = await self._prefill(request, reserved.sink, touched)
            else:
                self.metrics.requests.labels("decode-local").inc()
            generate = pb.GenerateRequest(request=request)
            if first is not None:
                generate.first_token = first
            async for chunk in decode.stub.Generate(generate):
                yield chunk
                if chunk.finish_reason:
                    finished = True
        finally:
            decode.in_flight -= 1
            if not finished:  # an error, or the client went away: free it everywhere
                self._abort(rid, touched)

    async def _prefill(self, request: pb.Request, sink: pb.Sink,
                       touched: list[NodeClient]) -> int | None:
        """The first token from a prefill node that pushed the prompt's KV into `sink`;
        None to have the decode node compute the prompt instead."""
        cached = await self.index.cached_tokens(request.prompt_token_ids)
        node = self.pool.pick_prefill(len(request.prompt_token_ids), cached)
        if node is None:
            self.metrics.requests.labels("decode-local").inc()
            return None  # no prefill node up: the decode node does it all
        touched.append(node)
        self.metrics.requests.labels("prefill").inc()
        node.in_flight += 1
        try:
            done = await node.stub.Prefill(pb.PrefillRequest(request=request, sink=sink),
                                           timeout=self.config.prefill_timeout_s)
            return done.first_token
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.INVALID_ARGUMENT:
                raise
            if exc.code() == grpc.StatusCode.UNAVAILABLE:
                node.mark_down(exc.details() or "unavailable")
            self.metrics.transfer_failures.inc()
            if self.config.on_transfer_failure == "fail":
                raise APIError(f"prefill failed on {node.name}: {exc.details()}", status=502,
                               kind="server_error", code="prefill_failed") from None
            log.warning("prefill of %s failed on %s (%s); the decode node computes it",
                        request.request_id, node.name, exc.details())
            self.metrics.retries.labels("prefill").inc()
            return None
        finally:
            node.in_flight -= 1

    def _abort(self, rid: str, nodes: list[NodeClient]) -> None:
        """Abort on every node, in the background: the caller may be a cancelled task."""
        async def abort_all() -> None:
            for node in nodes:
                try:
                    await node.stub.Abort(pb.AbortRequest(request_id=rid, reason="router"),
                                          timeout=5)
                except grpc.aio.AioRpcError as exc:
                    log.info("abort of %s on %s: %s", rid, node.name, exc.details())

        task = asyncio.get_running_loop().create_task(abort_all())
        self._cleanup.add(task)
        task.add_done_callback(self._cleanup.discard)
