"""A Tandem node: one engine behind the node service (protos/node.proto), in the prefill
or the decode role. Both roles are built at start (the decode role's transfer agent
listens either way), so `SetRole` only drains and flips which calls are served.

The service is thin: it parses messages, hands the request to a role, and maps errors.
It runs on one asyncio loop on its own thread (`grpc_server.serve`), so a call waiting for blocks,
for a prefill or for its tokens costs memory, never a thread; the engine thread stays
the only one that touches the engine. Each Generate or Prefill call is a task, the one
owner of its request: an Abort (or its client going away) cancels the task, and its end
aborts the request in whichever stage holds it. `grpc.health.v1` is served beside it,
for Kubernetes' probes.

Errors reach the caller as gRPC status codes, by exact type (node/errors.py).
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future

import grpc

from tandem.decode_node.driver import Driver
from tandem.decode_node.role import DecodeRole
from tandem.engine import trace
from tandem.engine.block_pool import BlockEvent
from tandem.engine.llm_engine import LLMEngine
from tandem.engine.outputs import RequestOutput
from tandem.engine.request import Request
from tandem.kvtransfer.connector import get_connector
from tandem.kvtransfer.index.base import BlockIndex
from tandem.kvtransfer.layout import KVLayout
from tandem.node import convert
from tandem.node.aio import Bridge, engine_call, new_event_loop
from tandem.node.errors import Status, rpc
from tandem.node.events import BlockEvents
from tandem.node.loop import EngineLoop
from tandem.node.outbox import CHUNK_RATE, CallStream, Chunks, ColumnOutbox, Outbox
from tandem.node.pull import Puller, StalePull, serve_pull
from tandem.node.timeouts import TIMEOUTS, Timeouts
from tandem.prefill_node.role import PrefillRole, Pull, sendable_first
from tandem.protos import node_pb2 as pb
from tandem.protos import node_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

ROLES = {"prefill": pb.PREFILL, "decode": pb.DECODE}
# Generate and Prefill calls a node holds at once, queued or running; more are refused
# with RESOURCE_EXHAUSTED (a router queues them). Each costs a task and its queue entry.
MAX_REQUESTS = 8192


class NodeService(pb_grpc.NodeServicer):
    def __init__(self, engine: LLMEngine, role: str, connector: str = "tcp",
                 transfer_host: str = "127.0.0.1", index: BlockIndex | None = None,
                 engine_thread: bool = True, secret: bytes | None = None,
                 timeouts: Timeouts = TIMEOUTS, max_requests: int = MAX_REQUESTS,
                 transfer_port: int = 0, advertise_host: str | None = None,
                 send_columns: Callable[[str, bytes], None] | None = None,
                 stream_interval_s: float = 0.0, stream_chunk_rate: float = CHUNK_RATE,
                 **connector_options: object) -> None:
        """`index`: a shared block-hash index (Redis) this node publishes its blocks to,
        as its address (`serve` sets it); routers also follow `BlockEvents`.
        `engine_thread=False`: the caller runs `self.loop.run()` (on the main thread).
        `secret`: the cluster secret every call here, and every call this node makes to
        a peer, carries (`node/auth.py`); None: calls are not checked. At most
        `max_requests` Generate and Prefill calls are held at once. The transfer agent
        listens on `transfer_host`:`transfer_port` (0: a free port); peers are told
        `advertise_host` (default: `transfer_host`). `send_columns`: the Outputs
        streams' batches are made by the gRPC front's process (`node/front.py`); each
        step's outputs go to it from the engine thread (`ColumnOutbox`), at most once per
        `stream_interval_s` while the engine steps (a first token goes at once), and at
        most `stream_chunk_rate` chunks a second to each subscriber."""
        if role not in ROLES:
            raise ValueError(f"role must be one of {sorted(ROLES)}, got {role!r}")
        self.role = ROLES[role]
        self.secret, self.timeouts, self.max_requests = secret, timeouts, max_requests
        self.draining = False  # Drain: no new requests until undrained
        self._switching = False  # SetRole: draining, then the other role
        self.loaded_at = time.time()  # the engine came with its weights loaded
        self.aio = new_event_loop()  # every call runs here (`serve`)
        self.bridge = Bridge(self.aio)
        self.loop = EngineLoop(engine, thread=engine_thread)
        self.layout = KVLayout.of(engine.runner.kv_caches, engine.model_name)
        self.connector_name = connector
        if connector == "nccl":  # its hello sets up a process group: proven first
            connector_options.setdefault("secret", secret)
            # NCCL between GPUs; on a CPU node the same code runs over gloo.
            connector_options.setdefault(
                "backend", "nccl" if engine.runner.device.type == "cuda" else "gloo")
        self._connector = get_connector(connector, **connector_options)
        self.decode = DecodeRole(self.loop, self._connector, transfer_host, self.layout, secret,
                                 transfer_port, advertise_host)
        self.driver = Driver(self.decode, timeouts, connector, secret, self.bridge)
        self.prefill = PrefillRole(self.loop, self._connector, self.layout, secret=secret)
        self.puller = Puller(self.decode, self.driver.peer, connector, self.layout,
                             timeouts.pull_s)
        self.events = BlockEvents("", index)
        engine.block_pool.on_event = self.events.on_event  # before any request runs
        self._tasks: dict[str, asyncio.Task] = {}  # Generate and Prefill calls, by request
        self.aborted: dict[asyncio.Task, str] = {}  # cancelled by an Abort: why
        self._outboxes: dict[str, Outbox | ColumnOutbox] = {}  # Outputs streams, by subscriber
        self._send_columns, self.stream_interval_s = send_columns, stream_interval_s
        self.stream_chunk_rate = stream_chunk_rate
        if send_columns is not None:
            self.loop.add_flush(self._flush_columns)

    # -- the decode role ---------------------------------------------------------------

    @rpc
    async def Reserve(self, request: pb.ReserveRequest, context: grpc.aio.ServicerContext
                      ) -> pb.ReserveReply:
        self._serving(pb.DECODE)
        req = self._request(request.request)
        made = await asyncio.wrap_future(
            self.decode.reserve(req, _ttl(request.ttl_s, self.timeouts)))
        return pb.ReserveReply(
            sink=convert.sink_to_pb(made.sink, made.first_block, self.connector_name),
            cached_tokens=made.cached_tokens)

    @rpc
    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
                       ) -> AsyncIterator[pb.GenerateChunk]:
        self._serving(pb.DECODE)
        first = request.first_token if request.HasField("first_token") else None
        plan = request.prefill if request.HasField("prefill") and first is None else None
        outbox = self._outbox(request.subscriber)
        rid = request.request.request_id
        trace.mark(rid, "decode.generate")
        async with _Held(self, rid):
            # A reserved request is in the engine already (its id is taken, rightly); with
            # a plan, this call reserves it.
            req = self._request(request.request, reserved=plan is None)
            chunks = Chunks(rid, pb.GenerateChunk())
            stream = CallStream(self.bridge) if outbox is None else None
            listener = stream.listener if stream is not None else outbox.listener(chunks)
            await self.driver.run(req, request.request, plan, first, listener, chunks.head,
                                  context.time_remaining())
            if outbox is not None:  # the chunks go out through the Outputs stream
                await _until_done(chunks, outbox)
                return
            while True:
                out = await stream.get()
                if isinstance(out, BaseException):
                    raise Status(grpc.StatusCode.INTERNAL, f"generation failed: {out}")
                yield chunks.chunk(out)
                if out.finished:
                    return

    @rpc
    async def Outputs(self, request: pb.OutputsRequest, context: grpc.aio.ServicerContext
                      ) -> AsyncIterator[pb.OutputBatch]:
        self._serving(pb.DECODE, new_work=False)  # running requests stream here
        if not request.subscriber:
            raise ValueError("subscriber is empty")
        outbox = (Outbox(request.subscriber, self.bridge) if self._send_columns is None
                  else ColumnOutbox(request.subscriber, self.bridge, self._send_columns,
                                    self.stream_interval_s, self.stream_chunk_rate))
        old, self._outboxes[request.subscriber] = (
            self._outboxes.get(request.subscriber), outbox)
        if old is not None:
            old.close()
        try:
            async for batch in outbox.batches():
                yield batch
        finally:
            outbox.close()
            if self._outboxes.get(request.subscriber) is outbox:
                del self._outboxes[request.subscriber]

    # -- the prefill role --------------------------------------------------------------

    @rpc
    async def Prefill(self, request: pb.PrefillRequest, context: grpc.aio.ServicerContext
                      ) -> pb.PrefillReply:
        self._serving(pb.PREFILL)
        rid = request.request.request_id
        if not request.HasField("sink"):  # an early start: a later call brings the sink
            trace.mark(rid, "prefill.early")
            req = self._request(request.request)
            first = self.prefill.begin(req, self.timeouts.early_hold_s, self._pull(request))
            if first is None or not request.first_chunk:
                return pb.PrefillReply()
            return await _first_chunk(req, first, context.time_remaining())
        sink, first_block = convert.sink_from_pb(request.sink)
        async with _Held(self, rid):
            trace.mark(rid, "prefill.call")
            req = self._request(request.request, reserved=self.prefill.started(rid))
            started = time.monotonic()
            result = await self.prefill.run(req, sink, first_block, pull=self._pull(request))
            trace.mark(req.request_id, "prefill.reply")
        return pb.PrefillReply(first_token=result.first_token, cached_tokens=result.cached_tokens,
                               kv_bytes=result.kv_bytes, prefill_s=time.monotonic() - started)

    def _pull(self, request: pb.PrefillRequest) -> Pull | None:
        """The prompt's prefix pull, where the request names a peer that holds it."""
        if not request.HasField("pull") or not request.pull.address:
            return None
        hint = request.pull
        return lambda req: self.puller.pull(req, hint.address, hint.tokens)

    # -- either role -------------------------------------------------------------------

    @rpc
    async def Pull(self, request: pb.PullRequest, context: grpc.aio.ServicerContext
                   ) -> pb.PullReply:
        self._serving(self.role, new_work=False)  # a drained node still serves its blocks
        req = self._request(request.request, reserved=True)  # its id is the puller's
        sink, first_block = convert.sink_from_pb(request.sink)
        try:
            sent = await serve_pull(self.loop, self._connector, self.prefill.rows, self.layout,
                                    req, sink, first_block, self.secret)
        except StalePull as exc:
            raise Status(grpc.StatusCode.FAILED_PRECONDITION, str(exc)) from None
        return pb.PullReply(kv_bytes=sent)


    async def Abort(self, request: pb.AbortRequest, context: grpc.aio.ServicerContext
                    ) -> pb.AbortReply:
        task = self._tasks.get(request.request_id)
        reason = request.reason or "aborted by the router"
        if task is not None:  # its call owns the request: its end aborts it
            self.aborted[task] = reason
            task.cancel()
            return pb.AbortReply(found=True)
        if self.prefill.abort(request.request_id, reason):  # an early start, unattached
            return pb.AbortReply(found=True)
        found = await asyncio.wrap_future(self.decode.abort(request.request_id, reason))
        return pb.AbortReply(found=found)

    async def Health(self, request: pb.HealthRequest, context: grpc.aio.ServicerContext
                     ) -> pb.HealthReply:
        live = self.loop.liveness(self.timeouts.engine_stall_s)
        return pb.HealthReply(role=self.role, accepting=self.accepting, pid=os.getpid(),
                              loaded_at=self.loaded_at,
                              model=self.layout.model_id, transfer_address=self.decode.address,
                              layout=convert.layout_to_pb(self.layout),
                              connector=self.connector_name, engine_alive=live.alive,
                              seconds_since_step=live.seconds_since_step,
                              failed_steps=live.failed_steps, engine_error=live.error,
                              max_requests=self.max_requests)

    async def Stats(self, request: pb.StatsRequest, context: grpc.aio.ServicerContext
                    ) -> pb.StatsReply:
        # Read off the loop thread, not between two steps: a long step (a CPU prefill of
        # thousands of tokens) must not make the router's poll time out. Each figure is
        # one read the GIL keeps whole; together they may straddle a step.
        e = self.loop.engine
        s = e.scheduler
        waiting = list(s.waiting)  # a copy taken in one C call: safe while it changes
        steps = e.runner.steps
        return pb.StatsReply(
            role=self.role, num_running=len(s.running),
            num_waiting=len(waiting) + len(s.ready) + self.decode.num_queued,
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
            prompt_tokens_cached_host=e.num_prompt_tokens_cached_host,
            kv_host_blocks_total=e.host_tier.num_blocks if e.host_tier else 0,
            kv_host_blocks_used=e.host_tier.num_used if e.host_tier else 0,
            prompt_tokens_timed=e.prompt_tokens_timed,
            prompt_step_seconds=e.prompt_step_seconds,
            host_blocks_timed=e.host_tier.timed_blocks if e.host_tier else 0,
            host_load_seconds=e.host_tier.timed_seconds if e.host_tier else 0.0,
            steps_decode_graph=steps["decode_graph"], steps_prefill_graph=steps["prefill_graph"],
            steps_eager=steps["eager"],
            prompt_tokens_cached_peer=e.num_prompt_tokens_cached_peer,
            kv_bytes_pulled=self.puller.pulled_bytes, pulls_failed=self.puller.pulls_failed,
            kv_pull_seconds=self.puller.pull_seconds,
        )

    @rpc
    async def SetRole(self, request: pb.SetRoleRequest, context: grpc.aio.ServicerContext
                      ) -> pb.SetRoleReply:
        if request.role not in ROLES.values():
            raise ValueError("role must be PREFILL or DECODE")
        if request.role == self.role:
            return pb.SetRoleReply(role=self.role, drained=True)
        if self._switching:
            raise Status(grpc.StatusCode.FAILED_PRECONDITION,
                         "a role switch is already in progress")
        self._switching = True
        try:
            drained = await self.wait_drained(request.drain_timeout_s or 60.0)
            if drained:
                self.role, self.draining = request.role, False
        finally:
            self._switching = False
        return pb.SetRoleReply(role=self.role, drained=drained)

    async def Drain(self, request: pb.DrainRequest, context: grpc.aio.ServicerContext
                    ) -> pb.DrainReply:
        self.draining = request.drain
        return pb.DrainReply(accepting=self.accepting, num_requests=await self.num_requests())

    @rpc
    async def BlockEvents(self, request: pb.BlockEventsRequest,
                          context: grpc.aio.ServicerContext) -> AsyncIterator[pb.BlockEventBatch]:
        events: asyncio.Queue[BlockEvent] = asyncio.Queue()

        def subscriber(event: BlockEvent) -> None:  # on the engine thread
            self.bridge.post(events.put_nowait, event)

        def subscribe(e: LLMEngine) -> tuple[list[bytes], list[bytes]]:
            # On the engine loop, between two steps: no event slips between the snapshot
            # and the subscription.
            self.events.subscribe(subscriber)
            return e.cached_block_hashes()

        try:
            device, host = await engine_call(self.loop, subscribe)
            yield pb.BlockEventBatch(snapshot=True, stored=device, offloaded=host)
            held: BlockEvent | None = None  # taken from the queue, of the next batch
            while True:
                # Queued events of one kind go as one batch; a batch never mixes kinds,
                # so the follower applies them in order (a block may move and move back).
                event, held = held or await events.get(), None
                hashes = list(event.block_hashes)
                while held is None and not events.empty():
                    following = events.get_nowait()
                    if following.kind == event.kind:
                        hashes += following.block_hashes
                    else:
                        held = following
                yield pb.BlockEventBatch(**{event.kind: hashes})
        finally:
            self.events.unsubscribe(subscriber)

    # -- helpers -----------------------------------------------------------------------

    @property
    def accepting(self) -> bool:
        return not (self.draining or self._switching)

    async def num_requests(self) -> int:
        """Requests on this node: calls in progress, and any the engine holds besides
        (reserved by a Reserve call). Read here, not between two steps: Drain must answer
        within the control timeout while a long step runs (a prefill chunk under load);
        the engine's ids are one copy the GIL keeps whole."""
        return len(set(self.loop.engine.request_ids) | set(self._tasks)
                   | set(self.prefill.request_ids()))

    async def wait_drained(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while await self.num_requests() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        return not await self.num_requests()

    def _serving(self, role: int, new_work: bool = True) -> None:
        if self.role != role:
            raise Status(grpc.StatusCode.FAILED_PRECONDITION,
                         f"this node is in the {pb.Role.Name(self.role).lower()} role")
        if new_work and not self.accepting:
            raise Status(grpc.StatusCode.FAILED_PRECONDITION, "this node is draining")

    def _flush_columns(self, idle: bool) -> None:
        for outbox in list(self._outboxes.values()):  # one copy the GIL keeps whole
            outbox.flush(idle)

    def _outbox(self, subscriber: str) -> Outbox | ColumnOutbox | None:
        if not subscriber:
            return None
        outbox = self._outboxes.get(subscriber)
        if outbox is None:
            raise Status(grpc.StatusCode.FAILED_PRECONDITION,
                         f"no Outputs stream {subscriber!r} is open here")
        return outbox

    def _request(self, msg: pb.Request, reserved: bool = False) -> Request:
        """The request `msg` describes, checked against the engine (its context length and
        vocabulary, and unless `reserved` or started early, that its id is not in use).
        Here on the asyncio loop, not a hop to the engine loop (which may be mid-step): the
        checks read only what never changes and one dict lookup; the engine's `add` checks
        the id again."""
        if not msg.request_id:
            raise ValueError("request_id is empty")
        engine = self.loop.engine
        if not reserved and engine.has_request(msg.request_id):
            raise ValueError(f"request id {msg.request_id!r} is already in use")
        params = convert.sampling_from_pb(msg.sampling)
        return engine.validate_request(msg.request_id, list(msg.prompt_token_ids), params)

    async def aclose(self) -> None:
        """On the asyncio loop: end the Outputs streams and the peers' channels."""
        for outbox in list(self._outboxes.values()):
            outbox.close()
        await self.driver.close()

    def close(self) -> None:
        """From any thread but the asyncio loop's (stopped or not)."""
        if self.aio.is_running():
            asyncio.run_coroutine_threadsafe(self.aclose(), self.aio).result(10)
        self.events.close()
        self.decode.close()
        self.prefill.close()
        self.loop.close()
        self._connector.close()


class _Held:
    """One Generate or Prefill call, the owner of request `rid` while it runs: refused
    past `max_requests`; a call that ends with an error or a cancel (a call returns only
    once its request finished) aborts the request in whichever stage holds it."""

    def __init__(self, service: NodeService, rid: str) -> None:
        if not rid:
            raise ValueError("request_id is empty")
        if len(service._tasks) >= service.max_requests:
            raise Status(grpc.StatusCode.RESOURCE_EXHAUSTED,
                         f"this node holds {service.max_requests} requests already")
        if rid in service._tasks:
            raise ValueError(f"request id {rid!r} is already in use")
        self.service, self.rid = service, rid

    async def __aenter__(self) -> None:
        self.service._tasks[self.rid] = asyncio.current_task()

    async def __aexit__(self, kind: type | None, exc: BaseException | None, tb: object) -> None:
        tasks = self.service._tasks
        if tasks.get(self.rid) is asyncio.current_task():
            del tasks[self.rid]
        if exc is not None:
            self.service.decode.abort(self.rid, f"the call ended: {exc!r}")


async def _until_done(chunks: Chunks, outbox: Outbox | ColumnOutbox) -> None:
    """Until the request's last chunk is made; Status if it failed or its Outputs stream
    closed first."""
    await outbox.until_done(chunks)
    if chunks.error is not None:
        raise Status(grpc.StatusCode.INTERNAL, f"generation failed: {chunks.error}")
    if chunks.closed:
        raise Status(grpc.StatusCode.UNAVAILABLE,
                     f"the Outputs stream {outbox.subscriber!r} closed")


async def _first_chunk(req: Request, first: Future[RequestOutput], seconds_left: float | None
                       ) -> pb.PrefillReply:
    """An early start's reply, once its first token is sampled: that chunk where the
    router may send it on (`sendable_first`); empty where it may not, or if the prefill
    failed or the caller's time ran out first."""
    try:
        out = await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(first)), seconds_left)
    except Exception:  # noqa: BLE001 - the decode node's call meets the failure, and says it
        return pb.PrefillReply()
    if not sendable_first(req.params, out):
        return pb.PrefillReply(first_token=out.token_ids[0])
    return pb.PrefillReply(first_token=out.token_ids[0], first_chunk=pb.GenerateChunk(
        request_id=req.request_id, token_ids=out.token_ids[:1], text=out.delta))


def _ttl(asked: float, timeouts: Timeouts) -> float:
    """A reservation's lease: reserve_ttl_s if unset, at most max_ttl_s."""
    if not math.isfinite(asked) or asked < 0:
        raise ValueError(f"ttl_s must be a positive number of seconds, got {asked}")
    return min(asked, timeouts.max_ttl_s) if asked > 0 else timeouts.reserve_ttl_s
