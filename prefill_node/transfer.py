"""One KV push on its own thread (the prefill role's; see `role.py`'s docstring).

The engine thread hands it each computed layer (`layer_done`, never waiting) and, once
the prompt's step sampled it, the first token (`sampled`). The thread waits for the
push's target (the sink and the first prompt block it takes: known at the start, or,
after an early start, once the decode node's sink is attached), opens the push, sends
the layers as they come and ends it with the first token. Its end, an error or None,
goes to `on_end` once every read of the prompt's blocks is done.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

import torch

from tandem.engine import trace
from tandem.engine.llm_engine import bind_thread
from tandem.kvtransfer.agent import SinkInfo
from tandem.kvtransfer.connector import TransferError
from tandem.kvtransfer.sender import KVPush

log = logging.getLogger(__name__)

# Where a push goes: the sink, and the first prompt block it receives.
Target = tuple[SinkInfo, int]

# What the engine thread hands the transfer thread: a computed layer (with, on CUDA, the
# event recorded after its compute), or the error it should give up with.
_Item = tuple[int, torch.cuda.Event | None] | BaseException


class Transfer:
    """One KV push, fed layer by layer from the engine thread; or, with `whole` (the
    number of layers), once, when the last layer is computed."""

    def __init__(self, target: Future[Target], open_push: Callable[[Target], KVPush],
                 device: torch.device, deadline: Callable[[], float],
                 on_end: Callable[[BaseException | None], None], whole: int = 0,
                 staging: threading.Semaphore | None = None) -> None:
        """`deadline()`: the time.monotonic() the push gives up at (it moves once a late
        target comes); `staging`: a slot of it is held from the push's open to its end."""
        self._target, self._open_push = target, open_push
        self._device, self._staging = device, staging
        self._first_token: Future[int] = Future()  # the end frame carries it
        self._deadline, self._on_end = deadline, on_end
        self._last = whole - 1  # whole: the one layer handed over (-1: every layer)
        self._items: queue.SimpleQueue[_Item] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="kv-push", daemon=True)
        self._start_lock = threading.Lock()
        self.started = 0.0  # time.monotonic(), set by the hook

    def start(self) -> None:
        """The thread starts with the first layer handed over (or a cancellation): by
        then the step's compute is launched, so neither its start nor its opening of
        the push holds the GIL while the engine thread launches kernels."""
        with self._start_lock:
            if self._thread.ident is None:
                self._thread.start()

    def layer_done(self, layer: int) -> None:
        """Engine thread, as layer `layer`'s KV is written (on CUDA: enqueued): hand it
        over. Never waits."""
        if layer < self._last:
            return
        self.start()
        event = None
        if self._device.type == "cuda":
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self._device))
        self._items.put((layer, event))

    def sampled(self, token: int) -> None:
        """The engine thread, once the prompt's step sampled `token`."""
        with contextlib.suppress(InvalidStateError):  # cancelled meanwhile
            self._first_token.set_result(token)

    def cancel(self, error: BaseException) -> None:
        """Any thread: give up with `error` at the next thing the push waits for (its
        target, a layer, the first token)."""
        self._items.put(error)
        self.start()  # so that it ends, with the error
        for future in (self._first_token, self._target):
            with contextlib.suppress(InvalidStateError):
                future.set_exception(error)

    def join(self, timeout: float) -> None:
        if self._thread.ident is not None:
            self._thread.join(timeout)

    # -- on the transfer thread --------------------------------------------------------------

    def _left(self) -> float:
        return max(0.0, self._deadline() - time.monotonic())

    def _run(self) -> None:
        bind_thread(self._device)
        stream = torch.cuda.Stream(self._device) if self._device.type == "cuda" else None
        error: BaseException | None = None
        try:
            with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                try:
                    target = self._result(self._target, "sink did not come within its hold")
                    self._push(target)
                finally:
                    if stream is not None:  # the gathers have read the blocks
                        stream.synchronize()
        except BaseException as exc:  # noqa: BLE001 - handed to the role
            error = exc
        self._on_end(error)

    def _result(self, future: Future[Any], missing: str) -> Any:
        """`future`'s result by the deadline; TransferError("the prompt's `missing`")."""
        try:
            return future.result(self._left())
        except FutureTimeout:
            raise TransferError(f"the prompt's {missing}") from None

    def _push(self, target: Target) -> None:
        if self._staging is None:
            self._push_now(target)
            return
        if not self._staging.acquire(timeout=self._left()):
            raise TransferError("no staging slot came free before the sink expired")
        try:
            self._push_now(target)
        finally:
            self._staging.release()

    def _push_now(self, target: Target) -> None:
        with self._open_push(target) as push:  # an error leaving the block aborts the push
            rid = push.sink.request_id
            push.start()
            trace.mark(rid, "push.started")
            if self._last >= 0:  # whole: that layer's compute comes after every other's
                self._next_layer()
                for layer in range(push.layout.num_layers):
                    push.send_layer(layer)
            else:
                for _ in range(push.layout.num_layers):
                    push.send_layer(self._next_layer())
            trace.mark(rid, "push.layers_sent")
            push.finish(self._result(self._first_token, "first token was not sampled "
                                                      "before the sink expired"))
            trace.mark(rid, "push.done")


    def _next_layer(self) -> int:
        """The next computed layer, its compute ordered before the work this thread
        enqueues next; raises a cancellation, or at the deadline."""
        try:
            item = self._items.get(timeout=self._left())
        except queue.Empty:
            raise TransferError("the prompt's layers were not computed before the sink "
                                "expired") from None
        if isinstance(item, BaseException):
            raise item
        layer, event = item
        if event is not None:
            torch.cuda.current_stream(self._device).wait_event(event)
        return layer


def transfer_error(error: BaseException) -> BaseException:
    """What a prefill raises for a push that ended with `error`."""
    if isinstance(error, (TransferError, ValueError)):
        return error
    log.error("KV push failed", exc_info=error)
    wrapped = TransferError(f"KV push failed: {error!r}")
    wrapped.__cause__ = error
    return wrapped
