"""A node's side of the Submit stream (protos/node.proto; a router's side is
router/submit.py), served by its gRPC front: each request of each `SubmitBatch` runs as its
own Generate call would (`generate(msg, context)`, the batch's timeout its deadline), and
its `SubmitEnd` goes back once that call would have ended; the ends that came while the
last reply went out go as one. A batch's cancels come after its requests (a cancel may
name one of them); a cancelled request sends no end (its caller gave it up). The stream's
end cancels the requests it still carries, as their calls' ends would.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable

import grpc

from tandem.protos import node_pb2 as pb

Generate = Callable[[pb.GenerateRequest, "Submitted"], Awaitable[None]]


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


async def serve_submit(batches: AsyncIterator[bytes], generate: Generate
                       ) -> AsyncIterator[bytes]:
    """The stream's replies: an empty one (open), then the ends as they come."""
    ends: asyncio.Queue = asyncio.Queue()  # SubmitEnd; None once the caller is done
    running: dict[str, asyncio.Task] = {}
    reading = asyncio.ensure_future(_take(batches, generate, running, ends))
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


async def _take(batches: AsyncIterator[bytes], generate: Generate,
                running: dict[str, asyncio.Task], ends: asyncio.Queue) -> None:
    try:
        async for raw in batches:
            batch = pb.SubmitBatch.FromString(raw)
            for msg in batch.requests:
                rid = msg.request.request_id
                if rid in running:
                    ends.put_nowait(pb.SubmitEnd(
                        request_id=rid, code="INVALID_ARGUMENT",
                        details=f"request {rid} is already running on this stream"))
                    continue
                running[rid] = asyncio.ensure_future(
                    _run(msg, Submitted(batch.timeout_s), generate, running, ends))
            for rid in batch.cancel:
                if (task := running.get(rid)) is not None:
                    task.cancel()
    finally:
        ends.put_nowait(None)


async def _run(msg: pb.GenerateRequest, context: Submitted, generate: Generate,
               running: dict[str, asyncio.Task], ends: asyncio.Queue) -> None:
    rid = msg.request.request_id
    end = pb.SubmitEnd(request_id=rid, code="OK")
    try:
        async with asyncio.timeout(context.time_remaining()):  # as a call's deadline
            await generate(msg, context)
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
