"""Decode-first (DESIGN.md, request flow, steps 3 to 6): one Generate call drives its
request through the decode role's stages, on the node's asyncio loop:

    wait in the prealloc queue for the prompt's blocks   (the call's deadline bounds it)
    call the plan's prefill node (on this node's one Submit stream to it, node/submit.py):
        it computes the prompt and pushes its KV into the sink
    wait for the first token (the push's end frame brings it, after the KV, ahead of the
        prefill node's reply), then decode in the running batch

A prompt whose uncached tokens are fewer than the plan's threshold, a plan that names no
prefill node, and a prefill node that fails (unless the plan says to fail then) are
computed here instead, in the engine's own waiting queue. Whatever ends the call early
(its client, an Abort, an error) is the caller's to clean up: `DecodeRole.abort`.
"""

from __future__ import annotations

import asyncio
import logging
import math
from concurrent.futures import Future

import grpc

from tandem.decode_node.role import DecodeRole, Reservation
from tandem.engine import trace
from tandem.engine.llm_engine import LLMEngine
from tandem.engine.request import Request
from tandem.kvtransfer.connector import TransferError
from tandem.node import auth, convert
from tandem.node.aio import Bridge, engine_call
from tandem.node.loop import Listener
from tandem.node.submit import Submitter, rpc_error
from tandem.node.timeouts import Timeouts
from tandem.protos import node_pb2 as pb
from tandem.protos import node_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

STREAM_IDLE_S = 60.0  # a prefill node's Submit stream is not opened again once unasked this long
STREAM_OPEN_S = 1.0  # a Prefill waits this long for its node's stream to open
STREAM_GRACE_S = 2.0  # past a submitted Prefill's timeout, before it is given up here


class QueueTimeout(Exception):
    """The call's deadline passed while it waited for KV blocks."""


class PrefillFailed(Exception):
    """The prefill node failed and the plan says to fail (or the request is invalid)."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code = code


class Driver:
    def __init__(self, role: DecodeRole, timeouts: Timeouts, connector_name: str,
                 secret: bytes | None, bridge: Bridge) -> None:
        self.role, self.timeouts, self.bridge = role, timeouts, bridge
        self.connector_name, self.secret = connector_name, secret
        self._peers: dict[str, auth.AuthedStub] = {}  # prefill nodes and others, by address
        self._channels: list[grpc.aio.Channel] = []
        # A Submit stream to each prefill node asked lately (node/submit.py), its task,
        # and when it was last asked.
        self._streams: dict[str, tuple[Submitter, asyncio.Task]] = {}
        self._asked: dict[str, float] = {}

    async def run(self, req: Request, msg: pb.Request, plan: pb.PrefillPlan | None,
                  first_token: int | None, listener: Listener, head: pb.GenerateChunk,
                  deadline_s: float | None) -> None:
        """Start `req` decoding, its outputs to `listener`; `head` gets the first chunk's
        fields before any output. With `first_token`, its KV was reserved (Reserve) and
        pushed (Prefill) already. Raises ValueError, QueueTimeout, PrefillFailed,
        TransferError."""
        rid = req.request_id
        if first_token is not None:
            await self._arrival(self.role.arrival(rid), self.timeouts.transfer_grace_s)
            await self.bridge.wrap(self.role.start(rid, first_token, listener))
            return
        if plan is None or not plan.address or await self._small(req, plan):
            await self._compute_here(req, listener)
            return
        timeout = _prefill_timeout(plan, self.timeouts)
        trace.mark(rid, "decode.reserve")
        made = await self._reserve(req, timeout + self.timeouts.transfer_grace_s, deadline_s)
        trace.mark(rid, "decode.reserved")
        head.queued_s = made.queued_s
        first = await self._first_token(msg, plan, made, timeout, head)
        trace.mark(rid, "decode.first_token")
        if first is not None:
            try:
                await self._arrival(made.arrival, self.timeouts.transfer_grace_s)
                trace.mark(rid, "decode.arrived")
                head.prefilled_by = plan.address  # before the first output is made
                await self.bridge.wrap(self.role.start(rid, first, listener))
                return
            except TransferError as exc:  # the push said done, yet the sink failed
                if plan.fail_on_error:
                    raise
                head.prefilled_by = ""
                head.prefill_error, head.prefill_error_code = str(exc), "ABORTED"
        await self._compute_here(req, listener)

    async def _compute_here(self, req: Request, listener: Listener) -> None:
        """In its reserved blocks, if it holds any (its sink failed first: that may wait
        for a write in flight, so off this loop)."""
        if self.role.agent.holds(req.request_id):
            await asyncio.to_thread(self.role.drop_sink, req.request_id)
        trace.mark(req.request_id, "decode.compute_here")
        await self.bridge.wrap(self.role.compute_here(req, listener))

    async def close(self) -> None:
        for _, task in self._streams.values():
            task.cancel()
        for channel in self._channels:
            await channel.close()

    async def _small(self, req: Request, plan: pb.PrefillPlan) -> bool:
        """Fewer uncached tokens than the plan's threshold: not worth a transfer. Never
        for an early start (the router may have sent its first token on)."""
        if plan.local_prefill_threshold <= 0 or plan.early:
            return False

        def cached(e: LLMEngine) -> int:
            return e.cached_prompt_tokens(req)

        uncached = req.num_prompt_tokens - await engine_call(self.role.loop, cached)
        return uncached < plan.local_prefill_threshold

    async def _reserve(self, req: Request, ttl_s: float, deadline_s: float | None
                       ) -> Reservation:
        """Wait in the prealloc queue until the prompt's blocks are reserved."""
        limit = self.timeouts.generate_s if deadline_s is None else deadline_s
        queued = self.role.enqueue(req, ttl_s)
        try:
            return await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(queued)), limit)
        except TimeoutError:
            raise QueueTimeout(f"waited {limit:.3g}s for {req.num_prompt_tokens} prompt "
                               f"tokens' KV blocks") from None

    async def _first_token(self, msg: pb.Request, plan: pb.PrefillPlan, made: Reservation,
                           timeout: float, head: pb.GenerateChunk) -> int | None:
        """The prompt's first token from whichever comes first: the push's end frame (the
        KV is in by then) or the prefill node's reply; None as `_prefill`. The reply that
        comes after the end frame is only awaited, so its call ends cleanly."""
        reply = asyncio.ensure_future(self._prefill(msg, plan, made, timeout, head))
        early = asyncio.wrap_future(made.first_token)
        try:
            await asyncio.wait((reply, early), return_when=asyncio.FIRST_COMPLETED)
        except BaseException:
            reply.cancel()
            raise
        finally:
            early.cancel()  # a sender that never sends it, or it came
        if early.done() and not early.cancelled() and early.exception() is None:
            if not reply.done():
                reply.add_done_callback(_ignore_late)
            return early.result()
        return await reply

    async def _prefill(self, msg: pb.Request, plan: pb.PrefillPlan, made: Reservation,
                       timeout: float, head: pb.GenerateChunk) -> int | None:
        """The prefill node's first token; None when it failed and the prompt is to be
        computed here (`head` says why)."""
        sink = convert.sink_to_pb(made.sink, made.first_block, self.connector_name)
        call = pb.PrefillRequest(request=msg, sink=sink,
                                 pull=plan.pull if plan.HasField("pull") else None)
        stream = self._stream(plan.address)
        try:
            submit = await stream.wait_open(STREAM_OPEN_S)
            trace.mark(msg.request_id, "decode.prefill_call")
            if submit:
                reply = await _submitted(stream, call, timeout)
            else:  # a node that serves no Submit stream, or it failed to open
                reply = await self.peer(plan.address).Prefill(call, timeout=timeout)
            return reply.first_token
        except grpc.aio.AioRpcError as exc:
            code, details = exc.code(), exc.details() or exc.code().name
        if code == grpc.StatusCode.INVALID_ARGUMENT:
            raise PrefillFailed(code, f"prefill failed on {plan.address}: {details}")
        if plan.fail_on_error:
            raise PrefillFailed(grpc.StatusCode.ABORTED,
                                f"prefill failed on {plan.address}: {details}")
        log.warning("prefill of %s failed on %s (%s: %s); computing it here",
                    msg.request_id, plan.address, code.name, details)
        head.prefill_error, head.prefill_error_code = details, code.name
        return None

    @staticmethod
    async def _arrival(arrival: Future[None], timeout_s: float) -> None:
        if arrival.done():  # the usual case: the KV landed before the prefill's reply came
            arrival.result()  # its TransferError, if the sink failed
            return
        try:
            await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(arrival)), timeout_s)
        except TimeoutError:
            raise TransferError(f"the KV did not arrive within {timeout_s:g}s") from None

    def _stream(self, address: str) -> Submitter:
        """The Submit stream to the prefill node at `address`, opened in the background
        on the first call there and kept while calls come (`STREAM_IDLE_S`)."""
        loop = asyncio.get_running_loop()
        self._asked[address] = loop.time()
        got = self._streams.get(address)
        if got is None:
            def wanted() -> bool:
                return loop.time() - self._asked[address] < STREAM_IDLE_S

            stream = Submitter(self.peer(address), address)
            got = self._streams[address] = (stream, asyncio.ensure_future(stream.run(wanted)))
        return got[0]

    def peer(self, address: str) -> auth.AuthedStub:
        """A client of the prefill node at `address`, its channel kept for later calls."""
        stub = self._peers.get(address)
        if stub is None:
            channel = grpc.aio.insecure_channel(address)
            self._channels.append(channel)
            stub = self._peers[address] = auth.AuthedStub(pb_grpc.NodeStub(channel),
                                                          self.secret)
        return stub


async def _submitted(stream: Submitter, call: pb.PrefillRequest, timeout: float
                     ) -> pb.PrefillReply:
    """`call`'s reply by `stream`, or the AioRpcError its own call would have raised;
    cancelled, the prefill node's request is cancelled too."""
    ended: asyncio.Future = asyncio.get_running_loop().create_future()
    stream.submit(call, timeout, lambda end: ended.done() or ended.set_result(end))
    try:  # the node ends it at `timeout`; the grace is for a node that stopped answering
        end = await asyncio.wait_for(ended, timeout + STREAM_GRACE_S)
    except TimeoutError:
        stream.cancel(call.request.request_id)
        raise rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded") from None
    except asyncio.CancelledError:
        stream.cancel(call.request.request_id)
        raise
    if isinstance(end, grpc.aio.AioRpcError):
        raise end
    return end


def _ignore_late(reply: asyncio.Future[int | None]) -> None:
    """A Prefill reply after its end frame's token started the decode: nothing waits for
    it, but its exception must be retrieved."""
    if not reply.cancelled():
        reply.exception()


def _prefill_timeout(plan: pb.PrefillPlan, timeouts: Timeouts) -> float:
    """The Prefill call's deadline: the plan's, at most the node's limit."""
    limit = timeouts.prefill_s
    return min(plan.timeout_s, limit) if 0 < plan.timeout_s < math.inf else limit
