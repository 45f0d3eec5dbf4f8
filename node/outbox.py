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
import collections
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

    def chunk(self, out: RequestOutput, text: str | None = None,
              into: pb.GenerateChunk | None = None) -> pb.GenerateChunk:
        """The chunk of the tokens `out` adds since the last chunk, written into `into`
        (a new one if None; in an OutputBatch it is named); `text`: their text, if not
        `out.delta` (outputs merged into one chunk)."""
        chunk = pb.GenerateChunk() if into is None else into
        chunk.token_ids.extend(out.token_ids[self.sent:])
        chunk.text = out.delta if text is None else text
        if into is not None:
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
    `OutputBatch`es until `close()`. Used on the asyncio loop, but for the listeners."""

    def __init__(self, subscriber: str, bridge: Bridge) -> None:
        self.subscriber = subscriber
        self._bridge = bridge
        # Every request's outputs since the last batch, in order, appended by the engine
        # thread itself (a deque's append is atomic); `_queued` is set, through the
        # bridge, once per batch. A step's outputs cost an append each on the engine
        # thread and one wake-up of the loop, not a bridged call and a queue's put and
        # get each: Python on the loop's thread takes the GIL from the engine's.
        self._outputs: collections.deque[tuple[Chunks, RequestOutput]] = collections.deque()
        self._waking = False  # a wake-up is posted and has not run yet
        self._queued = asyncio.Event()
        self.closed = asyncio.Event()

    def listener(self, chunks: Chunks):  # noqa: ANN201 - a Listener
        def on_output(out: Output) -> None:  # on the engine thread
            if isinstance(out, BaseException):
                self._bridge.post(chunks.fail, out)  # its Generate call reports it
                return
            if self.closed.is_set():
                return
            self._outputs.append((chunks, out))
            if not self._waking:
                self._waking = True
                self._bridge.post(self._wake)
        return on_output

    def _wake(self) -> None:
        self._waking = False
        if not self.closed.is_set():
            self._queued.set()

    def close(self) -> None:
        self.closed.set()
        self._queued.set()  # wakes the sender

    async def batches(self) -> AsyncIterator[pb.OutputBatch]:
        """Whatever has queued, as one batch: a request's outputs that queued while the
        stream was busy (its reader behind the engine) go as one chunk, so a slow reader
        gets fewer, larger messages rather than falling further behind."""
        yield pb.OutputBatch()  # open
        while True:
            await self._queued.wait()
            if self.closed.is_set():
                return
            self._queued.clear()
            queued: dict[Chunks, list[RequestOutput]] = {}
            while self._outputs:
                chunks, out = self._outputs.popleft()
                queued.setdefault(chunks, []).append(out)
            batch = pb.OutputBatch()
            for chunks, outs in queued.items():
                text = None if len(outs) == 1 else "".join(out.delta for out in outs)
                chunks.chunk(outs[-1], text, into=batch.chunks.add())
            if batch.chunks:  # none: what a wake-up announced went with the last batch
                yield batch
