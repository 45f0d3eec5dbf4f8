"""One request through the pools (DESIGN.md, request flow, steps 2 to 7), in one call
from the router on the critical path (decode-first):

1. pick a decode node, and a prefill node by the prompt's cached blocks and its queue;
2. call `Generate` on the decode node with a prefill plan naming that prefill node: the
   decode node reserves the prompt's blocks (its prefix cache counts); if the tokens it
   lacks are fewer than `local_prefill_threshold`, it prefills itself, else it calls the
   prefill node, which computes the prompt and pushes its KV into the reserved blocks.
   With `overflow_wait_s`, a prompt that would wait longer than that behind the prompts
   this router has queued on the prefill node (at its measured rate) is computed by the
   decode node instead, where it would start sooner: the decode GPU takes the prefill
   pool's overflow (conditional disaggregation, as Dynamo's decode workers do).
   With `early_prefill`, the router also asks the prefill node to start computing at
   once (a Prefill call without a sink, answered at once), so the compute does not wait
   for the hop to the decode node and its reservation: the decode node's call attaches
   its sink to the prompt under way (SGLang's bootstrap does the same in its own way);
3. stream the tokens the decode node generates, the first as soon as it is sampled:
   they come through this router's `Outputs` stream from that node (one message per
   engine step for all its requests; `NodeClient.follow_outputs`), or in the Generate
   call's own stream while that is not open.

Admission: the decode node comes from `DecodeQueue`, which holds the request, first
come first served, while every decode node is at its limit (429 past its length, 503
`queue_timeout` past its deadline); a node that refuses for want of room sends it back
there.

Failures: a decode node that fails before the first token reached the client is marked
down and the request starts over on another; a prefill node or transfer that fails
leaves the prompt to the decode node (`on_transfer_failure="recompute"`, the default:
its first chunk says so, and a prefill node found unreachable is marked down) or fails
the request ("fail"). A client that goes away, or any other end before the
last token, aborts the request on every node it touched, which frees its blocks.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc

from tandem.engine import trace
from tandem.node.submit import CALL_ENDED, call_end, rpc_error
from tandem.node.timeouts import TIMEOUTS, Timeouts
from tandem.protos import node_pb2 as pb
from tandem.router.admission import DecodeQueue
from tandem.router.index import RouterIndex
from tandem.router.limits import Limits
from tandem.router.metrics import RouterMetrics
from tandem.router.pool import MIN_PULL_TOKENS, Cached, NodeClient, OutputsClosed, Pool
from tandem.router.protocol import APIError

log = logging.getLogger(__name__)

_RETRY_CODES = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
                grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.FAILED_PRECONDITION,
                grpc.StatusCode.CANCELLED, grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL}


# An Abort that got no answer is tried again (the node is unreachable or busy).
_ABORT_RETRY_CODES = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
                      grpc.StatusCode.RESOURCE_EXHAUSTED}
# Early starts only while fewer of this router's requests than this wait for their first
# token on the prefill node: it holds at most as many early starts (prefill_node/role.py's
# MAX_EARLY) and answers the rest "skipped", so a burst's early calls are only work for it.
EARLY_MAX_IN_FLIGHT = 4
_LAST_CHUNK_WAIT_S = 10.0  # a Generate call ended well: its last chunk is on its way


class StreamBroken(Exception):
    """The decode node failed after tokens reached the client: the stream ends in error."""


@dataclass(frozen=True)
class FlowConfig:
    local_prefill_threshold: int = 0  # uncached tokens below this: prefill on the decode node
    overflow_wait_s: float = 0.0  # a longer wait on the prefill node: the decode node's (0: never)
    on_transfer_failure: str = "recompute"  # or "fail"
    early_prefill: bool = True  # start the prefill node's compute while the decode reserves
    prefix_pull: str = "auto"  # pull a prefix a peer holds: auto (by cost), always, never
    max_attempts: int = 3  # decode nodes tried per request (a node with no room is no try)
    max_queued_requests: int = Limits.max_queued_requests
    queue_timeout_s: float = Limits.queue_timeout_s
    timeouts: Timeouts = TIMEOUTS


class Flow:
    def __init__(self, pool: Pool, config: FlowConfig, metrics: RouterMetrics,
                 index: RouterIndex) -> None:
        self.pool, self.config, self.metrics, self.index = pool, config, metrics, index
        self.queue = DecodeQueue(pool, config.max_queued_requests, config.queue_timeout_s)
        metrics.watch_queue(self.queue)
        self._cleanup: set[asyncio.Task] = set()

    async def run(self, request: pb.Request) -> AsyncIterator[pb.GenerateChunk]:
        """The decode node's chunks for `request`. Raises APIError before the first
        chunk (no node, a bad request), StreamBroken after it."""
        tried: set[NodeClient] = set()
        last_error = "no decode node is available"
        began = time.monotonic()
        deadline = began + self.config.queue_timeout_s
        attempts = 0
        while attempts < self.config.max_attempts:
            decode = await self.queue.take(tried, deadline)
            if decode is None:
                break
            started = False
            try:
                async for chunk in self._on(decode, request, began):
                    started = True
                    yield chunk
                return
            except grpc.aio.AioRpcError as exc:
                if exc.code() == grpc.StatusCode.INVALID_ARGUMENT:
                    raise APIError(exc.details() or "invalid request") from None
                if started:
                    raise StreamBroken(f"the decode node failed: {exc.details()}") from None
                if exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                    self.queue.busy(decode)  # no room there now: queue again, no try spent
                    continue
                if exc.code() not in _RETRY_CODES:
                    raise APIError(f"the decode node failed: {exc.details()}", status=500,
                                   kind="server_error") from None
                attempts += 1
                tried.add(decode)
                last_error = f"{decode.name}: {exc.details()}"
                if exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.INTERNAL):
                    # Gone, or its engine failed: nothing more goes there until its
                    # Health says it is alive again.
                    decode.mark_down(exc.details() or exc.code().name)
                self.metrics.retries.labels("decode").inc()
        raise APIError(f"no decode node could serve the request ({last_error})", status=503,
                       kind="service_unavailable", code="no_capacity")

    async def _on(self, decode: NodeClient, request: pb.Request, began: float
                  ) -> AsyncIterator[pb.GenerateChunk]:
        """One call, decode-first: the decode node reserves the prompt's blocks, has the
        prefill node picked here (by the prompt's cached blocks and its queue, or None:
        none is up) compute them, or computes them itself, and streams.
        Its TTFT (since `began`) counts for both nodes, its ITL for the decode node."""
        rid = request.request_id
        cached = await self.index.cached_tokens(request.prompt_token_ids)
        tokens = len(request.prompt_token_ids)
        prefill = self.pool.pick_prefill(tokens, cached, pull=self.config.prefix_pull)
        uncached = tokens - cached.get(decode.address, Cached(0, 0)).tokens
        routed = time.monotonic()
        # A rate for the decode node's prompt queue until it has measured its own.
        rate = prefill.prefill_rate() if prefill is not None else None
        if prefill is not None and self._overflows(prefill, decode, tokens, cached, uncached,
                                                   routed):
            self.metrics.prefill_overflows.inc()
            prefill = None
        computing = prefill or decode
        computing.take_prompt(tokens - cached.get(computing.address, Cached(0, 0)).tokens,
                              computing.prefill_rate() or rate, routed)
        pull = None if prefill is None else self._pull(prefill, cached)
        touched = [decode] if prefill is None else [decode, prefill]
        plan = pb.PrefillPlan(
            address=prefill.address if prefill is not None else "",
            local_prefill_threshold=self.config.local_prefill_threshold,
            timeout_s=self.config.timeouts.prefill_s,
            fail_on_error=self.config.on_transfer_failure == "fail",
            pull=pull,
        )
        finished = False
        queued_s = routed - began  # in this router's queue
        early = (None if prefill is None
                 else self._early(prefill, request, uncached, decode, pull))
        plan.early = early is not None
        if prefill is not None:
            prefill.in_flight += 1
        try:
            previous = None  # when the last chunk went to the client
            seen = False  # the decode node's first chunk
            repeat: _Repeat | None = None  # what that chunk brings again
            chunks = self._generate(decode, pb.GenerateRequest(request=request, prefill=plan))
            async for by_prefill, chunk in _first_from(chunks, early):
                now = time.monotonic()
                if by_prefill:  # the early start's first token, ahead of the decode node's
                    self.metrics.early_first_tokens.inc()
                    repeat = _Repeat(chunk)
                    previous = now
                    yield chunk
                    continue
                if not seen:
                    seen = True
                    self.metrics.queue_time.observe(queued_s + chunk.queued_s)
                    self._count_prefill(rid, chunk, prefill)
                    if early and not chunk.prefilled_by:  # computed on the decode node
                        self._abort(rid, [prefill])
                    self.pool.record_ttft(now - began, decode, prefill)
                    if prefill is not None:
                        prefill.in_flight -= 1
                        prefill = None
                if repeat is not None:
                    repeat.strip(chunk)
                    if repeat.done:
                        repeat = None
                    if not (chunk.token_ids or chunk.text or chunk.finish_reason):
                        continue
                if previous is not None:
                    self.metrics.itl.observe(now - previous)
                    if chunk.token_ids:
                        self.pool.record_itl((now - previous) / len(chunk.token_ids), decode)
                previous = now
                yield chunk
                if chunk.finish_reason:
                    finished = True
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.ABORTED and plan.fail_on_error:
                self.metrics.transfer_failures.inc()
                raise APIError(exc.details() or "prefill failed", status=502,
                               kind="server_error", code="prefill_failed") from None
            raise
        finally:
            self.queue.release(decode)
            if prefill is not None:
                prefill.in_flight -= 1
            if not finished:  # an error, or the client went away: free it everywhere
                self._abort(rid, touched)

    async def _generate(self, decode: NodeClient, msg: pb.GenerateRequest
                        ) -> AsyncIterator[pb.GenerateChunk]:
        """The chunks of one Generate call on `decode`: through this router's Outputs
        stream there while it is open, else in the call's own stream. Raises the call's
        AioRpcError (UNAVAILABLE if the Outputs stream closes first)."""
        self.metrics.streams.labels("outputs" if decode.outputs_open else "call").inc()
        deadline = self.config.timeouts.generate_s  # then the node aborts it
        if not decode.outputs_open:
            async for chunk in decode.stub.Generate(msg, timeout=deadline):
                yield chunk
            return
        rid = msg.request.request_id
        waiting: asyncio.Queue = asyncio.Queue()
        decode.waiting[rid] = waiting  # before the call: no chunk comes earlier
        msg.subscriber = decode.subscriber
        submitter = decode.submitter if decode.submitter and decode.submitter.open else None
        if submitter is not None:
            submitter.submit(msg, deadline, waiting.put_nowait)
            cancel = functools.partial(submitter.cancel, rid)
        else:
            call = decode.start_generate(msg, deadline)
            aio = asyncio.get_running_loop()

            def on_end(call: grpc.Future) -> None:  # on a gRPC thread: its end, or error
                with contextlib.suppress(RuntimeError):  # the router's loop is closed
                    aio.call_soon_threadsafe(waiting.put_nowait, call_end(call))

            call.add_done_callback(on_end)
            cancel = call.cancel
        trace.mark(rid, "router.call")
        finished = False
        held = None  # taken from the queue while merging chunks, not yet handled
        try:
            ended = False
            while True:
                if held is not None:
                    item, held = held, None
                elif not ended:
                    item = await waiting.get()
                else:
                    try:
                        item = await asyncio.wait_for(waiting.get(), _LAST_CHUNK_WAIT_S)
                    except TimeoutError:
                        raise _unavailable("the Generate call ended; its last chunk never "
                                           "came") from None
                if isinstance(item, pb.GenerateChunk):
                    # Chunks that queued while the client's stream was busy go as one.
                    while not item.finish_reason and not waiting.empty():
                        held = waiting.get_nowait()
                        if not isinstance(held, pb.GenerateChunk):
                            break
                        item, held = _merged(item, held), None
                if item is CALL_ENDED:
                    ended = True
                elif isinstance(item, grpc.aio.AioRpcError):
                    raise item
                elif isinstance(item, OutputsClosed):
                    raise _unavailable(item.why)
                else:
                    yield item
                    if item.finish_reason:
                        finished = True
                        return
        finally:
            decode.waiting.pop(rid, None)
            if not finished:  # the node aborts the request when its call is cancelled
                cancel()

    def _overflows(self, prefill: NodeClient, decode: NodeClient, tokens: int,
                   cached: dict[str, Cached], uncached: int, now: float) -> bool:
        """With `overflow_wait_s`: the prompt (`tokens`, `uncached` of them missing on
        `decode`) would be computed later than that on `prefill` (after the prompts this
        router sent there before it, at the rate its steps computed them), and sooner on
        `decode` (the same, at its own rate, or `prefill`'s until it has computed
        prompts). Never before `prefill` has a rate above 0."""
        limit, rate = self.config.overflow_wait_s, prefill.prefill_rate()
        if limit <= 0 or not rate:
            return False
        there = tokens - cached.get(prefill.address, Cached(0, 0)).tokens
        wait_there = prefill.prompt_wait(there, rate, now)
        if wait_there <= limit:
            return False
        return decode.prompt_wait(uncached, decode.prefill_rate() or rate, now) < wait_there

    def _pull(self, prefill: NodeClient, cached: dict[str, Cached]) -> pb.PeerPrefix | None:
        """Where `prefill` should pull the prompt's prefix from: the reachable node that
        holds the most of it, in either tier (ties: a prefill node), if that is at least
        MIN_PULL_TOKENS more than `prefill` holds; with `prefix_pull` auto, only where a
        pulled token costs less than a computed one there."""
        if self.config.prefix_pull == "never":
            return None
        own = cached.get(prefill.address)
        holder = next(((tokens, node) for tokens, _, node in self.pool.peer_prefixes(cached)
                       if node is not prefill), None)
        if holder is None or holder[0] - (own.tokens if own else 0) < MIN_PULL_TOKENS:
            return None
        if self.config.prefix_pull == "auto" and prefill.pull_token_cost() >= 1.0:
            return None
        return pb.PeerPrefix(address=holder[1].address, tokens=holder[0])

    def _early(self, prefill: NodeClient, request: pb.Request, uncached: int,
               decode: NodeClient, pull: pb.PeerPrefix | None) -> asyncio.Task | None:
        """Start the prompt on `prefill` now, in the background (`early_prefill`); not a
        prompt the decode node will compute itself (the index says it lacks fewer than
        the threshold's tokens), nor while requests wait for blocks (in this router's
        queue, or the decode node's, as it last said): the sink would come late, while
        the early prompt holds the prefill node's blocks; nor while EARLY_MAX_IN_FLIGHT
        requests wait for their first token there (a burst). The node may skip it (it is
        busy): the decode node's call starts it then. The task's result: the node's
        reply, which may bring the first token's chunk to send on (None if it failed)."""
        waiting = decode.stats.num_waiting if decode.stats is not None else 0
        if (not self.config.early_prefill or uncached < self.config.local_prefill_threshold
                or self.queue.num_waiting or waiting
                or prefill.in_flight >= EARLY_MAX_IN_FLIGHT):
            return None

        async def start() -> pb.PrefillReply | None:
            try:
                return await prefill.stub.Prefill(
                    pb.PrefillRequest(request=request, first_chunk=True, pull=pull),
                    timeout=self.config.timeouts.prefill_s)
            except grpc.aio.AioRpcError as exc:
                log.debug("early start of %s on %s failed: %s", request.request_id,
                          prefill.name, exc.details())
                return None

        task = asyncio.get_running_loop().create_task(start())
        self._cleanup.add(task)
        task.add_done_callback(self._cleanup.discard)
        self.metrics.early_prefills.inc()
        return task

    def _count_prefill(self, rid: str, chunk: pb.GenerateChunk,
                       prefill: NodeClient | None) -> None:
        """Where the decode node says the prompt was computed, and what failed."""
        self.metrics.requests.labels("prefill" if chunk.prefilled_by else "decode-local").inc()
        if not chunk.prefill_error or prefill is None:
            return
        self.metrics.transfer_failures.inc()
        self.metrics.retries.labels("prefill").inc()
        if chunk.prefill_error_code == "UNAVAILABLE":
            prefill.mark_down(chunk.prefill_error)
        log.warning("prefill of %s failed on %s (%s); the decode node computed it", rid,
                    prefill.name, chunk.prefill_error)

    def _abort(self, rid: str, nodes: list[NodeClient]) -> None:
        """Abort on every node, in the background (the caller may be a cancelled task),
        each tried until the node answers or the longest lease has lapsed: by then the
        node has freed the request's blocks itself."""
        t = self.config.timeouts
        msg = pb.AbortRequest(request_id=rid, reason="router")

        async def abort(node: NodeClient) -> None:
            loop = asyncio.get_running_loop()
            give_up = loop.time() + t.lease_s
            while True:
                try:
                    await node.stub.Abort(msg, timeout=t.control_s)
                    return
                except grpc.aio.AioRpcError as exc:
                    if exc.code() not in _ABORT_RETRY_CODES or loop.time() >= give_up:
                        log.warning("abort of %s on %s failed: %s", rid, node.name,
                                    exc.details())
                        return
                await asyncio.sleep(t.abort_retry_s)

        for node in nodes:
            task = asyncio.get_running_loop().create_task(abort(node))
            self._cleanup.add(task)
            task.add_done_callback(self._cleanup.discard)


async def _first_from(chunks: AsyncIterator[pb.GenerateChunk], early: asyncio.Task | None
                      ) -> AsyncIterator[tuple[bool, pb.GenerateChunk]]:
    """The decode node's `chunks`, (False, chunk) each; and first (True, the early start's
    first-token chunk) if that comes before the decode node's first chunk."""
    if early is None:  # nothing to race: the call starts now, not a loop round later
        try:
            async for chunk in chunks:
                yield False, chunk
        finally:
            await chunks.aclose()  # now, not when the collector finds it (its call ends)
        return
    it = aiter(chunks)
    step = asyncio.ensure_future(anext(it))
    try:
        if early is not None:
            await asyncio.wait((step, early), return_when=asyncio.FIRST_COMPLETED)
            if not step.done():
                reply = early.result()
                if reply is not None and reply.HasField("first_chunk"):
                    yield True, reply.first_chunk
        try:
            chunk = await step
        except StopAsyncIteration:
            return
        yield False, chunk
        async for chunk in it:
            yield False, chunk
    finally:
        if not step.done():
            step.cancel()  # the generator's own cleanup (its call cancelled) runs
            with contextlib.suppress(asyncio.CancelledError, StopAsyncIteration):
                await step
        await it.aclose()


class _Repeat:
    """The first token and text the client has (the early start's), which the decode
    node's first chunks bring again: taken off them, or StreamBroken if they differ (a
    prompt computed again after a failed push, and sampled otherwise)."""

    def __init__(self, sent: pb.GenerateChunk) -> None:
        self.token: int | None = sent.token_ids[0]
        self.text = sent.text

    @property
    def done(self) -> bool:
        return self.token is None and not self.text

    def strip(self, chunk: pb.GenerateChunk) -> None:
        if self.token is not None and chunk.token_ids:
            if chunk.token_ids[0] != self.token:
                raise StreamBroken("the prompt was computed again after its first token was "
                                   "sent, and gave another")
            del chunk.token_ids[0]
            self.token = None
        if self.text:
            n = min(len(self.text), len(chunk.text))
            if chunk.text[:n] != self.text[:n]:
                raise StreamBroken("the decode node's text differs from the first token's")
            chunk.text, self.text = chunk.text[n:], self.text[n:]


def _merged(first: pb.GenerateChunk, then: pb.GenerateChunk) -> pb.GenerateChunk:
    """One chunk of two consecutive ones: their tokens and text, the later's end."""
    text = first.text + then.text
    first.MergeFrom(then)  # repeated fields append; set scalars (the end's) overwrite
    first.text = text
    return first


def _unavailable(why: str) -> grpc.aio.AioRpcError:
    return rpc_error(grpc.StatusCode.UNAVAILABLE, why)
