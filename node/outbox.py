"""Generated tokens on their way out of a decode node.

Each request's engine outputs become `GenerateChunk`s (`Chunks`). They leave either in
the request's own Generate stream, or, for a call that names a subscriber, through that
router's one `Outputs` stream (`Outbox`): the engine thread only queues each output, and
one sender thread turns whatever has queued (about one engine step of every request) into
one message. With one stream thread per request instead, every token woke a thread that
took the GIL from the engine: at 32 streams those threads used twice the engine
thread's CPU and set the pace of the step.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator

from tandem.engine.outputs import RequestOutput
from tandem.protos import node_pb2 as pb

POLL_S = 0.1  # a waiting stream looks at its client this often


class Chunks:
    """One request's outputs as chunks: the tokens each output adds, its text, the first
    chunk's `head` fields (where the prompt was computed) and the usage counts on the
    last. `done` is set once the last chunk is made, or the request failed (`error`)."""

    def __init__(self, request_id: str, head: pb.GenerateChunk | None = None) -> None:
        self.request_id = request_id
        self.head = head
        self.sent = 0  # tokens in the chunks made so far
        self.done = threading.Event()
        self.error: BaseException | None = None

    def chunk(self, out: RequestOutput, named: bool = False) -> pb.GenerateChunk:
        chunk = pb.GenerateChunk(token_ids=out.token_ids[self.sent:], text=out.delta)
        if named:
            chunk.request_id = self.request_id
        if self.head is not None:
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


class Outbox:
    """One subscriber's Outputs stream. `listener(chunks)` is an engine listener that
    queues the request's outputs here; `batches` makes and yields them, in order, as
    `OutputBatch`es until the stream's client goes away or `close()`."""

    def __init__(self, subscriber: str) -> None:
        self.subscriber = subscriber
        self._queue: queue.SimpleQueue[tuple[Chunks, RequestOutput] | None] = (
            queue.SimpleQueue())
        self.closed = threading.Event()

    def listener(self, chunks: Chunks) -> Callable[[RequestOutput | BaseException], None]:
        def on_output(out: RequestOutput | BaseException) -> None:  # on the engine thread
            if isinstance(out, BaseException):
                chunks.fail(out)  # its Generate call reports it
            elif not self.closed.is_set():
                self._queue.put((chunks, out))
        return on_output

    def close(self) -> None:
        self.closed.set()
        self._queue.put(None)  # wakes the sender

    def batches(self, is_active: Callable[[], bool]) -> Iterator[pb.OutputBatch]:
        yield pb.OutputBatch()  # open
        while not self.closed.is_set():
            try:
                item = self._queue.get(timeout=POLL_S)
            except queue.Empty:
                if not is_active():
                    return
                continue
            batch = pb.OutputBatch()
            while item is not None:
                chunks, out = item
                batch.chunks.append(chunks.chunk(out, named=True))
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
            if batch.chunks:
                yield batch
