"""The prefill role over one engine: compute a prompt, push its KV into a decode node's
sink layer by layer while the later layers compute (ipc, which writes the sink itself:
the whole prompt in one copy once its last layer is computed), and return the first token.

A prompt is batched with the others (chunked prefill, the engine's scheduler). The
engine thread never waits on the network, only on local memory: in the step that
completes a prompt, the engine's prefill hook takes a reference on the prompt's blocks
and hands the push to a transfer thread (one of `transfer.PushThreads`, reused); as each
layer's KV is written, the hook's callback hands the layer's index (on CUDA with an
event recorded after its compute) to that thread. The transfer thread connects, waits
for the receiver's accept, gathers each layer from the held blocks (on CUDA on its own
stream, after the layer's event), sends it, and waits for the receiver's `done`. So a
slow or dead receiver stalls only its own thread, which fails within the push's
timeouts; the result, the first token joined with the receiver's `done`, comes back
then. The whole pushes of ipc that one step completes go together, one thread and one
message per receiver (`transfer.Gang`), once the engine has handed the step's last layer
over to all of them (its `prefill_handed`).

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

An early start (`begin`: the router asks while the decode node reserves the prompt's
blocks, so the compute starts one hop and one reservation sooner) computes the prompt
before its sink is known: the hook holds every prompt block and the transfer thread waits
for its target, which the decode node's own call brings (`run` finds the early start and
attaches its sink). Only a few wait for their sinks at once (`MAX_EARLY`), and only on a
node whose engine has no prompt waiting; one whose sink does not come within its hold is
dropped, and the call that brings the sink later computes the prompt again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field, replace

from tandem.engine import trace
from tandem.engine.block_pool import Block
from tandem.engine.llm_engine import LLMEngine
from tandem.engine.outputs import RequestOutput
from tandem.engine.request import Request
from tandem.engine.sampling_params import SamplingParams
from tandem.kvtransfer.agent import SinkInfo
from tandem.kvtransfer.connector import Connector, TransferError
from tandem.kvtransfer.layout import KVLayout
from tandem.kvtransfer.sender import KVPush
from tandem.kvtransfer.staging import KVRows
from tandem.node.loop import EngineLoop
from tandem.prefill_node.transfer import Gang, PushThreads, Target, Transfer, transfer_error

log = logging.getLogger(__name__)

# A push may outlive its sink's expiry by this much: the receiver's abort for an expired
# sink, or its `done` for one that became ready just in time, is still on its way.
EXPIRY_GRACE_S = 5.0
_CLOSE_WAIT_S = 10.0  # close(): how long to wait for cancelled transfer threads in all

# Pushes from a GPU that stage their KV (every connector but ipc) at once per node: each
# holds `ring` staging buffers of up to 64 MiB in device memory outside the KV budget, and
# a burst puts a push in flight for every prompt computed; the rest wait their turn.
MAX_STAGED_PUSHES = 4

# Early starts that wait for their sinks at once, and the share of the KV blocks they may
# hold: each holds its prompt's blocks until its sink comes (or its hold lapses), and a
# prompt whose sink is ready must never wait for blocks behind them. Past either, a
# prompt starts when its sink comes.
MAX_EARLY = 4
MAX_EARLY_SHARE = 0.25
_REMEMBERED = 4096  # request ids started here, so a late early start does not run again


def sendable_first(params: SamplingParams, out: RequestOutput) -> bool:
    """Whether an early start's first output may reach the client ahead of the decode
    node's first chunk, which brings the same token and text and must add nothing: not
    where the token ends the request (EOS, a stop token, max_tokens 1: the prompt's one
    token here ends at its length only), where stop strings may hold text back or
    logprobs are asked for, nor where the text ends in an unfinished character (this
    output, the last, flushed it; the decode node holds it for the next token)."""
    return (out.finish_reason == "length" and (params.max_tokens is None or params.max_tokens > 1)
            and not params.stop and params.logprobs is None and params.n == 1
            and not out.delta.endswith("\ufffd"))


# A prefix pull before a prompt is added (node/pull.py's Puller, with its peer): the
# prompt tokens that came, 0 if none (it never raises).
Pull = Callable[[Request], Awaitable[int]]


@dataclass(frozen=True)
class PrefillResult:
    first_token: int
    cached_tokens: int  # prompt tokens this node took from its prefix cache
    kv_bytes: int  # pushed into the sink


@dataclass(eq=False)
class _Pending:
    """One prefill, from its start to its result. `target` (the sink, and the first prompt
    block it takes) comes with the start, or after an early start with `run`, which moves
    `deadline` before it sets `target`. `transfer`, `output` and `pushed_s` are set under
    the role's lock (a transfer thread reads them); `error` is the loop's."""

    request_id: str
    prompt: list[int]
    deadline: float  # time.monotonic(): the caller and the push give up then
    wait_s: float  # the caller's wait, from its start to the deadline
    early: bool = False
    target: Future[Target] = field(default_factory=Future)
    result: Future[PrefillResult] = field(default_factory=Future)
    transfer: Transfer | None = None
    error: BaseException | None = None  # the hook's reason for opening no push
    output: RequestOutput | None = None  # the finished output, first token in it
    pushed_s: float | None = None  # once the receiver said done: seconds since the hook
    # That output, as soon as it is sampled with a push under way (an early start's
    # caller may send its token on); an error once the prefill fails first.
    first: Future[RequestOutput] = field(default_factory=Future)


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
        self._pending: dict[str, _Pending] = {}  # in the engine: the loop thread's only
        self._lock = threading.Lock()
        # Under _lock: every prefill until its result, by request; transfers running;
        # request ids started here lately (oldest first).
        self._by_id: dict[str, _Pending] = {}
        self._live: set[Transfer] = set()
        self._threads = PushThreads()
        self._started: dict[str, None] = {}
        self._pulls: set[asyncio.Task] = set()  # prefixes being pulled, then added
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
        self._gang = Gang(self._threads, layout.num_layers) if self._whole else None
        loop.engine.prefill_hook = self._hook
        loop.engine.prefill_layerwise = not self._whole
        loop.engine.prefill_handed = self._gang.flush if self._gang is not None else None

    @property
    def rows(self) -> KVRows:
        """The engine's KV cache as pushes read it (a peer's pull reads it too)."""
        return self._rows

    async def run(self, req: Request, sink: SinkInfo, first_block: int,
                  timeout_s: float = 120.0, pull: Pull | None = None) -> PrefillResult:
        """Compute `req`'s prompt (or take up its early start) and push blocks
        first_block.. of it into `sink`. Raises ValueError for a bad request,
        TransferError when the push failed (or the sink expired). Waits until the sink's
        expiry plus a grace, at most `timeout_s`; a caller that goes away (cancelled)
        drops the prompt from the engine."""
        rid = req.request_id
        wait_s = self._check(req, sink, first_block, timeout_s)
        pending = self._attach(req, (sink, first_block), wait_s)
        if pending is None:
            pending = self._add(req, (sink, first_block), wait_s, pull)
        try:
            return await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(pending.result)),
                                          max(0.0, pending.deadline - time.monotonic()))
        except TimeoutError:
            error = TransferError(f"no KV push result for {rid!r} within {pending.wait_s:.3g}s "
                                  f"(its sink's expiry and {EXPIRY_GRACE_S:g}s)")
            self._give_up(pending, error)
            raise error from None
        except asyncio.CancelledError:
            self._give_up(pending, TransferError(f"the caller of {rid!r} went away"))
            raise

    def prefill(self, req: Request, sink: SinkInfo, first_block: int,
                timeout_s: float = 120.0) -> PrefillResult:
        """`run`, for a caller on no event loop (a script, a test thread)."""
        return asyncio.run(self.run(req, sink, first_block, timeout_s))

    def begin(self, req: Request, hold_s: float, pull: Pull | None = None
              ) -> Future[RequestOutput] | None:
        """An early start: compute `req`'s prompt now, its sink to come with a later `run`
        (within `hold_s`, else it is dropped). On the asyncio loop. Skipped, and the later
        `run` starts it, while the engine has prompts waiting, while early starts that
        wait for their sinks are MAX_EARLY or would hold more than MAX_EARLY_SHARE of the
        blocks with this one, or if the id started here before. Returns None if skipped,
        else the prompt's first output to come (`_Pending.first`)."""
        rid = req.request_id
        engine = self.loop.engine
        with self._lock:
            early = [p for p in self._by_id.values() if p.early and not p.target.done()]
            blocks = sum(self._blocks(len(p.prompt)) for p in early)
            blocks += self._blocks(req.num_prompt_tokens)
            if (rid in self._started or engine.scheduler.waiting or len(early) >= MAX_EARLY
                    or blocks > MAX_EARLY_SHARE * engine.block_pool.num_blocks):
                return None
            pending = self._register(_Pending(rid, list(req.prompt_token_ids),
                                              time.monotonic() + hold_s, hold_s, early=True))
        self._submit_add(req, pending, pull)
        asyncio.get_running_loop().call_later(hold_s, self._lapse, pending)
        return pending.first

    def started(self, request_id: str) -> bool:
        """Whether `request_id` started here lately: its early start may be under way, or
        dropped and still leaving the engine (the loop drops it before a new add)."""
        with self._lock:
            return request_id in self._started

    def request_ids(self) -> list[str]:
        with self._lock:
            return list(self._by_id)

    def abort(self, request_id: str, reason: str) -> bool:
        """Fail the prefill of `request_id` and drop it; whether there was one."""
        with self._lock:
            pending = self._by_id.get(request_id)
        if pending is not None:
            self._give_up(pending, TransferError(f"prefill of {request_id!r} aborted: {reason}"))
        return pending is not None

    def close(self) -> None:
        """Cancel the transfers still running and wait (a bounded time) for their ends."""
        with self._lock:
            live = list(self._live)
        for transfer in live:
            transfer.cancel(TransferError("the prefill role is closing"))
        deadline = time.monotonic() + _CLOSE_WAIT_S
        for transfer in live:
            transfer.join(max(0.0, deadline - time.monotonic()))
        self._threads.close()

    # -- starting ----------------------------------------------------------------------------

    def _blocks(self, num_tokens: int) -> int:
        return -(-num_tokens // self.layout.block_size)

    def _check(self, req: Request, sink: SinkInfo, first_block: int, timeout_s: float) -> float:
        """Check the sink against the prompt; how long its caller may wait."""
        if len(sink.block_ids) != self._blocks(req.num_prompt_tokens) - first_block:
            raise ValueError(f"the sink's {len(sink.block_ids)} blocks from block {first_block} "
                             f"do not fit a {req.num_prompt_tokens}-token prompt")
        left = sink.expires_at - time.time()
        if left <= 0:
            self._count_failure()
            raise TransferError(f"the sink for {req.request_id!r} expired {-left:.3g}s ago")
        return min(timeout_s, left + EXPIRY_GRACE_S)

    def _attach(self, req: Request, target: Target, wait_s: float) -> _Pending | None:
        """The early start of `req` that waits for its sink, given `target`; None if none
        waits (the caller starts the prompt)."""
        with self._lock:
            pending = self._by_id.get(req.request_id)
            if (pending is None or not pending.early or pending.target.done()
                    or pending.result.done()):
                return None
            if pending.prompt != list(req.prompt_token_ids):
                raise ValueError(f"request id {req.request_id!r} is in use for another prompt")
            pending.deadline, pending.wait_s = time.monotonic() + wait_s, wait_s
            pending.target.set_result(target)
        trace.mark(req.request_id, "prefill.attached")
        return pending

    def _add(self, req: Request, target: Target, wait_s: float, pull: Pull | None
             ) -> _Pending:
        pending = _Pending(req.request_id, list(req.prompt_token_ids),
                           time.monotonic() + wait_s, wait_s)
        pending.target.set_result(target)
        with self._lock:
            self._register(pending)
        self._submit_add(req, pending, pull)
        return pending

    def _register(self, pending: _Pending) -> _Pending:
        """Under _lock."""
        rid = pending.request_id
        self._by_id.setdefault(rid, pending)  # a namesake's add fails: it keeps its entry
        self._started[rid] = None
        if len(self._started) > _REMEMBERED:
            del self._started[next(iter(self._started))]
        return pending

    def _submit_add(self, req: Request, pending: _Pending, pull: Pull | None = None,
                    peer_tokens: int = 0) -> None:
        """Add the prompt (one token to sample) on the loop thread. Not awaited: this
        loop's wake-up would come during the prompt's step. With `pull`, on the asyncio
        loop: its prefix is pulled from a peer first (never failing: computed if not)."""
        if pull is not None:
            async def pulled_then_add() -> None:
                try:
                    pulled = await pull(req)
                except Exception:  # noqa: BLE001 - a bug in the pull: compute the prompt
                    log.exception("pull of %s's prefix failed", req.request_id)
                    pulled = 0
                if not pending.result.done():  # its caller may have given up meanwhile
                    self._submit_add(req, pending, peer_tokens=pulled)

            task = asyncio.ensure_future(pulled_then_add())
            self._pulls.add(task)
            task.add_done_callback(self._pulls.discard)
            return
        params = req.params
        one = Request(req.request_id, req.prompt_token_ids,
                      replace(params, max_tokens=1, min_tokens=min(params.min_tokens, 1)),
                      cache_salt=req.cache_salt)
        one.num_peer_cached_tokens = peer_tokens
        rid = req.request_id

        def add(engine: LLMEngine) -> None:
            # On the loop thread, so no step runs before the listener is in place; and
            # only once the engine took the request: an id in use keeps its listener.
            old = self._pending.get(rid)
            if old is not None and old.result.done():  # a failed early start, not yet dropped
                self._drop(engine, old)
            engine.add(one)
            trace.mark(rid, "prefill.added")
            self._pending[rid] = pending
            self.loop.listen(rid, lambda out: self._on_output(rid, out))

        self.loop.submit(add).add_done_callback(
            lambda added: self._not_added(pending, added.exception()))

    def _lapse(self, pending: _Pending) -> None:
        """An early start's hold is over: dropped unless its sink came."""
        if not pending.target.done():
            self._give_up(pending, TransferError(
                f"no sink came for {pending.request_id!r} within {pending.wait_s:g}s"))

    # -- on the loop thread ----------------------------------------------------------------

    def _hook(self, req: Request) -> Callable[[int], None] | None:
        """Cheap local work only: no socket, no peer (see the module docstring)."""
        pending = self._pending.get(req.request_id)
        if pending is None or pending.transfer is not None:
            return None
        trace.mark(req.request_id, "prefill.hook")
        target = pending.target.result() if pending.target.done() and not (
            pending.target.exception()) else None
        if target is not None and time.time() >= target[0].expires_at:
            pending.error = TransferError(f"the sink for {req.request_id!r} expired before "
                                          f"its prompt was computed")
            return None
        pool = self.loop.engine.block_pool
        prompt_blocks = list(req.block_ids)  # the target takes its slice of them
        blocks = [pool.blocks[i] for i in prompt_blocks]
        whole = self._whole

        def open_push(target: Target) -> KVPush:
            sink, first = target
            src = prompt_blocks[first:first + len(sink.block_ids)]
            if len(src) != len(sink.block_ids):  # (run() checked the count; the engine's side)
                raise TransferError(f"{len(src)} prompt blocks for a "
                                    f"{len(sink.block_ids)}-block sink")
            return KVPush(self.connector, sink, self._rows, src, self.layout,
                          secret=self._secret, all_computed=whole, **self._timeouts)

        transfer = Transfer(self._threads, pending.target, open_push, self._rows.caches[0].device,
                            lambda: pending.deadline,
                            lambda error: self._pushed(pending, transfer, blocks, error),
                            self.layout.num_layers if whole else 0, self._staging,
                            self._gang)
        with self._lock:
            if pending.result.done():  # the caller gave up meanwhile
                return None
            pending.transfer = transfer
            self._live.add(transfer)
        pool.acquire(blocks)  # held until the transfer read them: see the module docstring
        transfer.started = time.monotonic()  # its thread starts with the first layer
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
            with contextlib.suppress(InvalidStateError):  # failed meanwhile
                pending.first.set_result(out)  # before the push's end: the router's is first
            pending.transfer.sampled(out.token_ids[0])
            with self._lock:
                pending.output = out
            self._complete(pending)
            return
        self._fail(pending, error)

    def _drop(self, engine: LLMEngine, pending: _Pending) -> None:
        """Drop `pending`'s prompt from the engine if it still has it."""
        rid = pending.request_id
        if self._pending.get(rid) is pending:  # not finished (nor a later namesake)
            del self._pending[rid]
            self.loop.unlisten(rid)
            engine.abort(rid)

    # -- on any thread -----------------------------------------------------------------------

    def _pushed(self, pending: _Pending, transfer: Transfer, blocks: list[Block],
                error: BaseException | None) -> None:
        """A transfer thread's end: every read of `blocks` is done."""
        trace.mark(pending.request_id, "prefill.pushed")
        self._release(blocks)  # before the result: a call after it sees them back
        with self._lock:
            self._live.discard(transfer)
            if error is None:
                pending.pushed_s = time.monotonic() - transfer.started
        if error is None:
            self._complete(pending)
        else:
            self._fail(pending, transfer_error(error))

    def _release(self, blocks: list[Block]) -> None:
        """Hand the transfer's reference on the blocks back, tail first as the engine
        frees a request's; the loop runs it between two steps."""
        self.loop.submit(lambda engine: engine.block_pool.free(reversed(blocks)))

    def _complete(self, pending: _Pending) -> None:
        """The result, once both the first token and the receiver's done are in."""
        with self._lock:
            out, seconds = pending.output, pending.pushed_s
            if out is None or seconds is None or pending.result.done():
                return
            sink = pending.target.result()[0]
            kv_bytes = len(sink.block_ids) * self.layout.block_bytes * self.layout.num_layers
            self.kv_bytes_sent += kv_bytes
            self.kv_transfer_seconds += seconds
            self._settle(pending, PrefillResult(out.token_ids[0], out.num_cached_tokens,
                                                kv_bytes))

    def _fail(self, pending: _Pending, error: BaseException, count: bool = True) -> None:
        """Fail the prefill once (and count it); its transfer, if running, gives up."""
        with self._lock:
            if pending.result.done():
                return
            self.transfers_failed += count
            self._settle(pending, error=error)
            transfer = pending.transfer
        if transfer is not None:
            transfer.cancel(error)

    def _settle(self, pending: _Pending, result: PrefillResult | None = None,
                error: BaseException | None = None) -> None:
        """Under _lock: the prefill's one outcome; it is no longer under way."""
        if error is not None:
            pending.result.set_exception(error)
            if not pending.first.done():
                pending.first.set_exception(error)
        else:
            pending.result.set_result(result)
        if self._by_id.get(pending.request_id) is pending:
            del self._by_id[pending.request_id]

    def _not_added(self, pending: _Pending, error: BaseException | None) -> None:
        """The engine refused the prompt (its id is in use, the loop is closed): the
        caller gets that error, uncounted."""
        if error is not None:
            self._fail(pending, error, count=False)

    def _count_failure(self) -> None:
        with self._lock:
            self.transfers_failed += 1

    def _give_up(self, pending: _Pending, error: TransferError) -> None:
        """The wait for `pending` ended: fail it, and drop the prompt if the engine still
        has it (queued behind others past its sink's expiry)."""
        self._fail(pending, error)
        self.loop.submit(lambda engine: self._drop(engine, pending))
