"""The Submit stream (protos/node.proto): calls many to a message, a caller's one stream
per node instead of a call per request.

Each gRPC call costs its client 0.2-0.5 ms of the event loop's time (a burst of 256 made
on a synchronous channel: `integrated_call` was a third of the router's busy samples); a
burst's requests on one stream cost a write per loop round (on an H200, SmolLM2 shape,
256 prompts at rate inf, colocated: the router's CPU per burst 0.58 s against 1.0-1.4).
A router sends a decode node its Generate calls this way (their chunks come by its
Outputs stream); a decode node sends a prefill node its Prefill calls, each end bringing
its call's reply.

The caller's side, `Submitter`: `submit` queues a request and wakes the writer, which
sends what queued as one `SubmitBatch`; the reader hands each `SubmitEnd` to its request
(`CALL_ENDED`, a Prefill's `PrefillReply`, or the AioRpcError its call would have raised).
A request given up (`cancel`) is cancelled in the next batch, as a cancelled call would
be. When the stream ends, every request it carries gets UNAVAILABLE.

The writer is a task, woken by a future (one loop round from a `submit` to its write,
where an `asyncio.Event` waited on through `asyncio.wait` took three): a burst's requests
come in a few long rounds, and a writer three rounds behind sent none of them before the
last arrived (CPU, tiny, colocated, 256 at rate inf: one batch of 256, 0.216 s after the
first request, against a first batch of 39 at 0.046 s with the future). A thread of
gRPC's writing from a queue instead, which the GIL let run every few milliseconds, cost
the router more: 0.95-1.35 s per burst.

`open` is True once the node's first, empty reply came. A node that does not serve
Submit (UNIMPLEMENTED: a node served without its front, or an older one) is never asked
again: its requests make their own calls.

The node's side, `serve_submit`, run by its gRPC front: each request of each batch runs
as its own call would (the batch's timeout its deadline), and its `SubmitEnd` goes back
once that call would have ended; the ends that came while the last reply went out go as
one. A batch's cancels come after its requests (a cancel may name one of them); a
cancelled request sends no end (its caller gave it up). The stream's end cancels the
requests it still carries, as their calls' ends would.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import AsyncIterator, Awaitable, Callable

import grpc

from tandem.engine import trace
from tandem.node import auth
from tandem.protos import node_pb2 as pb

log = logging.getLogger(__name__)

Call = pb.GenerateRequest | pb.PrefillRequest  # what a Submit stream carries

CALL_ENDED = object()  # a request's end when its call would have ended well
RETRY_S = 1.0  # a closed stream is opened again this long after


class Submitter:
    def __init__(self, stub: auth.AuthedStub, name: str) -> None:
        self._stub, self._name = stub, name
        self.open = False
        self.served = True  # False once the node said it does not serve Submit
        self._pending: dict[float, list[Call]] = {}  # by their timeout
        self._cancels: list[str] = []
        # By request id: its end's callback, and whether it is a Prefill.
        self._ended: dict[str, tuple[Callable[[object], None], bool]] = {}
        self._wake: asyncio.Future | None = None  # the writer's, while it waits for work
        self._tried = asyncio.Event()  # set once the first try to open the stream ended

    def submit(self, msg: Call, timeout_s: float, ended: Callable[[object], None]) -> None:
        """Send `msg` in the next batch, to end within `timeout_s` (its call's deadline);
        `ended(end)` is called on this loop once."""
        self._ended[msg.request.request_id] = (ended, isinstance(msg, pb.PrefillRequest))
        self._pending.setdefault(timeout_s, []).append(msg)
        self._wakeup()

    def cancel(self, rid: str) -> None:
        """Stop a request sent here (its `ended` is not called)."""
        if self._ended.pop(rid, None) is not None:
            self._cancels.append(rid)
            self._wakeup()

    async def run(self, wanted: Callable[[], bool]) -> None:
        """Keep the stream open while `wanted()`, until the node says it serves none."""
        while self.served:
            if wanted():
                await self._stream()
            await asyncio.sleep(RETRY_S)

    async def _stream(self) -> None:
        call = self._stub.Submit()
        why = "the Submit stream ended"
        try:
            await call.read()  # the node's first, empty reply: open
            self.open = True
            self._tried.set()
            reader = asyncio.ensure_future(self._read(call))
            try:
                await self._write(call, reader)
            finally:
                reader.cancel()
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
                log.info("%s serves no Submit stream: each request makes its own call",
                         self._name)
                self.served = False
            why = f"the Submit stream failed: {exc.details()}"
        finally:
            self._tried.set()
            call.cancel()
            self._close(why)

    async def wait_open(self, timeout_s: float) -> bool:
        """Whether the stream is open; before its first try to open it ended, after
        waiting up to `timeout_s` for that (a burst's first requests go on it too)."""
        if not self._tried.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._tried.wait(), timeout_s)
        return self.open

    def _wakeup(self) -> None:
        if self._wake is not None and not self._wake.done():
            self._wake.set_result(None)

    async def _write(self, call: grpc.aio.StreamStreamCall, reader: asyncio.Future) -> None:
        reader.add_done_callback(lambda _: self._wakeup())
        while not reader.done():
            if not (self._pending or self._cancels):
                self._wake = asyncio.get_running_loop().create_future()
                await self._wake
                continue
            pending, cancels, self._pending, self._cancels = self._pending, self._cancels, {}, []
            batches = [_batch(calls, timeout_s)
                       for timeout_s, calls in pending.items()] or [pb.SubmitBatch()]
            batches[-1].cancel.extend(cancels)  # the node takes a batch's requests first
            for batch in batches:
                await call.write(batch)
                if trace.PATH is not None:
                    for msg in (*batch.requests, *batch.prefills):
                        trace.mark(msg.request.request_id, "submit.written")
        reader.result()  # its error, if it failed

    async def _read(self, call: grpc.aio.StreamStreamCall) -> None:
        while (reply := await call.read()) is not grpc.aio.EOF:
            for end in reply.ends:
                ended = self._ended.pop(end.request_id, None)
                if ended is not None:
                    ended[0](_end(end, ended[1]))

    def _close(self, why: str) -> None:
        if self.open:
            log.info("%s: %s", self._name, why)
        self.open = False
        ended, self._ended, self._pending, self._cancels = self._ended, {}, {}, []
        error = rpc_error(grpc.StatusCode.UNAVAILABLE, why)
        for callback, _ in ended.values():
            callback(error)


def call_end(call: grpc.Future) -> object:
    """A Generate call's end (one made on its own, `NodeClient.start_generate`), as a
    submitted request's: `CALL_ENDED`, or the AioRpcError an asyncio call would raise."""
    code = call.code()
    return CALL_ENDED if code == grpc.StatusCode.OK else rpc_error(code, call.details())


def _batch(calls: list[Call], timeout_s: float) -> pb.SubmitBatch:
    batch = pb.SubmitBatch(timeout_s=timeout_s)
    for msg in calls:
        (batch.prefills if isinstance(msg, pb.PrefillRequest) else batch.requests).append(msg)
    return batch


def _end(end: pb.SubmitEnd, prefill: bool) -> object:
    if end.code == "OK":
        return pb.PrefillReply.FromString(end.prefill) if prefill else CALL_ENDED
    return rpc_error(grpc.StatusCode.__members__.get(end.code, grpc.StatusCode.UNKNOWN),
                  end.details)


def rpc_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    """The AioRpcError an asyncio call that ended with `code` would have raised."""
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


# -- the node's side ---------------------------------------------------------------

Generate = Callable[[pb.GenerateRequest, "Submitted"], Awaitable[None]]
Prefill = Callable[[pb.PrefillRequest, "Submitted"], Awaitable[bytes]]  # its reply


class CallFailed(Exception):
    """A submitted request's call failed with `code` (`Submitted.abort`)."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code, self.details = code, details


class Submitted:
    """What the front's forwarded call asks of a gRPC context, for a submitted request."""

    def __init__(self, timeout_s: float) -> None:
        self._deadline = asyncio.get_running_loop().time() + timeout_s

    def time_remaining(self) -> float:
        return max(0.0, self._deadline - asyncio.get_running_loop().time())

    async def abort(self, code: grpc.StatusCode, details: str) -> None:
        raise CallFailed(code, details)


async def serve_submit(batches: AsyncIterator[bytes], generate: Generate, prefill: Prefill
                       ) -> AsyncIterator[bytes]:
    """The stream's replies: an empty one (open), then the ends as they come."""
    ends: asyncio.Queue = asyncio.Queue()  # SubmitEnd; None once the caller is done
    running: dict[str, asyncio.Task] = {}
    reading = asyncio.ensure_future(_take(batches, generate, prefill, running, ends))
    try:
        yield pb.SubmitEnds().SerializeToString()
        done = False
        while not done or running:
            reply = pb.SubmitEnds()
            for end in [await ends.get(), *_queued(ends)]:
                if end is None:
                    done = True
                else:
                    reply.ends.append(end)
            if reply.ends:
                yield reply.SerializeToString()
    finally:
        reading.cancel()
        for task in running.values():
            task.cancel()


async def _take(batches: AsyncIterator[bytes], generate: Generate, prefill: Prefill,
                running: dict[str, asyncio.Task], ends: asyncio.Queue) -> None:
    try:
        async for raw in batches:
            batch = pb.SubmitBatch.FromString(raw)
            if trace.PATH is not None:
                for msg in (*batch.requests, *batch.prefills):
                    trace.mark(msg.request.request_id, "submit.taken")
            calls = [*((msg, generate) for msg in batch.requests),
                     *((msg, prefill) for msg in batch.prefills)]
            for msg, serve in calls:
                rid = msg.request.request_id
                if rid in running:
                    ends.put_nowait(pb.SubmitEnd(
                        request_id=rid, code="INVALID_ARGUMENT",
                        details=f"request {rid} is already running on this stream"))
                    continue
                context = Submitted(batch.timeout_s)
                running[rid] = asyncio.ensure_future(
                    _run(rid, functools.partial(serve, msg, context), context, running, ends))
            for rid in batch.cancel:
                if (task := running.get(rid)) is not None:
                    task.cancel()
    finally:
        ends.put_nowait(None)


async def _run(rid: str, serve: Callable[[], Awaitable[bytes | None]], context: Submitted,
               running: dict[str, asyncio.Task], ends: asyncio.Queue) -> None:
    end = pb.SubmitEnd(request_id=rid, code="OK")
    try:
        async with asyncio.timeout(context.time_remaining()):  # as a call's deadline
            reply = await serve()
        if reply is not None:
            end.prefill = reply
    except TimeoutError:
        end.code, end.details = "DEADLINE_EXCEEDED", "Deadline Exceeded"
    except CallFailed as exc:
        end.code, end.details = exc.code.name, exc.details
    except Exception as exc:  # noqa: BLE001 - the request fails, not the stream
        end.code, end.details = "INTERNAL", f"{type(exc).__name__}: {exc}"
    finally:
        running.pop(rid, None)
    ends.put_nowait(end)


def _queued(queue: asyncio.Queue) -> list[object]:
    items = []
    while not queue.empty():
        items.append(queue.get_nowait())
    return items
