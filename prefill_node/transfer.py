"""One KV push on a thread of its own while it runs (the prefill role's; see `role.py`'s
docstring), taken from the role's `PushThreads`.

The engine thread hands it each computed layer (`layer_done`, never waiting) and, once
the prompt's step sampled it, the first token (`sampled`). The thread waits for the
push's target (the sink and the first prompt block it takes: known at the start, or,
after an early start, once the decode node's sink is attached), opens the push, sends
the layers as they come and ends it with the first token. Its end, an error or None,
goes to `on_end` once every read of the prompt's blocks is done.

The pushes of whole prompts (ipc: one write once the last layer is computed) that one step
completes run on one thread per receiver (`Gang`): it opens each, writes them all in one
copy (`sender.write_together`: their block ids moved to the device at once, one kernel
for every sink's blocks), then, their first tokens sampled, tells the receiver of them all
in one `written` message and waits for its replies (`sender.send_written`). One thread
does the host work that a thread each did at more CPU a push, every thread contending for
the GIL with the engine's, and one frame out and one back do what three out and two back
per push did
(`benchmarks/push_cpu.py`: 256 pushes, 16 a step, on an H200's host, 0.28 ms of CPU a push
with one copy a step, 0.97 with a copy and an ids move a push, ~2 with a thread each).
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
from tandem.kvtransfer.sender import KVPush, send_written, write_together

log = logging.getLogger(__name__)

# Where a push goes: the sink, and the first prompt block it receives.
Target = tuple[SinkInfo, int]

# What the engine thread hands the transfer thread: a computed layer (with, on CUDA, the
# event recorded after its compute), or the error it should give up with.
_Item = tuple[int, torch.cuda.Event | None] | BaseException


class PushThreads:
    """The threads a prefill role's pushes run on, one push a thread at a time. A push
    goes to an idle thread; when none is idle a new one comes up, started by a thread
    kept for that, so whoever hands a push over never waits for a thread to start
    (`Thread.start` returns only once the new thread runs: in a step that completed 16
    prompts, with the GIL busy, the engine thread's 16 starts took half of its 30 ms, on
    an H200). A push that waits on a slow receiver holds only its own thread. A thread
    left idle for `idle_s` ends (a burst's many do not stay)."""

    def __init__(self, idle_s: float = 30.0) -> None:
        self._idle_s = idle_s
        self._work: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._grow: queue.SimpleQueue[bool] = queue.SimpleQueue()  # True: one more
        self._lock = threading.Lock()
        # Under _lock: threads with no push (or coming up for one), pushes not yet
        # taken, threads started or asked for.
        self._idle = self._waiting = self._threads = 0
        self._starter = threading.Thread(target=self._start_threads, name="kv-push-starter",
                                         daemon=True)
        self._starter.start()

    def submit(self, run: Callable[[], None]) -> None:
        """Run `run` on a thread of its own. Never waits."""
        with self._lock:
            self._waiting += 1
            grow = self._waiting > self._idle
            if grow:  # the new thread takes this push, or the next one handed over
                self._idle += 1
                self._threads += 1
        self._work.put(run)
        if grow:
            self._grow.put(True)

    def close(self) -> None:
        """Every thread ends once its push has (those not yet taken run first)."""
        self._grow.put(False)
        with self._lock:
            threads = self._threads
        for _ in range(threads):
            self._work.put(None)

    def _start_threads(self) -> None:
        while self._grow.get():
            threading.Thread(target=self._serve, name="kv-push", daemon=True).start()

    def _serve(self) -> None:
        while (run := self._take()) is not None:
            with self._lock:
                self._waiting -= 1
                self._idle -= 1
            try:
                run()
            finally:
                with self._lock:
                    self._idle += 1

    def _take(self) -> Callable[[], None] | None:
        """The next push; None to end (closed, or idle for `idle_s` while the others
        idle are enough for the pushes handed over)."""
        while True:
            try:
                return self._work.get(timeout=self._idle_s)
            except queue.Empty:
                with self._lock:
                    if self._waiting < self._idle:
                        self._idle -= 1
                        self._threads -= 1
                        return None


_streams = threading.local()  # a push thread's CUDA stream, by device: made once


def _stream(device: torch.device) -> torch.cuda.Stream | None:
    """This thread's stream on `device` (None on the CPU). A push thread runs one push
    (or gang) at a time and synchronizes the stream before it ends, so each starts on an
    idle stream."""
    if device.type != "cuda":
        return None
    streams = _streams.__dict__.setdefault("by_device", {})
    if device not in streams:
        streams[device] = torch.cuda.Stream(device)
    return streams[device]


class Gang:
    """The whole pushes one step hands over, run on one of `threads` per receiver in
    two passes: each is opened, then all are written in one copy (`write_together`), then,
    with their first tokens, the receiver is told of them all in one message and each
    waits for its reply (`send_written`). The engine thread
    queues them (`add`) as it hands their last layer over and lets them go once it has
    handed over every one (`flush`, the engine's `prefill_handed`). One whose target is
    not known yet (an early start waiting for its sink) runs on a thread of its own, as
    a layer-wise push does. A receiver that does not answer holds up only the pushes to
    it, which share its connections anyway."""

    def __init__(self, threads: PushThreads, num_layers: int) -> None:
        self._threads, self._last = threads, num_layers - 1
        self._lock = threading.Lock()
        self._queued: list[Transfer] = []  # under _lock

    def add(self, transfer: Transfer, now: bool) -> None:
        """Queue `transfer`; with `now` (not the engine thread handing a step's layers
        over: a cancellation), let every queued push go. Never waits."""
        with self._lock:
            self._queued.append(transfer)
        if now:
            self.flush()

    def flush(self, layer: int | None = None) -> None:
        """The pushes queued go (with `layer`, only once it is the last). Never waits."""
        if layer is not None and layer != self._last:
            return
        with self._lock:
            gang, self._queued = self._queued, []
        if gang:
            self._threads.submit(lambda: self._run(gang))

    def _run(self, gang: list[Transfer]) -> None:
        by_receiver: dict[str, list[Transfer]] = {}
        for transfer in gang:
            target = transfer._target
            if not target.done():
                self._threads.submit(transfer._run)
                continue
            address = "" if target.exception() is not None else target.result()[0].address
            by_receiver.setdefault(address, []).append(transfer)
        here, *others = by_receiver.values() or [[]]
        for pushes in others:
            self._threads.submit(lambda pushes=pushes: self._push(pushes))
        if here:
            self._push(here)

    def _push(self, ready: list[Transfer]) -> None:
        """Run `ready` (their targets known, one receiver's) through the passes."""
        device = ready[0]._device
        bind_thread(device)
        stream = _stream(device)
        errors: dict[Transfer, BaseException] = {}
        opened: list[tuple[Transfer, KVPush]] = []
        try:
            with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                try:
                    events = []
                    for transfer in ready:
                        try:
                            target = transfer._result(transfer._target, "sink did not come "
                                                      "within its hold")
                            push, event = transfer._opened_whole(target)
                            opened.append((transfer, push))
                            events += [event] if event is not None else []
                        except BaseException as exc:  # noqa: BLE001 - that push's end
                            errors[transfer] = exc
                    written = []  # in one copy per receiver's cache, after the compute
                    ends = write_together([push for _, push in opened], events)
                    for (transfer, push), error in zip(opened, ends, strict=True):
                        if error is None:
                            trace.mark(push.sink.request_id, "push.started")
                            written.append((transfer, push))
                        else:
                            errors[transfer] = error
                    told, tokens = [], []
                    for transfer, push in written:  # the first tokens come from one step
                        try:
                            tokens.append(transfer._result(
                                transfer._first_token,
                                "first token was not sampled before the sink expired"))
                            told.append((transfer, push))
                        except BaseException as exc:  # noqa: BLE001 - as above
                            push.abort(f"{type(exc).__name__}: {exc}")
                            errors[transfer] = exc
                    if told:  # one message for them all; the replies come together
                        ends = send_written([push for _, push in told], tokens)
                        for (transfer, push), error in zip(told, ends, strict=True):
                            if error is None:
                                trace.mark(push.sink.request_id, "push.done")
                            else:
                                errors[transfer] = error
                finally:
                    for _, push in opened:
                        push.close()
                    if stream is not None:  # the writes have read the blocks
                        stream.synchronize()
        except BaseException as exc:  # noqa: BLE001 - the stream failed: every push did
            errors.update((t, errors.get(t, exc)) for t in ready)
        for transfer in ready:
            transfer._end(errors.get(transfer))


class Transfer:
    """One KV push, fed layer by layer from the engine thread; or, with `whole` (the
    number of layers), once, when the last layer is computed."""

    def __init__(self, threads: PushThreads, target: Future[Target],
                 open_push: Callable[[Target], KVPush], device: torch.device,
                 deadline: Callable[[], float],
                 on_end: Callable[[BaseException | None], None], whole: int = 0,
                 staging: threading.Semaphore | None = None,
                 gang: Gang | None = None) -> None:
        """`threads`: where the push runs; `deadline()`: the time.monotonic() the push
        gives up at (it moves once a late target comes); `staging`: a slot of it is held
        from the push's open to its end; `gang` (with `whole`, no `staging`): the push
        runs with those handed over with it."""
        if gang is not None and (not whole or staging is not None):
            raise ValueError("a gang runs whole pushes that take no staging slot")
        self._gang = gang
        self._threads, self._target, self._open_push = threads, target, open_push
        self._device, self._staging = device, staging
        self._first_token: Future[int] = Future()  # the end frame carries it
        self._deadline, self._on_end = deadline, on_end
        self._last = whole - 1  # whole: the one layer handed over (-1: every layer)
        self._items: queue.SimpleQueue[_Item] = queue.SimpleQueue()
        self._start_lock = threading.Lock()
        self._submitted = False  # under _start_lock
        self._ended = threading.Event()  # set once on_end returned
        self.started = 0.0  # time.monotonic(), set by the hook

    def start(self, now: bool = True) -> None:
        """The push goes to its thread with the first layer handed over (or a
        cancellation): by then the step's compute is launched, so its opening of the push
        does not hold the GIL while the engine thread launches kernels. In a gang, it
        goes `now` or with the others handed over in its step (a cancellation lets a push
        go that is queued still: its step's handover never ended)."""
        with self._start_lock:
            submitted, self._submitted = self._submitted, True
        if self._gang is not None:
            if not submitted:
                self._gang.add(self, now)
            elif now:
                self._gang.flush()
        elif not submitted:
            self._threads.submit(self._run)

    def layer_done(self, layer: int) -> None:
        """Engine thread, as layer `layer`'s KV is written (on CUDA: enqueued): hand it
        over. Never waits."""
        if layer < self._last:
            return
        self.start(now=False)
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
        """Wait (at most `timeout`) for the push's end, if it was started."""
        if self._submitted:
            self._ended.wait(timeout)

    # -- on the transfer thread --------------------------------------------------------------

    def _left(self) -> float:
        return max(0.0, self._deadline() - time.monotonic())

    def _run(self) -> None:
        bind_thread(self._device)
        stream = _stream(self._device)
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
        self._end(error)

    def _end(self, error: BaseException | None) -> None:
        """Every read of the blocks is done: the push's end goes to the role."""
        try:
            self._on_end(error)
        finally:
            self._ended.set()

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
        push = self._opened(target)
        self._send_end(push)
        self._finished(push)

    def _opened_whole(self, target: Target) -> tuple[KVPush, torch.cuda.Event | None]:
        """A gang's push, opened, and the event after its compute (the last layer's: every
        other's came before it) that its write waits for; an error aborts it."""
        push = self._open_push(target)
        with contextlib.ExitStack() as on_error:
            on_error.push(push)
            _, event = self._take_layer()
            on_error.pop_all()
        return push, event

    def _opened(self, target: Target) -> KVPush:
        """The push opened and every layer sent; an error aborts it."""
        push = self._open_push(target)
        with contextlib.ExitStack() as on_error:
            on_error.push(push)  # its __exit__: an error leaving the block aborts the push
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
            on_error.pop_all()
        return push

    def _send_end(self, push: KVPush) -> None:
        """`push` (opened, every layer sent) ends with the first token; an error aborts
        it."""
        with contextlib.ExitStack() as on_error:
            on_error.push(push)
            push.end(self._result(self._first_token, "first token was not sampled before "
                                                     "the sink expired"))
            on_error.pop_all()

    def _finished(self, push: KVPush) -> None:
        """`push` (ended) once its receiver confirmed it."""
        with push:
            push.wait_done()
            trace.mark(push.sink.request_id, "push.done")

    def _next_layer(self) -> int:
        """The next computed layer, its compute ordered before the work this thread
        enqueues next; raises a cancellation, or at the deadline."""
        layer, event = self._take_layer()
        if event is not None:
            torch.cuda.current_stream(self._device).wait_event(event)
        return layer

    def _take_layer(self) -> tuple[int, torch.cuda.Event | None]:
        """The next computed layer and, on CUDA, the event after its compute; raises a
        cancellation, or at the deadline."""
        try:
            item = self._items.get(timeout=self._left())
        except queue.Empty:
            raise TransferError("the prompt's layers were not computed before the sink "
                                "expired") from None
        if isinstance(item, BaseException):
            raise item
        return item


def transfer_error(error: BaseException) -> BaseException:
    """What a prefill raises for a push that ended with `error`."""
    if isinstance(error, (TransferError, ValueError)):
        return error
    log.error("KV push failed", exc_info=error)
    wrapped = TransferError(f"KV push failed: {error!r}")
    wrapped.__cause__ = error
    return wrapped
