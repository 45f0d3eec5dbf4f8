"""A Tandem node: one engine behind the node service (protos/node.proto), in the prefill
or the decode role. Both roles are built at start (the decode role's transfer agent
listens either way), so `SetRole` only drains and flips which calls are served.

Errors reach the caller as gRPC status codes, never as a traceback: INVALID_ARGUMENT for
a bad request, FAILED_PRECONDITION for a call the current role does not serve (or while
draining), RESOURCE_EXHAUSTED when the KV cache is full, ABORTED when a KV transfer
failed (the router retries or prefills on the decode node).
"""

from __future__ import annotations

import functools
import inspect
import logging
import math
import os
import queue
import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from dataclasses import dataclass
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
from tandem.node import auth, convert
from tandem.node.events import BlockEvents
from tandem.node.loop import EngineLoop
from tandem.node.outbox import POLL_S as _POLL_S
from tandem.node.outbox import Chunks, Outbox
from tandem.node.timeouts import TIMEOUTS, Timeouts
from tandem.prefill_node.role import PrefillRole
from tandem.protos import node_pb2 as pb
from tandem.protos import node_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)
T = TypeVar("T")

ROLES = {"prefill": pb.PREFILL, "decode": pb.DECODE}
# Streaming calls (Generate, Prefill, Outputs, BlockEvents) each hold a server thread while
# they run: at most this many run at once, and the server has CONTROL_THREADS more, so
# Health, Stats and Abort stay answerable however many streams there are.
MAX_STREAMS = 256
CONTROL_THREADS = 16
MAX_WAITING = 512  # requests queued in the engine; a Generate or Prefill past it is refused


@dataclass(eq=False)
class _Driving:
    """A decode-first request from its Generate call to its prefill's end."""

    call: grpc.Future | None = None  # the Prefill call on the plan's node
    cancelled: bool = False  # an Abort (or the client's going) came meanwhile


def _streaming(method: Callable) -> Callable:
    """A streaming (or long) call takes one of the node's `max_streams` slots while it
    runs; with none free it ends at once with RESOURCE_EXHAUSTED."""
    if inspect.isgeneratorfunction(method):
        @functools.wraps(method)
        def stream(self: NodeService, request: object, context: grpc.ServicerContext
                   ) -> Iterator[object]:
            self._take_slot(context)
            try:
                yield from method(self, request, context)
            finally:
                self._streams.release()
        return stream

    @functools.wraps(method)
    def call(self: NodeService, request: object, context: grpc.ServicerContext) -> object:
        self._take_slot(context)
        try:
            return method(self, request, context)
        finally:
            self._streams.release()
    return call


class NodeService(pb_grpc.NodeServicer):
    def __init__(self, engine: LLMEngine, role: str, connector: str = "tcp",
                 transfer_host: str = "127.0.0.1", index: BlockIndex | None = None,
                 engine_thread: bool = True, secret: bytes | None = None,
                 timeouts: Timeouts = TIMEOUTS, max_streams: int = MAX_STREAMS,
                 max_waiting: int = MAX_WAITING, transfer_port: int = 0,
                 advertise_host: str | None = None, **connector_options: object) -> None:
        """`index`: a shared block-hash index (Redis) this node publishes its blocks to,
        as its address (`serve` sets it); routers also follow `BlockEvents`.
        `engine_thread=False`: the caller runs `self.loop.run()` (on the main thread).
        `secret`: the cluster secret every call here, and every call this node makes to
        a peer, carries (`node/auth.py`); None: calls are not checked. `max_streams`
        streaming calls run at once, `max_waiting` requests wait in the engine; more are
        refused with RESOURCE_EXHAUSTED (the router tries another node). The transfer
        agent listens on `transfer_host`:`transfer_port` (0: a free port); peers are told
        `advertise_host` (default: `transfer_host`)."""
        if role not in ROLES:
            raise ValueError(f"role must be one of {sorted(ROLES)}, got {role!r}")
        self.role = ROLES[role]
        self.secret, self.timeouts = secret, timeouts
        self.max_streams, self.max_waiting = max_streams, max_waiting
        self._streams = threading.BoundedSemaphore(max_streams)
        self.draining = False  # Drain: no new requests until undrained
        self._switching = False  # SetRole: draining, then the other role
        self.loaded_at = time.time()  # the engine came with its weights loaded
        self.loop = EngineLoop(engine, thread=engine_thread)
        caches = engine.runner.kv_caches
        self.layout = KVLayout.of(caches, engine.model_name)
        self.connector_name = connector
        if connector == "nccl":  # its hello sets up a process group: proven first
            connector_options.setdefault("secret", secret)
            # NCCL between GPUs; on a CPU node the same code runs over gloo.
            connector_options.setdefault(
                "backend", "nccl" if engine.runner.device.type == "cuda" else "gloo")
        self._connector = get_connector(connector, **connector_options)
        self.decode = DecodeRole(self.loop, self._connector, transfer_host, self.layout, secret,
                                 transfer_port, advertise_host)
        self.prefill = PrefillRole(self.loop, self._connector, self.layout, secret=secret)
        self.events = BlockEvents("", index)
        engine.block_pool.on_event = self.events.on_event  # before any request runs
        self._lock = threading.Lock()
        self._peers: dict[str, pb_grpc.NodeStub] = {}  # prefill nodes, by address
        self._channels: list[grpc.Channel] = []
        self._driving: dict[str, _Driving] = {}  # decode-first, before the first token
        self._outboxes: dict[str, Outbox] = {}  # open Outputs streams, by subscriber

    def close(self) -> None:
        with self._lock:
            outboxes = list(self._outboxes.values())
        for outbox in outboxes:
            outbox.close()
        for channel in self._channels:
            channel.close()
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
        ttl_s = _ttl(request.ttl_s, self.timeouts, context)
        sink, first_block, cached = self._guard(context, lambda: self.decode.reserve(req, ttl_s))
        return pb.ReserveReply(sink=convert.sink_to_pb(sink, first_block, self.connector_name),
                               cached_tokens=cached)

    @_streaming
    def Generate(self, request: pb.GenerateRequest, context: grpc.ServicerContext
                 ) -> Iterator[pb.GenerateChunk]:
        self._serving(pb.DECODE, context)
        self._room(context)
        rid = request.request.request_id
        first = request.first_token if request.HasField("first_token") else None
        plan = request.prefill if request.HasField("prefill") and first is None else None
        outbox = None
        if request.subscriber:
            with self._lock:
                outbox = self._outboxes.get(request.subscriber)
            if outbox is None:
                context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                              f"no Outputs stream {request.subscriber!r} is open here")
        # A reserved request is in the engine already (its id is taken, rightly); with a
        # plan, this call reserves it.
        req = self._request(request.request, context, reserved=plan is None)
        finished = threading.Event()  # the RPC's end needs no abort then
        context.add_callback(
            lambda: finished.is_set() or self._abort_unfinished(rid, "the client went away"))
        head = pb.GenerateChunk()  # what the first chunk says of the prefill
        if plan is not None:
            first, head = self._prefill_remotely(req, request.request, plan, context)
        chunks = Chunks(rid, head)
        outputs: queue.SimpleQueue[RequestOutput | BaseException] = queue.SimpleQueue()
        listener = outputs.put if outbox is None else outbox.listener(chunks)
        self._guard(context, lambda: self.decode.generate(req, first, listener))
        if not context.is_active():  # gone while it started: its callback may have run
            self._abort_unfinished(rid, "the client went away")
            return
        if outbox is not None:  # the chunks go out through the Outputs stream
            while not chunks.done.wait(_POLL_S):
                if outbox.closed.is_set():
                    self._abort_unfinished(rid, "its Outputs stream closed")
                    context.abort(grpc.StatusCode.UNAVAILABLE,
                                  f"the Outputs stream {request.subscriber!r} closed")
                if not context.is_active():
                    return
            finished.set()
            if chunks.error is not None:
                context.abort(grpc.StatusCode.INTERNAL, f"generation failed: {chunks.error}")
            return
        while True:
            try:
                out = outputs.get(timeout=_POLL_S)
            except queue.Empty:
                if not context.is_active():
                    return
                continue
            if isinstance(out, BaseException):
                context.abort(grpc.StatusCode.INTERNAL, f"generation failed: {out}")
            if out.finished:
                finished.set()
            yield chunks.chunk(out)
            if out.finished:
                return

    @_streaming
    def Outputs(self, request: pb.OutputsRequest, context: grpc.ServicerContext
                ) -> Iterator[pb.OutputBatch]:
        self._serving(pb.DECODE, context, new_work=False)  # running requests stream here
        if not request.subscriber:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "subscriber is empty")
        outbox = Outbox(request.subscriber)
        with self._lock:
            old, self._outboxes[request.subscriber] = (
                self._outboxes.get(request.subscriber), outbox)
        if old is not None:
            old.close()
        context.add_callback(outbox.close)
        try:
            yield from outbox.batches(context.is_active)
        finally:
            outbox.close()
            with self._lock:
                if self._outboxes.get(request.subscriber) is outbox:
                    del self._outboxes[request.subscriber]

    def _prefill_remotely(self, req: Request, msg: pb.Request, plan: pb.PrefillPlan,
                          context: grpc.ServicerContext) -> tuple[int | None, pb.GenerateChunk]:
        """Decode-first: reserve `req`'s blocks here and have the plan's prefill node
        compute the prompt into them. (its first token, the first chunk's prefill
        fields); the token is None when this node computes the prompt itself: its cache
        holds all but a few tokens, the plan names no prefill node, or that node failed
        (unless the plan says to fail then). No sink is opened for a prompt computed
        here by choice: closing one costs an ipc sink its settle time."""
        rid = req.request_id
        driving = _Driving()
        with self._lock:
            self._driving[rid] = driving
        try:
            return self._drive_prefill(req, msg, plan, driving, context)
        finally:
            with self._lock:
                self._driving.pop(rid, None)

    def _drive_prefill(self, req: Request, msg: pb.Request, plan: pb.PrefillPlan,
                       driving: _Driving, context: grpc.ServicerContext
                       ) -> tuple[int | None, pb.GenerateChunk]:
        rid = req.request_id
        if not plan.address:  # computed here like any request: no blocks held beforehand
            return None, pb.GenerateChunk()
        if plan.local_prefill_threshold > 0:
            cached = self._guard(context, lambda: self.loop.call(
                lambda e: e.cached_prompt_tokens(req)))
            if req.num_prompt_tokens - cached < plan.local_prefill_threshold:
                return None, pb.GenerateChunk()
        # The Generate call owns the reservation (its end aborts it); the lease outlives
        # the Prefill call's deadline, so a prefill still queued is not thrown away.
        limit = self.timeouts.prefill_s
        timeout = min(plan.timeout_s, limit) if 0 < plan.timeout_s < math.inf else limit
        ttl_s = timeout + self.timeouts.transfer_grace_s
        sink, first_block, _ = self._guard(context, lambda: self.decode.reserve(req, ttl_s))
        call = self._peer(plan.address).Prefill.future(
            pb.PrefillRequest(request=msg,
                              sink=convert.sink_to_pb(sink, first_block, self.connector_name)),
            timeout=timeout)
        with self._lock:
            driving.call = call
            if driving.cancelled:  # an Abort came while it reserved
                call.cancel()
        try:
            return call.result().first_token, pb.GenerateChunk(prefilled_by=plan.address)
        except (grpc.RpcError, grpc.FutureCancelledError):
            code, details = call.code(), call.details()
        if driving.cancelled or not context.is_active():  # Abort, or the client gone
            self._abort_unfinished(rid, "the client went away")
            context.abort(grpc.StatusCode.CANCELLED, "the request was aborted")
        if code == grpc.StatusCode.INVALID_ARGUMENT or plan.fail_on_error:
            self._abort_unfinished(rid, f"prefill failed: {details}")
            status = (grpc.StatusCode.INVALID_ARGUMENT if code == grpc.StatusCode.INVALID_ARGUMENT
                      else grpc.StatusCode.ABORTED)
            context.abort(status, f"prefill failed on {plan.address}: {details}")
        log.warning("prefill of %s failed on %s (%s: %s); computing it here", rid,
                    plan.address, code.name, details)
        return None, pb.GenerateChunk(prefill_error=details or code.name,
                                      prefill_error_code=code.name)

    def _peer(self, address: str) -> pb_grpc.NodeStub:
        """A client of the prefill node at `address`, its channel kept for later calls."""
        with self._lock:
            stub = self._peers.get(address)
            if stub is None:
                channel = auth.authenticated(grpc.insecure_channel(address), self.secret)
                self._channels.append(channel)
                stub = self._peers[address] = pb_grpc.NodeStub(channel)
            return stub

    # -- the prefill role --------------------------------------------------------------

    @_streaming
    def Prefill(self, request: pb.PrefillRequest, context: grpc.ServicerContext
                ) -> pb.PrefillReply:
        self._serving(pb.PREFILL, context)
        self._room(context)
        req = self._request(request.request, context)
        sink, first_block = self._guard(context, lambda: convert.sink_from_pb(request.sink))
        started = time.monotonic()
        answered = threading.Event()
        context.add_callback(  # a caller that cancels (decode-first: its client went away)
            lambda: answered.is_set() or self._abort_unfinished(req.request_id,
                                                                "the caller went away"))
        result = self._guard(context, lambda: self.prefill.prefill(req, sink, first_block))
        answered.set()
        return pb.PrefillReply(first_token=result.first_token, cached_tokens=result.cached_tokens,
                               kv_bytes=result.kv_bytes, prefill_s=time.monotonic() - started)

    # -- either role -------------------------------------------------------------------

    def Abort(self, request: pb.AbortRequest, context: grpc.ServicerContext) -> pb.AbortReply:
        calling = self._cancel_prefill_call(request.request_id)
        found = self.decode.abort(request.request_id, request.reason or "aborted by the router")
        return pb.AbortReply(found=found or calling)

    def Health(self, request: pb.HealthRequest, context: grpc.ServicerContext
               ) -> pb.HealthReply:
        live = self.loop.liveness(self.timeouts.engine_stall_s)
        return pb.HealthReply(role=self.role, accepting=self.accepting, pid=os.getpid(),
                              loaded_at=self.loaded_at,
                              model=self.layout.model_id, transfer_address=self.decode.address,
                              layout=convert.layout_to_pb(self.layout),
                              connector=self.connector_name, engine_alive=live.alive,
                              seconds_since_step=live.seconds_since_step,
                              failed_steps=live.failed_steps, engine_error=live.error)

    def Stats(self, request: pb.StatsRequest, context: grpc.ServicerContext) -> pb.StatsReply:
        # Read off the loop thread, not between two steps: a long step (a CPU prefill of
        # thousands of tokens) must not make the router's poll time out. Each figure is
        # one read the GIL keeps whole; together they may straddle a step.
        e = self.loop.engine
        s = e.scheduler
        waiting = list(s.waiting)  # a copy taken in one C call: safe while it changes
        return pb.StatsReply(
            role=self.role, num_running=len(s.running), num_waiting=len(waiting) + len(s.ready),
            num_reserved=e.num_reserved, kv_blocks_total=e.block_pool.num_blocks,
            kv_blocks_free=e.block_pool.num_free_blocks,
            queued_prefill_tokens=sum(r.num_uncomputed_tokens for r in waiting),
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

    def SetRole(self, request: pb.SetRoleRequest, context: grpc.ServicerContext
                ) -> pb.SetRoleReply:
        if request.role not in ROLES.values():
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "role must be PREFILL or DECODE")
        if request.role == self.role:
            return pb.SetRoleReply(role=self.role, drained=True)
        with self._lock:
            if self._switching:
                context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                              "a role switch is already in progress")
            self._switching = True
        try:
            deadline = time.monotonic() + (request.drain_timeout_s or 60.0)
            while self.num_requests() and time.monotonic() < deadline:
                time.sleep(0.05)
            drained = not self.num_requests()
            if drained:
                self.role, self.draining = request.role, False
        finally:
            self._switching = False
        return pb.SetRoleReply(role=self.role, drained=drained)

    @_streaming
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

    def _take_slot(self, context: grpc.ServicerContext) -> None:
        if not self._streams.acquire(blocking=False):
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                          f"this node runs {self.max_streams} streaming calls already")

    def _room(self, context: grpc.ServicerContext) -> None:
        """Refuse new work while `max_waiting` requests wait in the engine."""
        s = self.loop.engine.scheduler  # lengths only: safe to read off the loop thread
        if len(s.waiting) + len(s.ready) >= self.max_waiting:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                          f"{self.max_waiting} requests wait on this node already")

    @property
    def accepting(self) -> bool:
        return not (self.draining or self._switching)

    def Drain(self, request: pb.DrainRequest, context: grpc.ServicerContext
              ) -> pb.DrainReply:
        self.draining = request.drain
        return pb.DrainReply(accepting=self.accepting, num_requests=self.num_requests())

    def num_requests(self) -> int:
        return self.loop.call(lambda e: len(e.request_ids)) + len(self._driving)

    def _serving(self, role: int, context: grpc.ServicerContext, new_work: bool = True
                 ) -> None:
        if self.role != role:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                          f"this node is in the {pb.Role.Name(self.role).lower()} role")
        if new_work and not self.accepting:
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

    def _cancel_prefill_call(self, rid: str) -> bool:
        """Mark a decode-first request still before its first token cancelled, and
        cancel its Prefill call if it has one; whether there was such a request. It then
        ends rather than computing its prompt here."""
        with self._lock:
            driving = self._driving.get(rid)
            if driving is None:
                return False
            driving.cancelled = True
            call = driving.call
        if call is not None:
            call.cancel()
        return True

    def _abort_unfinished(self, rid: str, reason: str) -> None:
        self._cancel_prefill_call(rid)
        try:
            self.decode.abort(rid, reason)
        except Exception:  # noqa: BLE001 - the node is shutting down, say
            log.exception("aborting %s failed", rid)


def _ttl(asked: float, timeouts: Timeouts, context: grpc.ServicerContext) -> float:
    """A reservation's lease: reserve_ttl_s if unset, at most max_ttl_s."""
    if not math.isfinite(asked) or asked < 0:
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"ttl_s must be a positive number "
                      f"of seconds, got {asked}")
    return min(asked, timeouts.max_ttl_s) if asked > 0 else timeouts.reserve_ttl_s


def serve(service: NodeService, host: str = "127.0.0.1", port: int = 0,
          advertise_host: str | None = None) -> tuple[grpc.Server, int]:
    """Start the gRPC server for `service`; (the server, its port). Routers know it as
    `advertise_host` (default: `host`) and that port."""
    threads = service.max_streams + CONTROL_THREADS
    server = grpc.server(futures.ThreadPoolExecutor(threads, thread_name_prefix="node-rpc"),
                         interceptors=auth.server_interceptors(service.secret))
    pb_grpc.add_NodeServicer_to_server(service, server)
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise OSError(f"cannot listen on {host}:{port}")
    service.events.node_id = f"{advertise_host or host}:{bound}"  # as routers know it
    server.start()
    return server, bound


def run_until_stopped(server: grpc.Server, service: NodeService,
                      stop: threading.Event | None = None, drain_timeout_s: float = 0.0
                      ) -> None:
    """Serve until `stop` is set; then drain: take no new work (Health says draining, so
    routers send none) and let what runs finish, for up to `drain_timeout_s`, before the
    server stops and the rest is cut."""
    try:
        (stop or threading.Event()).wait()
        if drain_timeout_s > 0:
            drain(service, drain_timeout_s)
    finally:
        server.stop(grace=5).wait()
        service.close()


def drain(service: NodeService, timeout_s: float) -> bool:
    """Stop taking work and wait until no request is left, or `timeout_s` passed;
    True when none is left."""
    service.draining = True
    deadline = time.monotonic() + timeout_s
    log = logging.getLogger("tandem.node")
    while (left := service.num_requests()) and time.monotonic() < deadline:
        log.info("draining: %d request(s) left", left)
        time.sleep(min(1.0, max(0.0, deadline - time.monotonic())))
    left = service.num_requests()
    if left:
        log.warning("drain timed out: %d request(s) cut", left)
    return not left
