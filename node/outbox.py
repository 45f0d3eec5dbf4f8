"""Generated tokens on their way out of a decode node.

Each request's engine outputs become `GenerateChunk`s (`Chunks`). They leave either in
the request's own Generate stream (`CallStream`), or, for a call that names a
subscriber, through that router's one `Outputs` stream (`Outbox`). Either way the
engine thread only posts each output to the node's asyncio loop (`Bridge`: one wake-up
per step for every request), where chunks are made; an Outbox sends whatever has
queued (about one engine step of every request) as one message.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from tandem.engine import trace
from tandem.engine.outputs import RequestOutput
from tandem.node.aio import Bridge
from tandem.protos import node_pb2 as pb

Output = RequestOutput | BaseException


class Chunks:
    """One request's outputs as chunks: the tokens each output adds, its text, the first
    chunk's `head` fields (where the prompt was computed) and the usage counts on the
    last. `done` is set once the last chunk is made, or the request failed (`error`).
    Used on the asyncio loop only."""

    def __init__(self, request_id: str, head: pb.GenerateChunk | None = None) -> None:
        self.request_id = request_id
        self.head = head
        self.sent = 0  # tokens in the chunks made so far
        self.done = asyncio.Event()
        self.error: BaseException | None = None

    def chunk(self, out: RequestOutput, named: bool = False, text: str | None = None
              ) -> pb.GenerateChunk:
        """The chunk of the tokens `out` adds since the last chunk; `text`: their text, if
        not `out.delta` (outputs merged into one chunk)."""
        chunk = pb.GenerateChunk(token_ids=out.token_ids[self.sent:],
                                 text=out.delta if text is None else text)
        if named:
            chunk.request_id = self.request_id
        if self.head is not None:
            trace.mark(self.request_id, "decode.first_chunk")
            chunk.MergeFrom(self.head)
            self.head = None
        self.sent = len(out.token_ids)
        if out.finished:
            chunk.finish_reason = out.finish_reason or ""
            chunk.prompt_tokens = len(out.prompt_token_ids)
            chunk.completion_tokens = len(out.token_ids)
            chunk.cached_tokens = out.num_cached_tokens
            self.done.set()
        return chunk

    def fail(self, exc: BaseException) -> None:
        self.error = exc
        self.done.set()


class CallStream:
    """A request's outputs for its own Generate stream: `listener` (engine thread)
    posts them; `get` awaits the next."""

    def __init__(self, bridge: Bridge) -> None:
        self._bridge = bridge
        self._queue: asyncio.Queue[Output] = asyncio.Queue()

    def listener(self, out: Output) -> None:
        self._bridge.post(self._queue.put_nowait, out)

    async def get(self) -> Output:
        return await self._queue.get()


class Outbox:
    """One subscriber's Outputs stream. `listener(chunks)` is an engine listener that
    queues the request's outputs here; `batches` makes and yields them, in order, as
    `OutputBatch`es until `close()`."""

    def __init__(self, subscriber: str, bridge: Bridge) -> None:
        self.subscriber = subscriber
        self._bridge = bridge
        self._queue: asyncio.Queue[tuple[Chunks, RequestOutput] | None] = asyncio.Queue()
        self.closed = asyncio.Event()

    def listener(self, chunks: Chunks):  # noqa: ANN201 - a Listener
        def on_output(out: Output) -> None:  # on the engine thread
            self._bridge.post(self._put, chunks, out)
        return on_output

    def _put(self, chunks: Chunks, out: Output) -> None:
        if isinstance(out, BaseException):
            chunks.fail(out)  # its Generate call reports it
        elif not self.closed.is_set():
            self._queue.put_nowait((chunks, out))

    def close(self) -> None:
        """On the asyncio loop."""
        self.closed.set()
        self._queue.put_nowait(None)  # wakes the sender

    async def batches(self) -> AsyncIterator[pb.OutputBatch]:
        """Whatever has queued, as one batch: a request's outputs that queued while the
        stream was busy (its reader behind the engine) go as one chunk, so a slow reader
        gets fewer, larger messages rather than falling further behind."""
        yield pb.OutputBatch()  # open
        while not self.closed.is_set():
            item = await self._queue.get()
            queued: dict[Chunks, list[RequestOutput]] = {}
            while item is not None:
                chunks, out = item
                queued.setdefault(chunks, []).append(out)
                if self._queue.empty():
                    break
                item = self._queue.get_nowait()
            batch = pb.OutputBatch()
            for chunks, outs in queued.items():
                text = None if len(outs) == 1 else "".join(out.delta for out in outs)
                batch.chunks.append(chunks.chunk(outs[-1], named=True, text=text))
            if batch.chunks:
                yield batch
