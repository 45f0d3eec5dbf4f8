"""The prefill role over one engine: compute a prompt, push its KV into a decode node's
sink layer by layer while the later layers compute (ipc, which writes the sink itself:
the whole prompt in one copy once its last layer is computed), and return the first token.

A prompt is batched with the others (chunked prefill, the engine's scheduler). The
engine thread never waits on the network, only on local memory: in the step that
completes a prompt, the engine's prefill hook takes a reference on the prompt's blocks
and starts a transfer thread for the push; as each layer's KV is written, the hook's
callback hands the layer's index (on CUDA with an event recorded after its compute) to
that thread. The transfer thread connects, waits for the receiver's accept, gathers each
layer from the held blocks (on CUDA on its own stream, after the layer's event), sends
it, and waits for the receiver's `done`. So a slow or dead receiver stalls only its own
thread, which fails within the push's timeouts; the result, the first token joined with
the receiver's `done`, comes back then.

Blocks are safe though the gathers run after the step: the request's blocks go back to
the engine's prefix cache when its step ends, but the held reference keeps them out of
the free queue, so no request is given them to write until the transfer thread has read
them (on CUDA: synchronized its stream) and handed the reference back through the loop.
Meanwhile another request may share a held full block from the prefix cache, which only
reads it.

Staging is bounded per push by KVPush's ring (`ring` slots of at most `message_bytes`,
allocated once the receiver accepted), and per node by the pushes that may stage at once
(on a GPU, `MAX_STAGED_PUSHES`; the others wait for a slot before they open); a push lives at most
until its sink's expiry plus a grace; beyond that a slow receiver holds only its prompt's
blocks, in the engine's own pool, for as long.

The push's end frame carries the prompt's first token (it waits for the step's sampling,
which ends as its copies do), so the decode node starts decoding without waiting for this
node's reply.

With the cluster secret every push proves it to the receiver (`auth`). A sink that has
expired is refused before anything is computed, and one that expires while its prompt
waits in the engine gets no push.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field, replace

import torch

from tandem.engine import trace
from tandem.engine.block_pool import Block
from tandem.engine.llm_engine import LLMEngine, bind_thread
from tandem.engine.outputs import RequestOutput
from tandem.engine.request import Request
from tandem.kvtransfer.agent import SinkInfo
from tandem.kvtransfer.connector import Connector, TransferError
from tandem.kvtransfer.layout import KVLayout
from tandem.kvtransfer.sender import KVPush
from tandem.kvtransfer.staging import KVRows
from tandem.node.loop import EngineLoop

log = logging.getLogger(__name__)

# A push may outlive its sink's expiry by this much: the receiver's abort for an expired
# sink, or its `done` for one that became ready just in time, is still on its way.
EXPIRY_GRACE_S = 5.0
_CLOSE_WAIT_S = 10.0  # close(): how long to wait for cancelled transfer threads in all

# Pushes from a GPU that stage their KV (every connector but ipc) at once per node: each
# holds `ring` staging buffers of up to 64 MiB in device memory outside the KV budget, and
# a burst puts a push in flight for every prompt computed; the rest wait their turn.
MAX_STAGED_PUSHES = 4

# What the engine thread hands a transfer thread: a computed layer (with, on CUDA, the
# event recorded after its compute), or the error it should give up with.
_Item = tuple[int, torch.cuda.Event | None] | BaseException


@dataclass(frozen=True)
class PrefillResult:
    first_token: int
    cached_tokens: int  # prompt tokens this node took from its prefix cache
    kv_bytes: int  # pushed into the sink


@dataclass(eq=False)
class _Pending:
    """One prefill, from `prefill()` to its result. `transfer`, `output` and `pushed_s`
    are set under the role's lock (a transfer thread reads them); `error` is the loop's."""

    sink: SinkInfo
    first_block: int
    deadline: float  # time.monotonic(): the caller and the push give up then
    wait_s: float  # the caller's wait, from its start to the deadline
    result: Future[PrefillResult] = field(default_factory=Future)
    transfer: _Transfer | None = None
    error: BaseException | None = None  # the hook's reason for opening no push
    output: RequestOutput | None = None  # the finished output, first token in it
    pushed_s: float | None = None  # once the receiver said done: seconds since the hook


class PrefillRole:
    def __init__(self, loop: EngineLoop, connector: Connector, layout: KVLayout,
                 send_timeout_s: float = 30.0, *, secret: bytes | None = None,
                 connect_timeout_s: float = 5.0, reply_timeout_s: float = 10.0) -> None:
        self.loop, self.connector, self.layout = loop, connector, layout
        self._rows = KVRows(loop.engine.runner.kv_caches)
        self._rows.check(layout)  # read once here, not raced by the first transfer threads
        self._timeouts = {"connect_timeout": connect_timeout_s, "send_timeout": send_timeout_s,
                          "reply_timeout": reply_timeout_s}
        self._secret = secret
        self._pending: dict[str, _Pending] = {}  # touched on the loop thread only
        self._live: set[_Transfer] = set()  # under _lock
        self._lock = threading.Lock()
        self.kv_bytes_sent = 0
        self.kv_transfer_seconds = 0.0  # summed over pushes, the hook to the receiver's done
        self.transfers_failed = 0
        # A direct connector (ipc) writes the whole prompt in one copy once its last layer
        # is computed: a copy per layer saves little on one host, and its host work per
        # layer slowed the engine's own step by a third (Llama-3-8B shape, one H100).
        self._whole = getattr(connector, "direct", False)
        # Staging in device memory is bounded; on the CPU it is host memory, unbounded.
        on_cuda = self._rows.caches[0].device.type == "cuda"
        self._staging = (threading.BoundedSemaphore(MAX_STAGED_PUSHES)
                         if on_cuda and not self._whole else None)
        loop.engine.prefill_hook = self._hook

    async def run(self, req: Request, sink: SinkInfo, first_block: int,
                  timeout_s: float = 120.0) -> PrefillResult:
        """Compute `req`'s prompt and push blocks first_block.. of it into `sink`.
        Raises ValueError for a bad request, TransferError when the push failed (or the
        sink expired). Waits until the sink's expiry plus a grace, at most `timeout_s`;
        a caller that goes away (cancelled) drops the prompt from the engine."""
        pending, add = self._begin(req, sink, first_block, timeout_s)
        rid = req.request_id
        # Not awaited on its own: this loop's wake-up would come during the prompt's step.
        self.loop.submit(add).add_done_callback(
            lambda added: self._not_added(pending, added.exception()))
        try:
            return await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(pending.result)),
                                          max(0.0, pending.deadline - time.monotonic()))
        except TimeoutError:
            error = TransferError(f"no KV push result for {rid!r} within {pending.wait_s:.3g}s "
                                  f"(its sink's expiry and {EXPIRY_GRACE_S:g}s)")
            self._give_up(rid, pending, error)
            raise error from None
        except asyncio.CancelledError:
            self._give_up(rid, pending, TransferError(f"the caller of {rid!r} went away"))
            raise

    def prefill(self, req: Request, sink: SinkInfo, first_block: int,
                timeout_s: float = 120.0) -> PrefillResult:
        """`run`, for a caller on no event loop (a script, a test thread)."""
        return asyncio.run(self.run(req, sink, first_block, timeout_s))

    def _begin(self, req: Request, sink: SinkInfo, first_block: int, timeout_s: float
               ) -> tuple[_Pending, Callable[[LLMEngine], None]]:
        """Check the sink; the pending prefill, and what adds it on the loop thread."""
        if len(sink.block_ids) != -(-req.num_prompt_tokens // self.layout.block_size) - first_block:
            raise ValueError(f"the sink's {len(sink.block_ids)} blocks from block {first_block} "
                             f"do not fit a {req.num_prompt_tokens}-token prompt")
        left = sink.expires_at - time.time()
        if left <= 0:
            self._count_failure()
            raise TransferError(f"the sink for {req.request_id!r} expired {-left:.3g}s ago")
        params = req.params
        one = Request(req.request_id, req.prompt_token_ids,
                      replace(params, max_tokens=1, min_tokens=min(params.min_tokens, 1)),
                      cache_salt=req.cache_salt)
        wait_s = min(timeout_s, left + EXPIRY_GRACE_S)
        pending = _Pending(sink, first_block, time.monotonic() + wait_s, wait_s)
        rid = req.request_id

        def add(engine: LLMEngine) -> None:
            # On the loop thread, so no step runs before the listener is in place; and
            # only once the engine took the request: an id in use keeps its listener.
            engine.add(one)
            trace.mark(rid, "prefill.added")
            self._pending[rid] = pending
            self.loop.listen(rid, lambda out: self._on_output(rid, out))

        return pending, add

    def close(self) -> None:
        """Cancel the transfers still running and wait (a bounded time) for their ends."""
        with self._lock:
            live = list(self._live)
        for transfer in live:
            transfer.cancel(TransferError("the prefill role is closing"))
        deadline = time.monotonic() + _CLOSE_WAIT_S
        for transfer in live:
            transfer.join(max(0.0, deadline - time.monotonic()))

    # -- on the loop thread ----------------------------------------------------------------

    def _hook(self, req: Request) -> Callable[[int], None] | None:
        """Cheap local work only: no socket, no peer (see the module docstring)."""
        pending = self._pending.get(req.request_id)
        if pending is None or pending.transfer is not None:
            return None
        trace.mark(req.request_id, "prefill.hook")
        if time.time() >= pending.sink.expires_at:
            pending.error = TransferError(f"the sink for {req.request_id!r} expired before "
                                          f"its prompt was computed")
            return None
        n = len(pending.sink.block_ids)
        src = req.block_ids[pending.first_block:pending.first_block + n]
        if len(src) != n:  # (prefill() checked the count; this is the engine's side)
            pending.error = TransferError(f"{len(src)} prompt blocks for a {n}-block sink")
            return None
        pool = self.loop.engine.block_pool
        blocks = [pool.blocks[i] for i in src]
        whole = self._whole
        transfer = _Transfer(
            lambda: KVPush(self.connector, pending.sink, self._rows, src, self.layout,
                           secret=self._secret, all_computed=whole, **self._timeouts),
            self._rows.caches[0].device, pending.deadline,
            lambda error: self._pushed(pending, transfer, blocks, error),
            self.layout.num_layers if whole else 0, self._staging)
        with self._lock:
            if pending.result.done():  # the caller gave up meanwhile
                return None
            pending.transfer = transfer
            self._live.add(transfer)
        pool.acquire(blocks)  # held until the transfer read them: see the module docstring
        transfer.started = time.monotonic()
        transfer.start()
        return transfer.layer_done

    def _on_output(self, rid: str, out: RequestOutput | BaseException) -> None:
        if isinstance(out, RequestOutput) and not out.finished:
            return
        pending = self._pending.pop(rid, None)
        if pending is None:
            return
        trace.mark(rid, "prefill.output")
        if isinstance(out, BaseException):
            error = out
        elif out.finish_reason == "abort":
            error = TransferError(f"prefill of {rid!r} was aborted")
        elif pending.transfer is None:
            error = pending.error or TransferError(f"no KV push was opened for {rid!r}")
        else:
            pending.transfer.sampled(out.token_ids[0])
            with self._lock:
                pending.output = out
            self._complete(pending)
            return
        self._fail(pending, error)

    # -- on any thread -----------------------------------------------------------------------

    def _pushed(self, pending: _Pending, transfer: _Transfer, blocks: list[Block],
                error: BaseException | None) -> None:
        """A transfer thread's end: every read of `blocks` is done."""
        trace.mark(pending.sink.request_id, "prefill.pushed")
        self._release(blocks)  # before the result: a call after it sees them back
        with self._lock:
            self._live.discard(transfer)
            if error is None:
                pending.pushed_s = time.monotonic() - transfer.started
        if error is None:
            self._complete(pending)
        else:
            self._fail(pending, _transfer_error(error))

    def _release(self, blocks: list[Block]) -> None:
        """Hand the transfer's reference on the blocks back, tail first as the engine
        frees a request's; the loop runs it between two steps."""
        self.loop.submit(lambda engine: engine.block_pool.free(reversed(blocks)))

    def _complete(self, pending: _Pending) -> None:
        """The result, once both the first token and the receiver's done are in."""
        kv_bytes = len(pending.sink.block_ids) * self.layout.block_bytes * self.layout.num_layers
        with self._lock:
            out, seconds = pending.output, pending.pushed_s
            if out is None or seconds is None or pending.result.done():
                return
            self.kv_bytes_sent += kv_bytes
            self.kv_transfer_seconds += seconds
            pending.result.set_result(
                PrefillResult(out.token_ids[0], out.num_cached_tokens, kv_bytes))

    def _fail(self, pending: _Pending, error: BaseException) -> None:
        """Fail the prefill once (and count it); its transfer, if running, gives up."""
        with self._lock:
            if pending.result.done():
                return
            self.transfers_failed += 1
            pending.result.set_exception(error)
            transfer = pending.transfer
        if transfer is not None:
            transfer.cancel(error)

    def _not_added(self, pending: _Pending, error: BaseException | None) -> None:
        """The engine refused the prompt (its id is in use, the loop is closed): the
        caller gets that error, uncounted."""
        if error is None:
            return
        with self._lock:
            if not pending.result.done():
                pending.result.set_exception(error)

    def _count_failure(self) -> None:
        with self._lock:
            self.transfers_failed += 1

    def _give_up(self, rid: str, pending: _Pending, error: TransferError) -> None:
        """The caller's wait ended: fail the prefill, and drop the request if the engine
        still has it (queued behind others past its sink's expiry)."""
        self._fail(pending, error)

        def drop(engine: LLMEngine) -> None:
            if self._pending.get(rid) is pending:  # not finished (nor a later namesake)
                del self._pending[rid]
                self.loop.unlisten(rid)
                engine.abort(rid)

        self.loop.submit(drop)


class _Transfer:
    """One KV push on its own thread, fed layer by layer from the engine thread; or, with
    `whole` (the number of layers), once, when the last layer is computed."""

    def __init__(self, open_push: Callable[[], KVPush], device: torch.device,
                 deadline: float, on_end: Callable[[BaseException | None], None],
                 whole: int = 0, staging: threading.Semaphore | None = None) -> None:
        """`staging`: a slot of it is held from the push's open to its end."""
        self._open_push, self._device = open_push, device
        self._staging = staging
        self._first_token: Future[int] = Future()  # the end frame carries it
        self._deadline, self._on_end = deadline, on_end
        self._last = whole - 1  # whole: the one layer handed over (-1: every layer)
        self._items: queue.SimpleQueue[_Item] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="kv-push", daemon=True)
        self.started = 0.0  # time.monotonic(), set by the hook

    def start(self) -> None:
        self._thread.start()

    def layer_done(self, layer: int) -> None:
        """Engine thread, as layer `layer`'s KV is written (on CUDA: enqueued): hand it
        over. Never waits."""
        if layer < self._last:
            return
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
        """Any thread: give up with `error` at the next layer the push waits for (or the
        first token)."""
        self._items.put(error)
        with contextlib.suppress(InvalidStateError):
            self._first_token.set_exception(error)

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)

    # -- on the transfer thread --------------------------------------------------------------

    def _run(self) -> None:
        bind_thread(self._device)
        stream = torch.cuda.Stream(self._device) if self._device.type == "cuda" else None
        error: BaseException | None = None
        try:
            with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                try:
                    self._push()
                finally:
                    if stream is not None:  # the gathers have read the blocks
                        stream.synchronize()
        except BaseException as exc:  # noqa: BLE001 - handed to the role
            error = exc
        self._on_end(error)

    def _push(self) -> None:
        if self._staging is None:
            self._push_now()
            return
        if not self._staging.acquire(timeout=max(0.0, self._deadline - time.monotonic())):
            raise TransferError("no staging slot came free before the sink expired")
        try:
            self._push_now()
        finally:
            self._staging.release()

    def _push_now(self) -> None:
        with self._open_push() as push:  # an error leaving the block aborts the push
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
            push.finish(self._sampled())
            trace.mark(rid, "push.done")

    def _sampled(self) -> int:
        """The first token, once the engine thread sampled it (as the layers land)."""
        try:
            return self._first_token.result(max(0.0, self._deadline - time.monotonic()))
        except FutureTimeout:
            raise TransferError("the prompt's first token was not sampled before the sink "
                                "expired") from None

    def _next_layer(self) -> int:
        """The next computed layer, its compute ordered before the work this thread
        enqueues next; raises a cancellation, or at the deadline."""
        try:
            item = self._items.get(timeout=max(0.0, self._deadline - time.monotonic()))
        except queue.Empty:
            raise TransferError("the prompt's layers were not computed before the sink "
                                "expired") from None
        if isinstance(item, BaseException):
            raise item
        layer, event = item
        if event is not None:
            torch.cuda.current_stream(self._device).wait_event(event)
        return layer


def _transfer_error(error: BaseException) -> BaseException:
    """What `prefill()` raises for a push that ended with `error`."""
    if isinstance(error, (TransferError, ValueError)):
        return error
    log.error("KV push failed", exc_info=error)
    wrapped = TransferError(f"KV push failed: {error!r}")
    wrapped.__cause__ = error
    return wrapped
