"""One engine driven by one thread: a node's gRPC handlers run on many threads, the engine
on this one. Every engine call goes through `call` (run between two steps); the loop
steps while requests are unfinished and hands each request's outputs to its listener.

    loop = EngineLoop(engine)
    loop.listen(request_id, on_output)        # before the request can produce outputs
    loop.call(lambda e: e.add(req))
    ...
    loop.close()

A listener runs on the loop thread and must not block. If a step raises (a bug), every
unfinished request is aborted and its listener gets the exception, so no caller waits
forever; the loop goes on with new requests.

`EngineLoop(engine, thread=False)` starts no thread: its owner calls `run()` on the
process's main thread (a node does). On the CPU, steps there run ~1.4x faster than on
another thread (SmolLM2 on 2 cores, 57 against 84 ms a token): OpenMP's thread team
of a second master thread waits on the first's.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import TypeVar

from tandem.engine.llm_engine import LLMEngine
from tandem.engine.outputs import RequestOutput

log = logging.getLogger(__name__)

T = TypeVar("T")
Listener = Callable[[RequestOutput | BaseException], None]

_IDLE_WAIT_S = 0.05  # an idle loop wakes this often to look at `closed`


class EngineLoop:
    def __init__(self, engine: LLMEngine, thread: bool = True) -> None:
        self.engine = engine
        self._calls: queue.SimpleQueue[tuple[Callable[[LLMEngine], object], Future]] = (
            queue.SimpleQueue())
        self._listeners: dict[str, Listener] = {}
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._stopped = threading.Event()  # run() has returned
        self._thread: threading.Thread | None = None
        if thread:
            self._thread = threading.Thread(target=self.run, name="engine-loop", daemon=True)
            self._thread.start()

    def submit(self, fn: Callable[[LLMEngine], T]) -> Future[T]:
        """Run `fn(engine)` on the loop thread, between two steps."""
        future: Future[T] = Future()
        if self._closed.is_set():
            future.set_exception(RuntimeError("the engine loop is closed"))
            return future
        self._calls.put((fn, future))
        return future

    def call(self, fn: Callable[[LLMEngine], T], timeout: float | None = 60.0) -> T:
        """`submit(fn)` and wait for its result (its exception is raised here)."""
        return self.submit(fn).result(timeout)

    def listen(self, request_id: str, listener: Listener) -> None:
        """Outputs of `request_id` go to `listener` until one is finished."""
        with self._lock:
            self._listeners[request_id] = listener

    def unlisten(self, request_id: str) -> None:
        with self._lock:
            self._listeners.pop(request_id, None)

    def close(self) -> None:
        """Stop the loop and wait (up to 30 s) until it has; from any thread but its own."""
        self._closed.set()
        self._stopped.wait(timeout=30)

    # -- the loop thread -------------------------------------------------------------------

    def run(self) -> None:
        """Step until `close()`; on the loop's own thread, or the owner's (thread=False)."""
        try:
            while not self._closed.is_set():
                self._run_calls(block=not self.engine.has_unfinished)
                if self.engine.has_unfinished:
                    self._step()
        finally:
            while not self._calls.empty():  # nobody will run these now
                _, future = self._calls.get_nowait()
                future.set_exception(RuntimeError("the engine loop is closed"))
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

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as exc:  # a bug: fail what is running rather than hang it
            log.exception("engine step failed; aborting every unfinished request")
            self._fail_all(exc)
            return
        for out in outputs:
            self._deliver(out.request_id, out, out.finished)

    def _fail_all(self, exc: Exception) -> None:
        with self._lock:
            ids = set(self._listeners) | set(self.engine.request_ids)
        for request_id in ids:
            try:
                self.engine.abort(request_id)
            except Exception:  # noqa: BLE001 - the engine is already in trouble
                log.exception("aborting %s failed", request_id)
            self._deliver(request_id, exc, True)

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
