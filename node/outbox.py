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
import time
from collections.abc import AsyncIterator, Callable

from tandem.engine import trace
from tandem.engine.outputs import RequestOutput
from tandem.node.aio import Bridge
from tandem.protos import node_pb2 as pb

Output = RequestOutput | BaseException

# A node's Outputs stream to one router carries at most this many chunks a second while
# its engine steps (`ColumnOutbox`): every hop after the engine pays per chunk (the
# router's loop ~15-20 us each, most of it the client socket's write), so many streams
# at short steps would ask one router for more chunks than it can write.
CHUNK_RATE = 10_000


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
        self.closed = False  # its Outputs stream closed before its last chunk was made

    def chunk(self, out: RequestOutput, text: str | None = None,
              into: pb.GenerateChunk | None = None) -> pb.GenerateChunk:
        """The chunk of the tokens `out` adds since the last chunk, written into `into`
        (a new one if None; in an OutputBatch it is named); `text`: their text, if not
        `out.delta` (outputs merged into one chunk)."""
        chunk = pb.GenerateChunk() if into is None else into
        chunk.token_ids.extend(out.tokens_since(self.sent))
        chunk.text = out.delta if text is None else text
        if into is not None:
            chunk.request_id = self.request_id
        if self.head is not None:
            trace.mark(self.request_id, "decode.first_chunk")
            chunk.MergeFrom(self.head)
            self.head = None
        self.sent = out.num_tokens
        if out.finished:
            chunk.finish_reason = out.finish_reason or ""
            chunk.prompt_tokens = len(out.prompt_token_ids)
            chunk.completion_tokens = out.num_tokens
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


class _Stream:
    """What both kinds of Outputs stream share: `closed`, and the Generate calls that
    wait for their requests' last chunks to go out on it (`until_done`). On the asyncio
    loop."""

    def __init__(self, subscriber: str) -> None:
        self.subscriber = subscriber
        self.closed = asyncio.Event()
        self._waiting: set[Chunks] = set()

    async def until_done(self, chunks: Chunks) -> None:
        """Until the request's last chunk is made (or it failed: `chunks.error`), or this
        stream closes first (`chunks.closed`)."""
        if self.closed.is_set():
            chunks.closed = not chunks.done.is_set()
            return
        self._waiting.add(chunks)
        try:
            await chunks.done.wait()
        finally:
            self._waiting.discard(chunks)

    def close(self) -> None:
        self.closed.set()
        for chunks in self._waiting:
            if not chunks.done.is_set():
                chunks.closed = True
                chunks.done.set()


class Outbox(_Stream):
    """One subscriber's Outputs stream. `listener(chunks)` is an engine listener that
    queues the request's outputs here; `batches` makes and yields them, in order, as
    `OutputBatch`es until `close()`. Used on the asyncio loop, but for the listeners."""

    def __init__(self, subscriber: str, bridge: Bridge) -> None:
        super().__init__(subscriber)
        self._bridge = bridge
        # Every request's outputs since the last batch, in order, appended by the engine
        # thread itself (a deque's append is atomic); `_queued` is set, through the
        # bridge, once per batch. A step's outputs cost an append each on the engine
        # thread and one wake-up of the loop, not a bridged call and a queue's put and
        # get each: Python on the loop's thread takes the GIL from the engine's.
        self._outputs: collections.deque[tuple[Chunks, RequestOutput]] = collections.deque()
        self._waking = False  # a wake-up is posted and has not run yet
        self._queued = asyncio.Event()

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
        super().close()
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


class Columns:
    """One engine step's outputs for one Outputs stream, gathered on the engine thread
    (a few appends each) and sent as one `OutputColumns` message: a request's `Chunks`
    (`sent`, `head`) belong to the engine thread once it has started."""

    def __init__(self) -> None:
        self.request_ids: list[str] = []
        self.num_tokens: list[int] = []
        self.token_ids: list[int] = []
        self.texts: list[str] = []
        self.heads: list[pb.GenerateChunk] = []
        self.ends: list[pb.GenerateChunk] = []
        self.done: list[Chunks] = []  # their last entry is here: done once it is sent

    def add(self, chunks: Chunks, out: RequestOutput) -> None:
        new = out.tokens_since(chunks.sent)
        chunks.sent = out.num_tokens
        self.request_ids.append(chunks.request_id)
        self.num_tokens.append(len(new))
        self.token_ids += new
        self.texts.append(out.delta)
        if chunks.head is not None:
            trace.mark(chunks.request_id, "decode.first_chunk")
            head = pb.GenerateChunk(request_id=chunks.request_id)
            head.MergeFrom(chunks.head)
            self.heads.append(head)
            chunks.head = None
        if out.finished:
            self.ends.append(pb.GenerateChunk(
                request_id=chunks.request_id, finish_reason=out.finish_reason or "",
                prompt_tokens=len(out.prompt_token_ids), completion_tokens=out.num_tokens,
                cached_tokens=out.num_cached_tokens))
            self.done.append(chunks)

    def extend(self, other: Columns) -> None:
        """`other`'s entries after these (none of its requests among these)."""
        for mine, theirs in ((self.request_ids, other.request_ids),
                             (self.num_tokens, other.num_tokens),
                             (self.token_ids, other.token_ids), (self.texts, other.texts),
                             (self.heads, other.heads), (self.ends, other.ends),
                             (self.done, other.done)):
            mine += theirs

    def message(self) -> pb.OutputColumns:
        return pb.OutputColumns(request_ids=self.request_ids, num_tokens=self.num_tokens,
                                token_ids=self.token_ids, texts=self.texts, heads=self.heads,
                                ends=self.ends)


class ColumnOutbox(_Stream):
    """An Outputs stream whose batches another process makes (`node/front.py`): the
    engine thread gathers each step's outputs as `Columns` and `flush` (after the step)
    hands them to `send(subscriber, message)`, at most once per `interval_s` while the
    engine steps (the stream interval: a request's tokens of the steps between go as one
    chunk, and every hop after pays per chunk, not per token), and no more often than
    keeps the stream under `chunk_rate` chunks a second (0: no cap): N requests running
    get a chunk each at most every N / `chunk_rate` seconds, so the interval grows with
    the load and is no longer than a step's where few requests run. `batches` only opens
    the stream and holds it until `close()`. Its listeners carry it as their sink
    (`ColumnListener`); `closed` as `Outbox`'s."""

    def __init__(self, subscriber: str, bridge: Bridge,
                 send: Callable[[str, bytes], None], interval_s: float = 0.0,
                 chunk_rate: float = CHUNK_RATE) -> None:
        super().__init__(subscriber)
        self._bridge, self._send = bridge, send
        # The engine thread's: requests' first chunks, sent at once, and the rest, held
        # for the interval. A first token does not take the others' with it: where
        # requests start one after another (1P1D, each as its push lands), nearly every
        # step has one, and the interval would hold nothing back.
        self._firsts, self._columns = Columns(), Columns()
        self.interval_s = interval_s
        # A chunk per request running, so this long between sends for each of them.
        self._per_stream_s = 1.0 / chunk_rate if chunk_rate > 0 else 0.0
        self._streams = 0  # the most requests of one step's outputs since the last send
        self._sent_at = float("-inf")  # time.monotonic() of the last send

    def listener(self, chunks: Chunks) -> ColumnListener:
        return ColumnListener(self, chunks)

    def fail(self, chunks: Chunks, exc: BaseException) -> None:
        """On the engine thread: the request failed; its Generate call reports it."""
        self._bridge.post(chunks.fail, exc)

    def take(self, items: list[tuple[ColumnListener, RequestOutput]]) -> None:
        """On the engine thread: a step's outputs into the columns. Most are one more
        token of a running request that has had its first chunk: four appends."""
        if self.closed.is_set():
            return
        self._streams = max(self._streams, len(items))
        columns = self._columns
        ids, nums, tokens, texts = (columns.request_ids, columns.num_tokens,
                                    columns.token_ids, columns.texts)
        for listener, out in items:
            chunks = listener.chunks
            sent = chunks.sent
            if chunks.head is not None:
                self._firsts.add(chunks, out)
                continue
            if out.num_tokens != sent + 1 or out.finish_reason is not None:
                columns.add(chunks, out)
                continue
            ids.append(chunks.request_id)
            nums.append(1)
            tokens.append(out.token_at(sent))
            texts.append(out.delta)
            chunks.sent = sent + 1

    def flush(self, idle: bool = True) -> None:
        """On the engine thread, after a step: send what the steps since the last send
        gathered; then their finished requests' Generate calls may end. Requests' first
        chunks go at once; the rest are held while less than `interval_s` (or the chunk
        rate's, at the most requests a step has had since) has passed since they were
        last sent, unless the engine is `idle`."""
        firsts, columns = self._firsts, self._columns
        if not (firsts.request_ids or columns.request_ids):
            return
        now = time.monotonic()
        due = idle or now - self._sent_at >= max(self.interval_s,
                                                 self._streams * self._per_stream_s)
        if firsts.request_ids:
            self._firsts = Columns()
            if not columns.request_ids:  # the new requests' next tokens wait an interval
                self._sent_at = now
            elif due:  # one message
                firsts.extend(columns)
                self._columns, self._sent_at, self._streams = Columns(), now, 0
            self._ship(firsts)
        elif due:
            self._columns, self._sent_at, self._streams = Columns(), now, 0
            self._ship(columns)

    def _ship(self, columns: Columns) -> None:
        self._send(self.subscriber, columns.message().SerializeToString())
        for chunks in columns.done:
            self._bridge.post(chunks.done.set)

    async def batches(self) -> AsyncIterator[pb.OutputBatch]:
        yield pb.OutputBatch()  # open
        await self.closed.wait()


class ColumnListener:
    """A request's listener on a `ColumnOutbox`: a step's outputs reach the outbox
    together (`sink.take`, by the engine loop); this call takes one alone (a request's
    first output, its abort, or its failure)."""

    __slots__ = ("sink", "chunks")

    def __init__(self, sink: ColumnOutbox, chunks: Chunks) -> None:
        self.sink, self.chunks = sink, chunks

    def __call__(self, out: Output) -> None:  # on the engine thread
        if isinstance(out, BaseException):
            self.sink.fail(self.chunks, out)
        else:
            self.sink.take([(self, out)])
