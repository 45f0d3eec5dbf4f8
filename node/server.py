"""A Tandem node: one engine behind the node service (protos/node.proto), in the prefill
or the decode role. Both roles are built at start (the decode role's transfer agent
listens either way), so `SetRole` only drains and flips which calls are served.

Errors reach the caller as gRPC status codes, never as a traceback: INVALID_ARGUMENT for
a bad request, FAILED_PRECONDITION for a call the current role does not serve (or while
draining), RESOURCE_EXHAUSTED when the KV cache is full, ABORTED when a KV transfer
failed (the router retries or prefills on the decode node).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from typing import TypeVar

import grpc

from tandem.decode_node.role import DecodeRole
from tandem.engine.block_pool import BlockEvent
from tandem.engine.llm_engine import LLMEngine
from tandem.engine.outputs import RequestOutput
from tandem.engine.request import Request
from tandem.kvtransfer.connector import TransferError, get_connector
from tandem.kvtransfer.index.base import BlockIndex
from tandem.kvtransfer.layout import KVLayout
from tandem.node import convert
from tandem.node.events import BlockEvents
from tandem.node.loop import EngineLoop
from tandem.prefill_node.role import PrefillRole
from tandem.protos import node_pb2 as pb
from tandem.protos import node_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)
T = TypeVar("T")

ROLES = {"prefill": pb.PREFILL, "decode": pb.DECODE}
DEFAULT_TTL_S = 30.0  # an unused reservation is freed this long after Reserve
_POLL_S = 0.1  # a streaming call looks at its client this often while no token comes


class NodeService(pb_grpc.NodeServicer):
    def __init__(self, engine: LLMEngine, role: str, connector: str = "tcp",
                 transfer_host: str = "127.0.0.1", index: BlockIndex | None = None,
                 engine_thread: bool = True, **connector_options: object) -> None:
        """`index`: a shared block-hash index (Redis) this node publishes its blocks to,
        as its address (`serve` sets it); routers also follow `BlockEvents`.
        `engine_thread=False`: the caller runs `self.loop.run()` (on the main thread)."""
        if role not in ROLES:
            raise ValueError(f"role must be one of {sorted(ROLES)}, got {role!r}")
        self.role = ROLES[role]
        self.accepting = True
        self.loop = EngineLoop(engine, thread=engine_thread)
        caches = engine.runner.kv_caches
        self.layout = KVLayout.of(caches, engine.model_name)
        self.connector_name = connector
        self._connector = get_connector(connector, **connector_options)
        self.decode = DecodeRole(self.loop, self._connector, transfer_host, self.layout)
        self.prefill = PrefillRole(self.loop, self._connector, self.layout)
        self.events = BlockEvents("", index)
        engine.block_pool.on_event = self.events.on_event  # before any request runs

    def close(self) -> None:
        self.events.close()
        self.decode.close()
        self.prefill.close()
        self.loop.close()
        self._connector.close()

    # -- the decode role ---------------------------------------------------------------

    def Reserve(self, request: pb.ReserveRequest, context: grpc.ServicerContext
                ) -> pb.ReserveReply:
        self._serving(pb.DECODE, context)
        req = self._request(request.request, context)
        ttl_s = request.ttl_s or DEFAULT_TTL_S
        sink, first_block, cached = self._guard(context, lambda: self.decode.reserve(req, ttl_s))
        return pb.ReserveReply(sink=convert.sink_to_pb(sink, first_block, self.connector_name),
                               cached_tokens=cached)

    def Generate(self, request: pb.GenerateRequest, context: grpc.ServicerContext
                 ) -> Iterator[pb.GenerateChunk]:
        self._serving(pb.DECODE, context)
        rid = request.request.request_id
        # A reserved request is in the engine already (its id is taken, rightly).
        req = self._request(request.request, context, reserved=True)
        outputs: queue.SimpleQueue[RequestOutput | BaseException] = queue.SimpleQueue()
        first = request.first_token if request.HasField("first_token") else None
        self._guard(context, lambda: self.decode.generate(req, first, outputs.put))
        finished = threading.Event()  # the RPC's end needs no abort then
        context.add_callback(
            lambda: finished.is_set() or self._abort_unfinished(rid, "the client went away"))
        sent = 0
        while True:
            try:
                out = outputs.get(timeout=_POLL_S)
            except queue.Empty:
                if not context.is_active():
                    return
                continue
            if isinstance(out, BaseException):
                context.abort(grpc.StatusCode.INTERNAL, f"generation failed: {out}")
            chunk = pb.GenerateChunk(token_ids=out.token_ids[sent:], text=out.delta)
            sent = len(out.token_ids)
            if out.finished:
                finished.set()
                chunk.finish_reason = out.finish_reason or ""
                chunk.prompt_tokens = len(out.prompt_token_ids)
                chunk.completion_tokens = len(out.token_ids)
                chunk.cached_tokens = out.num_cached_tokens
            yield chunk
            if out.finished:
                return

    # -- the prefill role --------------------------------------------------------------

    def Prefill(self, request: pb.PrefillRequest, context: grpc.ServicerContext
                ) -> pb.PrefillReply:
        self._serving(pb.PREFILL, context)
        req = self._request(request.request, context)
        sink, first_block = self._guard(context, lambda: convert.sink_from_pb(request.sink))
        started = time.monotonic()
        result = self._guard(context, lambda: self.prefill.prefill(req, sink, first_block))
        return pb.PrefillReply(first_token=result.first_token, cached_tokens=result.cached_tokens,
                               kv_bytes=result.kv_bytes, prefill_s=time.monotonic() - started)

    # -- either role -------------------------------------------------------------------

    def Abort(self, request: pb.AbortRequest, context: grpc.ServicerContext) -> pb.AbortReply:
        found = self.decode.abort(request.request_id, request.reason or "aborted by the router")
        return pb.AbortReply(found=found)

    def Health(self, request: pb.HealthRequest, context: grpc.ServicerContext
               ) -> pb.HealthReply:
        return pb.HealthReply(role=self.role, accepting=self.accepting,
                              model=self.layout.model_id, transfer_address=self.decode.address,
                              layout=convert.layout_to_pb(self.layout),
                              connector=self.connector_name)

    def Stats(self, request: pb.StatsRequest, context: grpc.ServicerContext) -> pb.StatsReply:
        def collect(e: LLMEngine) -> pb.StatsReply:
            s = e.scheduler
            return pb.StatsReply(
                role=self.role, num_running=len(s.running), num_waiting=len(s.waiting),
                num_reserved=e.num_reserved, kv_blocks_total=e.block_pool.num_blocks,
                kv_blocks_free=e.block_pool.num_free_blocks,
                queued_prefill_tokens=sum(r.num_uncomputed_tokens for r in s.waiting),
                prompt_tokens_computed=e.num_prompt_tokens_computed,
                prompt_tokens_cached=e.num_prompt_tokens_cached,
                generation_tokens=e.num_generation_tokens,
                kv_bytes_sent=self.prefill.kv_bytes_sent,
                kv_bytes_received=self.decode.kv_bytes_received,
                transfers_failed=self.prefill.transfers_failed + self.decode.transfers_failed,
                prefix_cache_queries=e.num_prompt_tokens_queried,
                num_preemptions=s.num_preemptions,
                kv_transfer_seconds=self.prefill.kv_transfer_seconds,
            )

        return self.loop.call(collect)

    def SetRole(self, request: pb.SetRoleRequest, context: grpc.ServicerContext
                ) -> pb.SetRoleReply:
        if request.role not in ROLES.values():
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "role must be PREFILL or DECODE")
        if request.role == self.role:
            return pb.SetRoleReply(role=self.role, drained=True)
        self.accepting = False
        deadline = time.monotonic() + (request.drain_timeout_s or 60.0)
        while self.loop.call(lambda e: len(e.request_ids)) and time.monotonic() < deadline:
            time.sleep(0.05)
        drained = not self.loop.call(lambda e: len(e.request_ids))
        if drained:
            self.role = request.role
        self.accepting = True
        return pb.SetRoleReply(role=self.role, drained=drained)

    def BlockEvents(self, request: pb.BlockEventsRequest, context: grpc.ServicerContext
                    ) -> Iterator[pb.BlockEventBatch]:
        events: queue.SimpleQueue[BlockEvent] = queue.SimpleQueue()

        def subscribe(e: LLMEngine) -> list[bytes]:  # on the loop: no event slips between
            self.events.subscribe(events)
            return e.block_pool.cached_hashes()

        try:
            yield pb.BlockEventBatch(snapshot=True, stored=self.loop.call(subscribe))
            while context.is_active():
                try:
                    batch = [events.get(timeout=_POLL_S)]
                except queue.Empty:
                    continue
                while not events.empty():
                    batch.append(events.get_nowait())
                yield pb.BlockEventBatch(
                    stored=[h for ev in batch if ev.kind == "stored" for h in ev.block_hashes],
                    evicted=[h for ev in batch if ev.kind != "stored" for h in ev.block_hashes])
        finally:
            self.events.unsubscribe(events)

    # -- helpers -----------------------------------------------------------------------

    def _serving(self, role: int, context: grpc.ServicerContext) -> None:
        if self.role != role:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                          f"this node is in the {pb.Role.Name(self.role).lower()} role")
        if not self.accepting:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, "this node is draining")

    def _request(self, msg: pb.Request, context: grpc.ServicerContext,
                 reserved: bool = False) -> Request:
        if not msg.request_id:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "request_id is empty")

        def make(e: LLMEngine) -> Request:
            params = convert.sampling_from_pb(msg.sampling)
            made = e.validate_request if reserved else e.make_request  # add() checks the id
            return made(msg.request_id, list(msg.prompt_token_ids), params)

        return self._guard(context, lambda: self.loop.call(make))

    @staticmethod
    def _guard(context: grpc.ServicerContext, fn: Callable[[], T]) -> T:
        """`fn()`, its errors turned into the status codes above."""
        try:
            return fn()
        except ValueError as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except TransferError as exc:
            context.abort(grpc.StatusCode.ABORTED, f"KV transfer failed: {exc}")
        except RuntimeError as exc:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        except futures.TimeoutError:
            context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "the engine did not answer in time")
        raise AssertionError("unreachable: context.abort raises")

    def _abort_unfinished(self, rid: str, reason: str) -> None:
        try:
            self.decode.abort(rid, reason)
        except Exception:  # noqa: BLE001 - the node is shutting down, say
            log.exception("aborting %s failed", rid)


def serve(service: NodeService, host: str = "127.0.0.1", port: int = 0,
          max_workers: int = 64) -> tuple[grpc.Server, int]:
    """Start the gRPC server for `service`; (the server, its port)."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers, thread_name_prefix="node-rpc"))
    pb_grpc.add_NodeServicer_to_server(service, server)
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise OSError(f"cannot listen on {host}:{port}")
    service.events.node_id = f"{host}:{bound}"  # as routers know the node
    server.start()
    return server, bound


def run_until_stopped(server: grpc.Server, service: NodeService,
                      stop: threading.Event | None = None) -> None:
    try:
        (stop or threading.Event()).wait()
    finally:
        server.stop(grace=5).wait()
        service.close()
