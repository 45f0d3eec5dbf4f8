"""This router's Submit stream to a decode node: the Generate calls whose chunks come by
its Outputs stream, many to a message.

Each gRPC call costs its client 0.2-0.5 ms of the event loop's time (a burst of 256 made
on a synchronous channel: `integrated_call` was a third of the router's busy samples); a
burst's requests on one stream cost a write per loop round (on an H200, SmolLM2 shape,
256 prompts at rate inf, colocated: the router's CPU per burst 0.58 s against 1.0-1.4).
`submit` queues a request and wakes the writer, which sends what queued as one
`SubmitBatch`; the reader hands each `SubmitEnd` to its request (`CALL_ENDED`, or the
AioRpcError its call would have raised). A request given up (`cancel`) is cancelled in
the next batch, as a cancelled call would be. When the stream ends, every request it
carries gets UNAVAILABLE, as when the Outputs stream ends.

The writer is a task: in a burst it runs once the loop's round of arrivals is through, so
the node gets them in one batch, 100-170 ms after the first arrived (a thread of gRPC's
writing from a queue instead, which the GIL let run every few milliseconds, cost the
router more: 0.95-1.35 s per burst).

`open` is True once the node's first, empty reply came. A node that does not serve
Submit (UNIMPLEMENTED: a node served without its front, or an older one) is never asked
again: its requests start their own calls (`NodeClient.start_generate`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import grpc

from tandem.node import auth
from tandem.protos import node_pb2 as pb

log = logging.getLogger(__name__)

CALL_ENDED = object()  # a request's end when its call would have ended well
RETRY_S = 1.0  # a closed stream is opened again this long after


class Submitter:
    def __init__(self, stub: auth.AuthedStub, name: str) -> None:
        self._stub, self._name = stub, name
        self.open = False
        self.served = True  # False once the node said it does not serve Submit
        self._pending: dict[float, list[pb.GenerateRequest]] = {}  # by their timeout
        self._cancels: list[str] = []
        self._ended: dict[str, Callable[[object], None]] = {}  # by request id
        self._wake = asyncio.Event()

    def submit(self, msg: pb.GenerateRequest, timeout_s: float,
               ended: Callable[[object], None]) -> None:
        """Send `msg` in the next batch, to end within `timeout_s` (its call's deadline);
        `ended(end)` is called on this loop once."""
        self._ended[msg.request.request_id] = ended
        self._pending.setdefault(timeout_s, []).append(msg)
        self._wake.set()

    def cancel(self, rid: str) -> None:
        """Stop a request sent here (its `ended` is not called)."""
        if self._ended.pop(rid, None) is not None:
            self._cancels.append(rid)
            self._wake.set()

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
            call.cancel()
            self._close(why)

    async def _write(self, call: grpc.aio.StreamStreamCall, reader: asyncio.Future) -> None:
        while not reader.done():
            waking = asyncio.ensure_future(self._wake.wait())
            await asyncio.wait((waking, reader), return_when=asyncio.FIRST_COMPLETED)
            waking.cancel()
            self._wake.clear()
            if reader.done():
                break
            pending, cancels, self._pending, self._cancels = self._pending, self._cancels, {}, []
            batches = [pb.SubmitBatch(requests=requests, timeout_s=timeout_s)
                       for timeout_s, requests in pending.items()] or [pb.SubmitBatch()]
            batches[-1].cancel.extend(cancels)  # the node takes a batch's requests first
            for batch in batches:
                await call.write(batch)
        reader.result()  # its error, if it failed

    async def _read(self, call: grpc.aio.StreamStreamCall) -> None:
        while (reply := await call.read()) is not grpc.aio.EOF:
            for end in reply.ends:
                ended = self._ended.pop(end.request_id, None)
                if ended is not None:
                    ended(_end(end))

    def _close(self, why: str) -> None:
        if self.open:
            log.info("%s: %s", self._name, why)
        self.open = False
        ended, self._ended, self._pending, self._cancels = self._ended, {}, {}, []
        error = rpc_error(grpc.StatusCode.UNAVAILABLE, why)
        for callback in ended.values():
            callback(error)


def call_end(call: grpc.Future) -> object:
    """A Generate call's end (one made on its own, `NodeClient.start_generate`), as a
    submitted request's: `CALL_ENDED`, or the AioRpcError an asyncio call would raise."""
    code = call.code()
    return CALL_ENDED if code == grpc.StatusCode.OK else rpc_error(code, call.details())


def _end(end: pb.SubmitEnd) -> object:
    if end.code == "OK":
        return CALL_ENDED
    return rpc_error(grpc.StatusCode.__members__.get(end.code, grpc.StatusCode.UNKNOWN),
                  end.details)


def rpc_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    """The AioRpcError an asyncio call that ended with `code` would have raised."""
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)
