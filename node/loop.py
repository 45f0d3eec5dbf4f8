"""One engine driven by one thread: a node's gRPC handlers run on its asyncio loop, the
engine on this one. Every engine call goes through `call` (run between two steps); the loop
steps while requests are unfinished and hands each request's outputs to its listener.

    loop = EngineLoop(engine)
    loop.listen(request_id, on_output)        # before the request can produce outputs
    loop.call(lambda e: e.add(req))
    ...
    loop.close()

A listener runs on the loop thread and must not block. A listener that carries a `sink`
(a `StepSink`: many requests' outputs gathered into one message) gets a step's outputs
with every other listener of that sink's, in one `sink.take(items)` call: a step has an
output per running request, and at this rate a call per output is a step's host time.
`add_stage(fn)` has the loop run `fn(engine)` after each round of calls and before each
step: a role's queue that waits for the engine's blocks moves there (the decode role's
prealloc queue). `add_flush(fn)`
has it run `fn(idle)` once the outputs of a step (or of a round of calls) are delivered:
listeners that gather a step's outputs send them there, in one message.

If a step raises (a bug), every unfinished request is aborted and its listener gets the
exception, so no caller waits forever; the loop goes on with new requests. `liveness()`
says whether the loop is healthy (its last step did not fail, and it is not stuck), for
the node's Health.

`EngineLoop(engine, thread=False)` starts no thread: its owner calls `run()` on the
process's main thread (a node does). On the CPU, steps there run ~1.4x faster than on
another thread (SmolLM2 on 2 cores, 57 against 84 ms a token): OpenMP's thread team
of a second master thread waits on the first's.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Protocol, TypeVar

from tandem.engine import trace
from tandem.engine.llm_engine import LLMEngine, bind_thread
from tandem.engine.outputs import RequestOutput

log = logging.getLogger(__name__)

T = TypeVar("T")
Listener = Callable[[RequestOutput | BaseException], None]


class StepSink(Protocol):
    def take(self, items: list[tuple[Listener, RequestOutput]]) -> None:
        """A step's outputs of the requests whose listeners carry this sink, in the
        step's order, with those listeners; on the loop thread."""


_IDLE_WAIT_S = 0.05  # an idle loop wakes this often to look at `closed`


class LoopClosed(RuntimeError):
    """The engine loop is closed (the node is stopping): nothing more runs on it."""


@dataclass(frozen=True)
class Liveness:
    alive: bool
    seconds_since_step: float  # since a step last ended, or the loop last found no work
    failed_steps: int  # since start
    error: str  # the last failed step's, while the loop is not alive


class EngineLoop:
    def __init__(self, engine: LLMEngine, thread: bool = True) -> None:
        self.engine = engine
        self._calls: queue.SimpleQueue[tuple[Callable[[LLMEngine], object], Future]] = (
            queue.SimpleQueue())
        self._listeners: dict[str, Listener] = {}
        self._stages: list[Callable[[LLMEngine], None]] = []
        self._flushes: list[Callable[[bool], None]] = []
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._stopped = threading.Event()  # run() has returned
        # Written by the loop thread only; read by Health on any thread.
        self._progress_at = time.monotonic()
        self._failed_steps = 0
        self._last_error: str | None = None  # cleared by a step that succeeds
        self._failed_at = float("-inf")
        self._thread: threading.Thread | None = None
        if thread:
            self._thread = threading.Thread(target=self.run, name="engine-loop", daemon=True)
            self._thread.start()

    def submit(self, fn: Callable[[LLMEngine], T]) -> Future[T]:
        """Run `fn(engine)` on the loop thread, between two steps."""
        future: Future[T] = Future()
        if self._closed.is_set():
            future.set_exception(LoopClosed("the engine loop is closed"))
            return future
        self._calls.put((fn, future))
        return future

    def call(self, fn: Callable[[LLMEngine], T], timeout: float | None = 60.0) -> T:
        """`submit(fn)` and wait for its result (its exception is raised here)."""
        return self.submit(fn).result(timeout)

    def add_stage(self, fn: Callable[[LLMEngine], None]) -> None:
        """Run `fn(engine)` on the loop thread before every step (and on every idle
        wake-up); it must not block, and what it raises is logged."""
        self._stages.append(fn)

    def add_flush(self, fn: Callable[[bool], None]) -> None:
        """Run `fn(idle)` on the loop thread after every step and every round of calls;
        `idle`: the engine has nothing left to step, so what `fn` holds must go now. It
        must not block, and what it raises is logged."""
        self._flushes.append(fn)

    def listen(self, request_id: str, listener: Listener) -> None:
        """Outputs of `request_id` go to `listener` until one is finished."""
        with self._lock:
            self._listeners[request_id] = listener

    def start(self, request_id: str, listener: Listener,
              fn: Callable[[LLMEngine], RequestOutput | None]) -> Future[None]:
        """On the loop thread: `listen(request_id, listener)`, run `fn`, and hand the
        output it makes (if any) to the listener there, as a step's: ahead of the next
        step's. If `fn` raises, the listener is dropped and the future has the error."""
        def start(engine: LLMEngine) -> None:
            self.listen(request_id, listener)
            try:
                out = fn(engine)
            except BaseException:
                self.unlisten(request_id)
                raise
            if out is not None:
                self._deliver(request_id, out, out.finished)

        return self.submit(start)

    def unlisten(self, request_id: str) -> None:
        with self._lock:
            self._listeners.pop(request_id, None)

    def abort(self, request_id: str) -> Future[bool]:
        """Stop `request_id` in the engine (`end`, on the loop thread)."""
        return self.submit(lambda engine: self.end(request_id))

    def end(self, request_id: str) -> bool:
        """On the loop thread: stop `request_id` in the engine; its listener gets the
        finished ("abort") output, as from a step. Whether the engine had it."""
        out = self.engine.abort(request_id)
        if out is not None:
            self._deliver(request_id, out, True)
        return out is not None

    def liveness(self, stall_s: float) -> Liveness:
        """Alive unless the last step failed less than `stall_s` ago (after that the node
        gets another chance), or work is queued and no step has ended for `stall_s` (a
        step stuck on a bug, or a loop thread that died)."""
        since = time.monotonic() - self._progress_at
        stuck = since > stall_s and (self.engine.has_unfinished or not self._calls.empty())
        failed = self._last_error if time.monotonic() - self._failed_at < stall_s else None
        error = failed or (f"no step has ended for {since:.0f}s" if stuck else "")
        return Liveness(not error and not self._stopped.is_set(), since, self._failed_steps,
                        error)

    def close(self) -> None:
        """Stop the loop and wait (up to 30 s) until it has; from any thread but its own."""
        self._closed.set()
        self._stopped.wait(timeout=30)

    # -- the loop thread -------------------------------------------------------------------

    def run(self) -> None:
        """Step until `close()`; on the loop's own thread, or the owner's (thread=False)."""
        bind_thread(self.engine.device)
        try:
            while not self._closed.is_set():
                self._run_calls(block=not self.engine.has_unfinished)
                self._run_flushes()  # what the calls made goes ahead of the step's
                self._run_stages()
                if self.engine.has_unfinished:
                    self._step()
                else:
                    self._progress_at = time.monotonic()
                self._run_flushes()
        finally:
            while not self._calls.empty():  # nobody will run these now
                _, future = self._calls.get_nowait()
                future.set_exception(LoopClosed("the engine loop is closed"))
            self._stopped.set()

    def _run_calls(self, block: bool) -> None:
        try:
            fn, future = self._calls.get(block, timeout=_IDLE_WAIT_S)
        except queue.Empty:
            return
        while True:
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(self.engine))
                except BaseException as exc:  # noqa: BLE001 - handed to the caller
                    future.set_exception(exc)
            try:
                fn, future = self._calls.get_nowait()
            except queue.Empty:
                return

    def _run_stages(self) -> None:
        for stage in self._stages:
            try:
                stage(self.engine)
            except Exception:  # noqa: BLE001 - a stage's bug must not stop the loop
                log.exception("engine loop stage %s failed", stage)

    def _run_flushes(self) -> None:
        idle = not self.engine.has_unfinished
        for flush in self._flushes:
            try:
                flush(idle)
            except Exception:  # noqa: BLE001 - as a stage's
                log.exception("engine loop flush %s failed", flush)

    def _step(self) -> None:
        trace.mark("step", "step.begin")
        try:
            outputs = self.engine.step()
        except Exception as exc:  # a bug: fail what is running rather than hang it
            log.exception("engine step failed; aborting every unfinished request")
            self._failed_steps += 1
            self._last_error = f"{type(exc).__name__}: {exc}"
            self._progress_at = self._failed_at = time.monotonic()
            self._fail_all(exc)
            return
        self._progress_at, self._last_error = time.monotonic(), None
        trace.mark("step", "step.end", len(outputs))
        self._deliver_step(outputs)

    def _fail_all(self, exc: Exception) -> None:
        with self._lock:
            ids = set(self._listeners) | set(self.engine.request_ids)
        for request_id in ids:
            try:
                self.engine.abort(request_id)
            except Exception:  # noqa: BLE001 - the engine is already in trouble
                log.exception("aborting %s failed", request_id)
            self._deliver(request_id, exc, True)

    def _deliver_step(self, outputs: list[RequestOutput]) -> None:
        """A step's outputs to their listeners: the listeners taken under one hold of the
        lock, and those that carry a sink handed over together, one call per sink."""
        with self._lock:
            get, pop = self._listeners.get, self._listeners.pop
            listeners = [pop(out.request_id, None) if out.finish_reason is not None
                         else get(out.request_id) for out in outputs]
        sinks: dict[StepSink, list[tuple[Listener, RequestOutput]]] = {}
        for out, listener in zip(outputs, listeners):
            if listener is None:
                continue
            sink = getattr(listener, "sink", None)
            if sink is not None:
                items = sinks.get(sink)
                if items is None:
                    items = sinks[sink] = []
                items.append((listener, out))
                continue
            try:
                listener(out)
            except Exception:  # noqa: BLE001 - one listener must not stop the loop
                log.exception("listener of %s failed", out.request_id)
        for sink, items in sinks.items():
            try:
                sink.take(items)
            except Exception:  # noqa: BLE001 - as a listener's
                log.exception("step sink %s failed", sink)

    def _deliver(self, request_id: str, item: RequestOutput | BaseException, last: bool) -> None:
        with self._lock:
            listener = self._listeners.pop(request_id, None) if last else (
                self._listeners.get(request_id))
        if listener is None:
            return
        try:
            listener(item)
        except Exception:  # noqa: BLE001 - one listener must not stop the loop
            log.exception("listener of %s failed", request_id)
