"""The decode role over one engine. A request's life here is a row of stages; each holds
the request, frees what it holds when the request ends there, and one thing moves it on:

    prealloc   waits, first come first served, until its prompt's blocks are free: the
               engine loop reserves them before each step (`_reserve_queued`)
    transfer   holds its blocks and a sink while a prefill node computes the prompt and
               pushes its KV: the agent's on_ready / on_failed end the wait (`arrival`)
    running    in the engine (its batch, or its waiting queue when computed here): its
               outputs go to its listener on the engine loop's thread

A reservation takes only free blocks and leaves one for each request the engine holds
to grow into, so a running request is never preempted to make room for a queued one.

`abort(rid)` is the one way a request ends early, in whichever stage holds it: the
prealloc queue drops it, a sink fails (which gives its blocks back to the engine), the
engine aborts it. It never blocks its caller: a sink's failure, which may wait for a
write in flight, runs on a small pool of its own.

A sink that fails (its lease, an abort, the sender gone) gives its blocks back to the
engine; a reserved request nobody generates is freed with its sink.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

from tandem.engine import trace
from tandem.engine.llm_engine import KVCacheFull, LLMEngine
from tandem.engine.request import Request
from tandem.kvtransfer.agent import SinkInfo, TransferAgent
from tandem.kvtransfer.connector import Connector, TransferError
from tandem.kvtransfer.layout import KVLayout
from tandem.node.loop import EngineLoop, Listener

_ABORT_THREADS = 2  # sinks failed at once (each may wait out an ipc write's settle time)


class Aborted(Exception):
    """The request was aborted while it waited for blocks."""


@dataclass(frozen=True)
class Reservation:
    sink: SinkInfo
    first_block: int  # the first prompt block the sink receives
    cached_tokens: int  # prompt tokens the prefix cache held
    queued_s: float  # seconds it waited in the prealloc queue
    arrival: Future[None]  # done once its KV is in; TransferError once its sink failed
    # The token the prefill node sampled, once its push's end frame brought it (after the
    # KV is in); never set by a sender that does not send it.
    first_token: Future[int]


@dataclass(eq=False)
class _Arrival:
    kv: Future[None] = field(default_factory=Future)
    first_token: Future[int] = field(default_factory=Future)


@dataclass(eq=False)
class _Queued:
    req: Request
    ttl_s: float
    reserved: Future[Reservation] = field(default_factory=Future)
    since: float = field(default_factory=time.monotonic)


class DecodeRole:
    def __init__(self, loop: EngineLoop, connector: Connector, host: str,
                 layout: KVLayout, secret: bytes | None = None, port: int = 0,
                 advertise_host: str | None = None) -> None:
        """`secret`: the cluster secret a sender's begin must prove (kvtransfer/auth.py);
        the transfer agent listens on `host`:`port`, known as `advertise_host`."""
        self.loop, self.layout = loop, layout
        self.connector = connector
        self.agent = TransferAgent(loop.engine.runner.kv_caches, layout, connector,
                                   self._sink_freed, host, on_ready=self._arrived,
                                   on_end=self._ended, on_failed=self._lost, secret=secret,
                                   port=port, advertise_host=advertise_host)
        # The loop thread's: the prealloc queue, and its entries by request.
        self._prealloc: deque[_Queued] = deque()
        self._queued: dict[str, _Queued] = {}
        # Touched on the loop thread (reserve) and the agent's (arrival, freed): each
        # dict operation is atomic under the GIL, and an entry is set before its sink
        # opens.
        self._sinks: dict[int, str] = {}  # a sink's first block id -> its request
        self._arrivals: dict[str, _Arrival] = {}
        # Requests whose sink `drop_sink` is failing (a thread's), and those of them an
        # abort came for meanwhile: their blocks go back once the drop is done.
        self._drop_lock = threading.Lock()
        self._dropping: set[str] = set()
        self._ended_dropping: set[str] = set()
        self._aborts = ThreadPoolExecutor(_ABORT_THREADS, thread_name_prefix="sink-abort")
        self.kv_bytes_received = 0
        self.transfers_failed = 0
        loop.add_stage(self._reserve_queued)

    @property
    def address(self) -> str:
        return self.agent.address

    @property
    def num_queued(self) -> int:
        """Requests in the prealloc queue (read on any thread: one len())."""
        return len(self._prealloc)

    # -- prealloc --------------------------------------------------------------------------

    def reserve(self, req: Request, ttl_s: float) -> Future[Reservation]:
        """Hold `req`'s prompt blocks now and open a sink for those its prefix cache
        lacks; KVCacheFull (a RuntimeError) when they are not free, ValueError for a bad
        request."""
        def now(engine: LLMEngine) -> Reservation:
            made = self._open_sinks(engine, [(req, ttl_s, self._hold(engine, req, 0), 0.0)])[0]
            if isinstance(made, BaseException):
                raise made
            return made

        return self.loop.submit(now)

    def enqueue(self, req: Request, ttl_s: float) -> Future[Reservation]:
        """`reserve`, once its turn comes and the blocks are free. To leave the queue,
        `abort` it (cancelling the future alone also drops it)."""
        queued = _Queued(req, ttl_s)

        def join(engine: LLMEngine) -> None:
            if req.request_id in self._queued or req.request_id in engine.request_ids:
                raise ValueError(f"request id {req.request_id!r} is already in use")
            self._prealloc.append(queued)
            self._queued[req.request_id] = queued
            trace.mark(req.request_id, "decode.queued")

        joined = self.loop.submit(join)
        joined.add_done_callback(lambda f: _pass_error(f, queued.reserved))
        return queued.reserved

    def _reserve_queued(self, engine: LLMEngine) -> None:
        """A loop stage: reserve from the head of the queue while blocks are free, less
        one for each request the engine holds (running, ready to join the batch, or
        waiting for its KV) to take its next token into: reservations that took those
        would leave the batch unable to grow (a 256-token prompt needs a new block for
        its first decoded token). The sinks of those reserved are opened together."""
        s = engine.scheduler
        keep_free = len(s.running) + len(s.ready) + engine.num_reserved
        held: list[tuple[_Queued, int, float]] = []  # blocks held, sinks yet to open
        while self._prealloc:
            queued = self._prealloc[0]
            if not queued.reserved.cancelled():
                try:
                    cached = self._hold(engine, queued.req, keep_free)
                except KVCacheFull:
                    break  # first come, first served: the rest wait behind it
                except BaseException as exc:  # noqa: BLE001 - its caller's to handle
                    _settle(queued.reserved, error=exc)
                else:
                    held.append((queued, cached, time.monotonic() - queued.since))
            self._prealloc.popleft()
            self._queued.pop(queued.req.request_id, None)
        if not held:
            return
        made = self._open_sinks(engine, [(q.req, q.ttl_s, cached, queued_s)
                                         for q, cached, queued_s in held])
        for (queued, _, _), result in zip(held, made, strict=True):
            if isinstance(result, BaseException):
                _settle(queued.reserved, error=result)
            elif not _settle(queued.reserved, result):  # cancelled just now
                self._end_sink(queued.req.request_id, "left the queue")

    def _hold(self, engine: LLMEngine, req: Request, keep_free: int) -> int:
        """Hold `req`'s prompt blocks in the engine (KVCacheFull if they are not free);
        the prompt tokens its prefix cache held."""
        cached = engine.reserve(req, keep_free)
        trace.mark(req.request_id, "decode.blocks")
        return cached

    def _open_sinks(self, engine: LLMEngine, held: list[tuple[Request, float, int, float]]
                    ) -> list[Reservation | BaseException]:
        """A sink for each (request, ttl, cached tokens, seconds queued) whose blocks are
        held (`_hold`), opened together; one that fails gives its blocks back."""
        wanted, arrivals = [], []
        for req, ttl_s, cached, _ in held:
            ids = tuple(req.block_ids[cached // self.layout.block_size:])
            arrivals.append(_Arrival())
            self._sinks[ids[0]] = req.request_id
            self._arrivals[req.request_id] = arrivals[-1]
            wanted.append((req.request_id, ids, ttl_s))
        try:
            sinks = self.agent.reserve_many(wanted)
        except BaseException as exc:  # noqa: BLE001 - each request's to handle
            sinks = [exc] * len(wanted)
        made: list[Reservation | BaseException] = []
        for (_, _, cached, queued_s), (rid, ids, _), arrival, sink in zip(
                held, wanted, arrivals, sinks, strict=True):
            if isinstance(sink, BaseException):
                self._sinks.pop(ids[0], None)
                self._arrivals.pop(rid, None)
                engine.release_reserved(rid)
                made.append(sink)
                continue
            trace.mark(rid, "decode.sink")
            made.append(Reservation(sink, cached // self.layout.block_size, cached, queued_s,
                                    arrival.kv, arrival.first_token))
        return made

    # -- transfer --------------------------------------------------------------------------

    def arrival(self, request_id: str) -> Future[None]:
        """The reserved request's KV: done once it is in, TransferError once its sink
        failed; ValueError if it holds no reservation here."""
        arrival = self._arrivals.get(request_id)
        if arrival is None or not self.agent.holds(request_id):
            raise ValueError(f"request {request_id!r} has no reservation here to decode from")
        return arrival.kv

    def _arrived(self, request_id: str) -> None:  # the agent's on_ready
        arrival = self._arrivals.get(request_id)
        if arrival is not None:
            _settle(arrival.kv, None)

    def _ended(self, request_id: str, first_token: int) -> None:  # the agent's on_end
        arrival = self._arrivals.get(request_id)
        if arrival is not None:
            _settle(arrival.first_token, first_token)

    def _lost(self, request_id: str, reason: str) -> None:  # the agent's on_failed
        arrival = self._arrivals.pop(request_id, None)
        if arrival is not None:
            error = TransferError(f"the KV of {request_id!r} did not arrive: {reason}")
            _settle(arrival.kv, error=error)
            _settle(arrival.first_token, error=error)

    # -- running ---------------------------------------------------------------------------

    def start(self, request_id: str, first_token: int, listener: Listener) -> Future[None]:
        """The KV is in and `first_token` was sampled from it: decode in the running
        batch; its first output reaches `listener` on the loop thread, before the next
        step's. TransferError if the sink is not ready."""
        self._forget(self.agent.release(request_id))
        self._arrivals.pop(request_id, None)
        return self.loop.start(request_id, listener,
                               lambda e: e.start_decode(request_id, first_token))

    def adopt(self, request_id: str) -> Future[None]:
        """The reserved request's KV is in (a prefix pull's): keep its blocks in the
        prefix cache, and let the reservation go."""
        self._forget(self.agent.release(request_id))
        self._arrivals.pop(request_id, None)
        return self.loop.submit(lambda e: e.adopt_reserved(request_id))

    def drop_sink(self, request_id: str) -> None:
        """Fail the request's sink but keep its blocks reserved in the engine, to compute
        the prompt here (`compute_here`). Blocks while a write into them finishes; an
        abort that comes meanwhile (its call ended) gives the blocks back after it."""
        with self._drop_lock:
            self._dropping.add(request_id)
        self._forget_request(request_id)  # so the sink's end does not free the blocks
        self._arrivals.pop(request_id, None)
        if self.agent.holds(request_id):
            self.agent.abort(request_id, "prefilled on the decode node instead")
        with self._drop_lock:  # no write goes into the blocks now
            self._dropping.discard(request_id)
            ended = request_id in self._ended_dropping
            self._ended_dropping.discard(request_id)
        if ended:  # its call ended while the sink was failing: nobody computes it here
            self.loop.submit(lambda e: e.release_reserved(request_id))

    def compute_here(self, req: Request, listener: Listener) -> Future[None]:
        """Prefill `req` on this node, in its reserved blocks if it has them (after
        `drop_sink`), then decode it. ValueError for a bad request."""
        rid = req.request_id

        def begin(engine: LLMEngine) -> None:
            if not engine.start_prefill(rid):
                engine.add(req)

        return self.loop.start(rid, listener, begin)

    # -- ending ----------------------------------------------------------------------------

    def abort(self, request_id: str, reason: str) -> Future[bool]:
        """End `request_id` in whichever stage holds it; whether one did. Never blocks."""
        def end(engine: LLMEngine) -> bool:
            with self._drop_lock:
                if request_id in self._dropping:  # the drop gives its blocks back
                    self._ended_dropping.add(request_id)
                    return True
            queued = self._queued.pop(request_id, None)
            if queued is not None:
                self._prealloc.remove(queued)
                _settle(queued.reserved, error=Aborted(reason))
                return True
            if self.agent.holds(request_id):  # its sink gives the blocks back
                self._end_sink(request_id, reason)
                return True
            return self.loop.end(request_id)

        return self.loop.submit(end)

    def _end_sink(self, request_id: str, reason: str) -> None:
        self._aborts.submit(self.agent.abort, request_id, reason)

    def close(self) -> None:
        self._aborts.shutdown(wait=True)
        self.agent.close()

    def _bytes(self, num_blocks: int) -> int:
        return num_blocks * self.layout.block_bytes * self.layout.num_layers

    def _forget(self, block_ids: Sequence[int]) -> None:
        """A released sink: its blocks belong to the running request now."""
        self._sinks.pop(block_ids[0], None)
        self.kv_bytes_received += self._bytes(len(block_ids))

    def _forget_request(self, request_id: str) -> None:
        for first, rid in list(self._sinks.items()):
            if rid == request_id:
                self._sinks.pop(first, None)

    def _sink_freed(self, block_ids: list[int]) -> None:
        """The agent is done with a failed sink: give its request's blocks back, unless
        the request went on without it (prefilled here)."""
        rid = self._sinks.pop(block_ids[0], None)
        if rid is None:
            return
        self.transfers_failed += 1
        self.loop.submit(lambda e: e.release_reserved(rid))


def _settle(future: Future, result: object = None, error: BaseException | None = None) -> bool:
    """Set `future`'s outcome unless it was cancelled or settled; whether it was set."""
    try:
        if future.done() or not (future.running() or future.set_running_or_notify_cancel()):
            return False
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)
        return True
    except Exception:  # noqa: BLE001 - settled meanwhile on another thread
        return False


def _pass_error(source: Future, target: Future) -> None:
    """`source` failed (the loop is closed, the id is in use): so does `target`."""
    error = source.exception()
    if error is not None:
        _settle(target, error=error)
