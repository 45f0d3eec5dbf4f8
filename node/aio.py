"""From the node's other threads to its asyncio loop, which serves every gRPC call.

The engine loop's thread (outputs, block events) and the transfer agent's (a sink
ready or failed) hand work to the asyncio loop through a `Bridge`: `post(fn, *args)`
queues a call, and the first call of a batch wakes the loop once, so one engine step's
outputs for every request cost one wake-up, not one each. Calls run in the order they
were posted.

`engine_call(loop, fn)` runs `fn(engine)` on the engine loop's thread and awaits it.
`new_event_loop()` makes the node's loop.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

from tandem.engine.llm_engine import LLMEngine
from tandem.node.loop import EngineLoop

log = logging.getLogger(__name__)
T = TypeVar("T")


class Bridge:
    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._lock = threading.Lock()
        self._calls: list[tuple[Callable[..., None], tuple[Any, ...]]] = []

    def post(self, fn: Callable[..., None], *args: Any) -> None:
        """Run `fn(*args)` on the asyncio loop, soon; from any thread. Dropped once the
        loop is closed (the node is stopping)."""
        with self._lock:
            wake = not self._calls
            self._calls.append((fn, args))
        if wake and not self.loop.is_closed():
            try:
                self.loop.call_soon_threadsafe(self._run)
            except RuntimeError:  # closed just now
                pass

    def wrap(self, future: Future[T]) -> asyncio.Future[T]:
        """`future`'s outcome on the asyncio loop, brought by `post` (one wake-up for every
        future an engine round completes), unlike asyncio.wrap_future (one each). Not
        cancelled with the asyncio future: what it runs, runs."""
        waiter = self.loop.create_future()
        future.add_done_callback(lambda done: self.post(_settle, waiter, done))
        return waiter

    def _run(self) -> None:
        with self._lock:
            calls, self._calls = self._calls, []
        for fn, args in calls:
            try:
                fn(*args)
            except Exception:  # noqa: BLE001 - one caller's bug must not drop the rest
                log.exception("bridged call %s failed", fn)


def _settle(waiter: asyncio.Future, done: Future) -> None:
    if waiter.done():  # cancelled meanwhile
        return
    if done.cancelled():
        waiter.cancel()
    elif (exc := done.exception()) is not None:
        waiter.set_exception(exc)
    else:
        waiter.set_result(done.result())


def new_event_loop() -> asyncio.AbstractEventLoop:
    """uvloop's loop where it is installed (each hop of a request, a gRPC call or an
    engine output, costs less host time there), else asyncio's."""
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


async def engine_call(loop: EngineLoop, fn: Callable[[LLMEngine], T]) -> T:
    """`fn(engine)` on the engine loop's thread, between two steps; its error is raised
    here."""
    return await asyncio.wrap_future(loop.submit(fn))
