"""A node's gRPC front: a process of its own that serves the node's port and forwards
every call to the engine's process (`node/calls.py` draws the messages), so gRPC's work
and the Outputs streams' per-token work never take the engine thread's GIL.

Calls go through as bytes: this process parses none but Outputs, whose batches it makes
here from the engine's per-step `OutputColumns`, and Submit, a router's stream of Generate
requests (or a decode node's of Prefill requests) many to a message, each forwarded as a
call of its own would be (node/submit.py; only this front serves it). `grpc.health.v1`
is served here, from the node's own Health. The cluster secret comes in the environment,
as the engine's process had it, never on the command line. The front exits when told to
stop, or when its parent (the engine's process) is gone; it runs in a session of its own,
so a Ctrl-C or a SIGTERM to the node's process group reaches the node, which drains
through it.

    python -m tandem.node.front --host H --port P --ipc DIR
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import logging
import os
import threading
from collections.abc import AsyncIterator
from typing import Any

import grpc
import zmq
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

# Light imports only: this process never loads torch or the engine.
from tandem.engine import trace
from tandem.node import auth
from tandem.node.auth import CLUSTER_SECRET_ENV
from tandem.node.gc_freeze import freeze_startup
from tandem.node.submit import Submitted, serve_submit
from tandem.protos import node_pb2 as pb

log = logging.getLogger("tandem.node.front")

# A call the server has received waits until the asyncio loop takes it up. gRPC's own
# limits on such calls (1,000 pending, then random drops up to 3,000; 30 s untaken)
# cancelled ~1,000 of a burst of 5,000 Generate calls on 2 cores: the node's limit is
# `max_requests`, so they are lifted.
SERVER_OPTIONS = [("grpc.server.max_pending_requests", 1 << 20),
                  ("grpc.server.max_pending_requests_hard_limit", 1 << 20),
                  ("grpc.server_max_unrequested_time_in_server", 600)]

SERVICE = "tandem.node.v1.Node"
# Every method of the Node service: its request type, and whether it streams replies.
METHODS: dict[str, tuple[Any, bool]] = {
    m.name: (getattr(pb, m.input_type.name), m.server_streaming)
    for m in pb.DESCRIPTOR.services_by_name["Node"].methods}
# The messages' kinds (node/calls.py draws them).
CALL, CANCEL, BOUND = b"call", b"cancel", b"bound"
ITEM, END, ERROR, STOP = b"item", b"end", b"error", b"stop"
COLUMNS = b"columns"  # a queue item here: a step's OutputColumns for an Outputs stream
_PARENT_CHECK_S = 1.0
# Health is forwarded as any call; if the engine's process has not answered within
# _HEALTH_WAIT_S (a burst of calls or transfers there holds its asyncio loop or its GIL),
# the front answers with the last reply it saw, if that is fresher than _HEALTH_FRESH_S
# (its seconds_since_step aged to now), so a router or a probe never waits on that
# process's load. The front asks for one every _HEALTH_S besides (for `grpc.health.v1`
# too). A call that may change what Health says (SetRole, Drain) drops the last reply;
# a process that stops answering for longer is seen as before.
_HEALTH_S = 0.25
_HEALTH_WAIT_S = 0.02
_HEALTH_FRESH_S = 1.0
_HEALTH_CHANGERS = frozenset({"SetRole", "Drain"})
_POLL_MS = 100  # the receiver thread looks at `close` this often
_LAST_CHUNK_S = 10.0  # a Generate call that ended waits this long for its last chunk


class Front:
    def __init__(self, ipc: str) -> None:
        self.aio = asyncio.get_running_loop()
        self._context = zmq.Context()
        self._calls = self._context.socket(zmq.PUSH)  # the asyncio loop's only
        self._calls.setsockopt(zmq.SNDHWM, 0)
        self._calls.setsockopt(zmq.LINGER, 0)
        self._calls.connect(f"ipc://{ipc}/calls")
        self._ids = itertools.count()
        self._queues: dict[bytes, asyncio.Queue] = {}  # open calls, by id
        self._outputs: dict[bytes, asyncio.Queue] = {}  # Outputs streams, by subscriber
        # Generate calls whose chunks go through an Outputs stream, by (subscriber, request
        # id): set once their last chunk has gone out in it.
        self._sent: dict[tuple[bytes, str], asyncio.Future] = {}
        self.stop = asyncio.Event()
        self.grace = 5.0
        # The engine's last Health reply and the loop time it was asked at (None: ask);
        # and a count of the starts and ends of calls that may change it, so a reply
        # asked for before one of them is not kept.
        self.health: tuple[pb.HealthReply, float] | None = None
        self.health_epoch = 0
        self._closing = threading.Event()
        self._receiver = threading.Thread(target=self._receive, args=(ipc,),
                                          name="front-receive", daemon=True)
        self._receiver.start()

    def handler(self) -> grpc.GenericRpcHandler:
        methods = {}
        for name, (_, streams) in METHODS.items():
            if name == "Health":
                methods[name] = grpc.unary_unary_rpc_method_handler(self._health_call)
            elif name == "Outputs":
                methods[name] = grpc.unary_stream_rpc_method_handler(self._outputs_call)
            elif name == "Generate":
                methods[name] = grpc.unary_stream_rpc_method_handler(self._generate_call)
            elif name == "Submit":
                methods[name] = grpc.stream_stream_rpc_method_handler(self._submit_call)
            elif streams:
                methods[name] = grpc.unary_stream_rpc_method_handler(self._streaming(name))
            else:
                methods[name] = grpc.unary_unary_rpc_method_handler(self._unary(name))
        return grpc.method_handlers_generic_handler(SERVICE, methods)

    def close(self) -> None:
        """On the asyncio loop, last: the receiver thread ends and closes its sockets."""
        self._closing.set()
        self._receiver.join()
        self._calls.close(linger=0)
        self._context.term()

    def bound(self, port: int) -> None:
        self._calls.send_multipart((b"", BOUND, str(port).encode()))

    # -- calls ---------------------------------------------------------------------------

    async def _health_call(self, request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        """Health: forwarded; the last reply, aged, if the answer is slow (_HEALTH_WAIT_S)."""
        asked, epoch = self.aio.time(), self.health_epoch
        async with _Call(self, "Health", request, context) as call:
            try:
                reply = await asyncio.wait_for(call.next(context), _HEALTH_WAIT_S)
            except TimeoutError:
                cached = self.health
                if cached is not None and self.aio.time() - cached[1] < _HEALTH_FRESH_S:
                    aged = pb.HealthReply()
                    aged.CopyFrom(cached[0])
                    aged.seconds_since_step += self.aio.time() - cached[1]
                    return aged.SerializeToString()
                reply = await call.next(context)
            if reply is None:
                await context.abort(grpc.StatusCode.INTERNAL, "Health sent no reply")
            call.ended = True
            self.keep_health(pb.HealthReply.FromString(reply), asked, epoch)
            return reply

    def keep_health(self, reply: pb.HealthReply, asked: float, epoch: int) -> None:
        """The engine's Health `reply`, asked for at loop time `asked` in `epoch`."""
        if epoch == self.health_epoch and (self.health is None or self.health[1] < asked):
            self.health = (reply, asked)

    def _unary(self, method: str):  # noqa: ANN202 - a gRPC handler
        async def call(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
            changes = method in _HEALTH_CHANGERS
            if changes:
                self._health_changed()
            try:
                async with _Call(self, method, request, context) as call:
                    reply = await call.next(context)
                    if reply is None:
                        await context.abort(grpc.StatusCode.INTERNAL, f"{method} sent no reply")
                    call.ended = True  # its end follows the reply: nothing to cancel
                    return reply
            finally:
                if changes:
                    self._health_changed()
        return call

    def _health_changed(self) -> None:
        self.health = None
        self.health_epoch += 1

    def _streaming(self, method: str):  # noqa: ANN202 - a gRPC handler
        async def call(request: bytes, context: grpc.aio.ServicerContext
                       ) -> AsyncIterator[bytes]:
            async with _Call(self, method, request, context) as call:
                while (item := await call.next(context)) is not None:
                    yield item
        return call

    async def _generate_call(self, request: bytes, context: grpc.aio.ServicerContext
                             ) -> AsyncIterator[bytes]:
        async for item in self._generate(pb.GenerateRequest.FromString(request), request,
                                         context):
            yield item

    async def _generate(self, msg: pb.GenerateRequest, request: bytes,
                        context: grpc.aio.ServicerContext | Submitted
                        ) -> AsyncIterator[bytes]:
        """Generate: forwarded; one whose chunks go through an Outputs stream ends once its
        last chunk has gone out there, not before (the router reads a call's end as
        "the last chunk is on its way", and that stream may be behind)."""
        key = (msg.subscriber.encode(), msg.request.request_id)
        trace.mark(msg.request.request_id, "front.generate")
        sent = None
        if msg.subscriber and key not in self._sent:  # a second one of the id is refused
            sent = self._sent[key] = self.aio.create_future()
        try:
            async with _Call(self, "Generate", request, context) as call:
                while (item := await call.next(context)) is not None:
                    yield item
            if sent is not None:  # bounded: a lost chunk must not hold the call for ever
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(sent, _LAST_CHUNK_S)
        finally:
            if sent is not None and self._sent.get(key) is sent:
                del self._sent[key]

    async def _submit_call(self, batches: AsyncIterator[bytes],
                           context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
        """Submit (node/submit.py): each request forwarded as its own Generate or Prefill
        call."""
        async for reply in serve_submit(batches, self._submit_one, self._prefill_one):
            yield reply

    async def _submit_one(self, msg: pb.GenerateRequest, context: Submitted) -> None:
        async for _ in self._generate(msg, msg.SerializeToString(), context):
            pass  # a subscriber's call carries no chunk

    async def _prefill_one(self, msg: pb.PrefillRequest, context: Submitted) -> bytes:
        return await self._unary("Prefill")(msg.SerializeToString(), context)

    async def _outputs_call(self, request: bytes, context: grpc.aio.ServicerContext
                            ) -> AsyncIterator[bytes]:
        """Outputs: forwarded (the engine's process holds the stream open), and each
        step's columns for its subscriber made into batches here; what queued while the
        last batch was sent goes as one."""
        subscriber = pb.OutputsRequest.FromString(request).subscriber.encode()
        async with _Call(self, "Outputs", request, context) as call:
            if subscriber:
                self._outputs[subscriber] = call.replies
            try:
                while (item := await call.next(context)) is not None:
                    yield item
                    self._went_out(subscriber, call.take_ends())
            finally:
                if self._outputs.get(subscriber) is call.replies:
                    del self._outputs[subscriber]
                # The stream is gone: its Generate calls end (the router sees it closed).
                self._went_out(subscriber, [rid for sub, rid in self._sent if sub == subscriber])

    def _went_out(self, subscriber: bytes, request_ids: list[str]) -> None:
        for rid in request_ids:
            sent = self._sent.get((subscriber, rid))
            if sent is not None and not sent.done():
                sent.set_result(None)

    def _open(self, method: str, request: bytes, seconds_left: float | None
              ) -> tuple[bytes, asyncio.Queue]:
        call_id = str(next(self._ids)).encode()
        replies: asyncio.Queue = asyncio.Queue()
        self._queues[call_id] = replies
        left = b"" if seconds_left is None else repr(seconds_left).encode()
        self._calls.send_multipart((call_id, CALL, method.encode(), request, left))
        return call_id, replies

    def _close(self, call_id: bytes, ended: bool) -> None:
        self._queues.pop(call_id, None)
        if not ended:
            self._calls.send_multipart((call_id, CANCEL))

    # -- the receiver thread ---------------------------------------------------------------

    def _receive(self, ipc: str) -> None:
        replies = self._context.socket(zmq.PULL)
        columns = self._context.socket(zmq.PULL)
        replies.connect(f"ipc://{ipc}/replies")
        columns.connect(f"ipc://{ipc}/columns")
        poller = zmq.Poller()
        poller.register(replies, zmq.POLLIN)
        poller.register(columns, zmq.POLLIN)
        try:
            while not self._closing.is_set():
                for sock, _ in poller.poll(_POLL_MS):
                    frames = sock.recv_multipart(copy=True)
                    if sock is columns:
                        step = pb.OutputColumns.FromString(frames[1])
                        self.aio.call_soon_threadsafe(self._columns, frames[0], step)
                    else:
                        self.aio.call_soon_threadsafe(self._reply_frames, frames)
        except RuntimeError:  # the loop closed
            pass
        finally:  # a zmq socket is closed by the thread that uses it
            replies.close(linger=0)
            columns.close(linger=0)

    def _columns(self, subscriber: bytes, step: pb.OutputColumns) -> None:
        queue = self._outputs.get(subscriber)
        if queue is not None:
            queue.put_nowait((COLUMNS, step))

    def _reply_frames(self, frames: list[bytes]) -> None:
        call_id, kind = frames[0], frames[1]
        if kind == STOP:
            self.grace = float(frames[2])
            self.stop.set()
            return
        queue = self._queues.get(call_id)
        if queue is not None:
            queue.put_nowait((kind, *frames[2:]))


class _Call:
    """One forwarded call, open while in the `async with`. A call that ends before its
    last reply (its client left) is cancelled in the engine's process."""

    def __init__(self, front: Front, method: str, request: bytes,
                 context: grpc.aio.ServicerContext | Submitted) -> None:
        self.front, self.method, self.request = front, method, request
        self.seconds_left = context.time_remaining()
        self.ended = False
        self._held: tuple[bytes, ...] | None = None  # a reply taken from behind columns
        self._ends: list[str] = []  # Outputs: requests whose last chunk the batch holds

    async def __aenter__(self) -> _Call:
        self.call_id, self.replies = self.front._open(self.method, self.request,
                                                      self.seconds_left)
        return self

    async def __aexit__(self, kind: type | None, exc: BaseException | None, tb: object) -> None:
        self.front._close(self.call_id, self.ended)

    async def next(self, context: grpc.aio.ServicerContext | Submitted) -> bytes | None:
        """The next reply (an Outputs stream's: a batch of the steps queued); None once
        the call ended; its error ends the gRPC call."""
        if self._held is not None:
            (kind, *fields), self._held = self._held, None
        else:
            kind, *fields = await self.replies.get()
        if kind == COLUMNS:
            steps = [fields[0], *self._more_columns()]
            self._ends = [end.request_id for step in steps for end in step.ends]
            return merge_columns(steps).SerializeToString()
        if kind == ITEM:
            return fields[0]
        if kind == ERROR:
            await context.abort(grpc.StatusCode[fields[0].decode()], fields[1].decode())
        if kind != END:
            raise RuntimeError(f"unknown reply {kind!r}")
        self.ended = True
        return None

    def take_ends(self) -> list[str]:
        """The requests whose last chunk went in the batch `next` returned last."""
        ends, self._ends = self._ends, []
        return ends

    def _more_columns(self) -> list[pb.OutputColumns]:
        """The steps' columns queued now, up to the first other reply (held)."""
        steps = []
        while not self.replies.empty():
            kind, *fields = self.replies.get_nowait()
            if kind != COLUMNS:
                self._held = (kind, *fields)
                break
            steps.append(fields[0])
        return steps


def merge_columns(steps: list[pb.OutputColumns]) -> pb.OutputBatch:
    """Steps' columns as one batch, a chunk per request (its entries' tokens and text in
    order, its head's fields on it, its end's last)."""
    batch = pb.OutputBatch()
    chunks: dict[str, pb.GenerateChunk] = {}
    for columns in steps:
        tokens, at = columns.token_ids, 0
        for rid, n, text in zip(columns.request_ids, columns.num_tokens, columns.texts,
                                strict=True):
            chunk = chunks.get(rid)
            if chunk is None:
                chunk = chunks[rid] = batch.chunks.add(request_id=rid)
            chunk.token_ids.extend(tokens[at:at + n])
            chunk.text += text
            at += n
        for head in columns.heads:
            chunks[head.request_id].MergeFrom(head)
        for end in columns.ends:
            chunks[end.request_id].MergeFrom(end)
    return batch


async def _watch_health(front: Front, servicer: Any) -> None:
    """Ask the engine's process for its Health every _HEALTH_S, for the node's Health
    calls (`Front.health`) and for `grpc.health.v1`: "" while the engine is alive,
    "tandem.Node" while it also takes new requests."""
    serving = health_pb2.HealthCheckResponse.SERVING
    not_serving = health_pb2.HealthCheckResponse.NOT_SERVING
    request = pb.HealthRequest().SerializeToString()
    state = None
    while True:
        asked, epoch = front.aio.time(), front.health_epoch
        call_id, replies = front._open("Health", request, 10.0)
        try:
            kind, *fields = await asyncio.wait_for(replies.get(), 10.0)
            reply = pb.HealthReply.FromString(fields[0]) if kind == ITEM else None
        except TimeoutError:
            reply = None
        finally:
            front._close(call_id, True)
        if reply is not None:
            front.keep_health(reply, asked, epoch)
        alive = reply is not None and reply.engine_alive
        if (alive, alive and reply.accepting) != state:
            state = (alive, alive and reply.accepting)
            await servicer.set("", serving if alive else not_serving)
            await servicer.set("tandem.Node", serving if state[1] else not_serving)
        await asyncio.sleep(_HEALTH_S)


async def _orphaned(parent: int) -> None:
    while os.getppid() == parent:
        await asyncio.sleep(_PARENT_CHECK_S)


async def serve(host: str, port: int, ipc: str, parent: int) -> None:
    front = Front(ipc)
    secret = os.environ.get(CLUSTER_SECRET_ENV)
    server = grpc.aio.server(
        interceptors=auth.aio_server_interceptors(secret.encode() if secret else None),
        options=SERVER_OPTIONS)
    server.add_generic_rpc_handlers((front.handler(),))
    servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise OSError(f"cannot listen on {host}:{port}")
    await server.start()
    front.bound(bound)
    watch = asyncio.ensure_future(_watch_health(front, servicer))
    orphaned = asyncio.ensure_future(_orphaned(parent))
    stopped = asyncio.ensure_future(front.stop.wait())
    await asyncio.wait((orphaned, stopped), return_when=asyncio.FIRST_COMPLETED)
    watch.cancel()
    try:
        await server.stop(front.grace)
    finally:
        front.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--host", required=True, help="the interface the node's gRPC port binds")
    p.add_argument("--port", type=int, required=True, help="its port (0: a free one)")
    p.add_argument("--ipc", required=True, help="the directory of the engine process's "
                   "sockets (node/calls.py)")
    p.add_argument("--parent", type=int, required=True, help="exit once this pid is gone")
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    try:  # uvloop's loop where it is installed (as node/aio.py's new_event_loop)
        import uvloop
        loop = uvloop.new_event_loop()
    except ImportError:
        loop = asyncio.new_event_loop()
    freeze_startup()
    loop.run_until_complete(serve(args.host, args.port, args.ipc, args.parent))


if __name__ == "__main__":
    main()
