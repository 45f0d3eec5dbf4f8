"""The Submit stream (node/submit.py, node/front.py) against a real decode node (its
engine's process and its gRPC front): requests many to a message, their chunks by the
Outputs stream, each end as its own call's would be; a cancel and the stream's end stop
the requests they name and free their blocks."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import grpc
import pytest
from serving_helpers import node_address, start, stop

from tandem.engine.sampling_params import SamplingParams
from tandem.node import convert
from tandem.node.submit import CALL_ENDED, Submitter
from tandem.protos import node_pb2 as pb
from tandem.protos import node_pb2_grpc as pb_grpc

NEW_TOKENS = 12
SHORT = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
LONG = SamplingParams(temperature=0.0, max_tokens=2000, ignore_eos=True)


@pytest.fixture(scope="module")
def address():  # noqa: ANN201
    node = start(["node", "--role", "decode", "--model", "tiny", "--load-format", "dummy",
                  "--skip-tokenizer-init", "--num-kv-blocks", "512"])
    try:
        yield node_address(node)
    finally:
        stop([node])


def _msg(rid: str, prompt: list[int], params: SamplingParams) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        request=pb.Request(request_id=rid, prompt_token_ids=prompt,
                           sampling=convert.sampling_to_pb(params)),
        prefill=pb.PrefillPlan(timeout_s=60), subscriber="r1")


class Session:
    """An Outputs stream and a Submitter open on one node, in one asyncio loop."""

    def __init__(self, address: str) -> None:
        self.channel = grpc.aio.insecure_channel(address)
        self.stub = pb_grpc.NodeStub(self.channel)
        self.submitter = Submitter(self.stub, address)
        self.tokens: dict[str, list[int]] = {}
        self.ends: dict[str, object] = {}
        self.finished: dict[str, asyncio.Event] = {}

    async def __aenter__(self) -> Session:
        self.outputs = self.stub.Outputs(pb.OutputsRequest(subscriber="r1"))
        await self.outputs.read()  # open
        self._reading = asyncio.ensure_future(self._read())
        self._running = asyncio.ensure_future(self.submitter.run(lambda: True))
        while not self.submitter.open:
            await asyncio.sleep(0.02)
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._running.cancel()
        self._reading.cancel()
        self.outputs.cancel()
        await self.channel.close()

    async def _read(self) -> None:
        while (batch := await self.outputs.read()) is not grpc.aio.EOF:
            for chunk in batch.chunks:
                self.tokens.setdefault(chunk.request_id, []).extend(chunk.token_ids)
                if chunk.finish_reason:
                    self.finished.setdefault(chunk.request_id, asyncio.Event()).set()

    def submit(self, rid: str, prompt: list[int], params: SamplingParams = SHORT
               ) -> asyncio.Event:
        ended = asyncio.Event()
        self.submitter.submit(_msg(rid, prompt, params), 60.0, self._ended(rid, ended))
        return ended

    def _ended(self, rid: str, event: asyncio.Event) -> Callable[[object], None]:
        def ended(end: object) -> None:
            self.ends[rid] = end
            event.set()
        return ended

    async def stats(self) -> pb.StatsReply:
        return await self.stub.Stats(pb.StatsRequest(), timeout=10)

    async def idle(self, timeout: float = 10.0) -> bool:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while loop.time() < deadline:
            s = await self.stats()
            if (s.num_running, s.num_waiting, s.kv_blocks_free) == (0, 0, s.kv_blocks_total):
                return True
            await asyncio.sleep(0.05)
        return False


def test_submitted_requests_stream_by_outputs_and_end_as_their_calls_would(address) -> None:  # noqa: ANN001
    async def scenario() -> None:
        async with Session(address) as s:
            ended = [s.submit(f"r{i}", [3 + i, 9, 27, 81][: 2 + i % 3]) for i in range(40)]
            bad = s.submit("bad", [5, 10**6])  # a token outside the vocabulary
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in [*ended, bad])), 60)
            assert all(s.ends[f"r{i}"] is CALL_ENDED for i in range(40))
            # Each ended once its last chunk had gone out: every token is here.
            assert all(len(s.tokens[f"r{i}"]) == NEW_TOKENS for i in range(40))
            failure = s.ends["bad"]
            assert isinstance(failure, grpc.aio.AioRpcError)
            assert failure.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "vocabulary" in failure.details()
            assert "bad" not in s.tokens
            assert await s.idle()

    asyncio.run(scenario())


def test_a_cancel_and_the_streams_end_stop_their_requests(address) -> None:  # noqa: ANN001
    async def scenario() -> None:
        async with Session(address) as s:
            kept = s.submit("kept", [1, 2, 3], LONG)
            gone = s.submit("gone", [4, 5, 6], LONG)
            while len(s.tokens.get("gone", [])) < 2 or len(s.tokens.get("kept", [])) < 2:
                await asyncio.sleep(0.02)
            assert (await s.stats()).num_running == 2
            s.submitter.cancel("gone")
            loop = asyncio.get_running_loop()
            deadline = loop.time() + 10
            while (await s.stats()).num_running != 1:
                assert loop.time() < deadline, "the cancelled request runs on"
                await asyncio.sleep(0.05)
            assert not gone.is_set() and not kept.is_set()  # a cancelled one sends no end
            s._running.cancel()  # the Submit stream ends: "kept" stops too
            await asyncio.wait_for(kept.wait(), 10)
            assert s.ends["kept"].code() == grpc.StatusCode.UNAVAILABLE
            assert await s.idle()

    asyncio.run(scenario())


@pytest.fixture(scope="module")
def pair():  # noqa: ANN201
    """A prefill node and a decode node, each with its gRPC front (same dummy weights)."""
    flags = ["--model", "tiny", "--load-format", "dummy", "--skip-tokenizer-init",
             "--num-kv-blocks", "512"]
    prefill = start(["node", "--role", "prefill", *flags])
    decode = start(["node", "--role", "decode", *flags])
    try:
        yield node_address(prefill), node_address(decode)
    finally:
        stop([prefill, decode])


async def _tokens(stub: pb_grpc.NodeStub, msg: pb.GenerateRequest) -> list[int]:
    return [t async for chunk in stub.Generate(msg, timeout=60) for t in chunk.token_ids]


def test_prefills_submitted_to_a_prefill_node_fill_their_sinks_and_end_with_replies(
        pair) -> None:  # noqa: ANN001
    """A decode node's way to its prefill node: Prefill calls with their sinks on one
    stream, each end its call's PrefillReply; the decode node goes on from its first
    token to the tokens it computes alone. A bad request ends as its call would."""
    async def scenario() -> None:
        async with (grpc.aio.insecure_channel(pair[0]) as to_prefill,
                    grpc.aio.insecure_channel(pair[1]) as to_decode):
            prefill, decode = pb_grpc.NodeStub(to_prefill), pb_grpc.NodeStub(to_decode)
            stream = Submitter(prefill, pair[0])
            running = asyncio.ensure_future(stream.run(lambda: True))
            assert await stream.wait_open(10)  # waits for the first try to open it
            loop = asyncio.get_running_loop()
            requests = [pb.Request(request_id=f"p{i}", prompt_token_ids=[3 + i, *range(9, 9 + i)],
                                   sampling=convert.sampling_to_pb(SHORT)) for i in range(24)]
            ends = []
            for request in requests:
                reserved = await decode.Reserve(pb.ReserveRequest(request=request, ttl_s=30),
                                                timeout=10)
                ends.append(loop.create_future())
                stream.submit(pb.PrefillRequest(request=request, sink=reserved.sink), 60.0,
                              ends[-1].set_result)
            bad = loop.create_future()
            stream.submit(pb.PrefillRequest(request=pb.Request(
                request_id="bad", prompt_token_ids=[5, 10**6],
                sampling=convert.sampling_to_pb(SHORT))), 60.0, bad.set_result)
            replies = await asyncio.wait_for(asyncio.gather(*ends), 60)
            assert all(isinstance(r, pb.PrefillReply) and r.kv_bytes > 0 for r in replies)
            failure = await asyncio.wait_for(bad, 60)
            assert isinstance(failure, grpc.aio.AioRpcError)
            assert failure.code() == grpc.StatusCode.INVALID_ARGUMENT
            for request, reply in zip(requests, replies, strict=True):
                pushed = await _tokens(decode, pb.GenerateRequest(
                    request=request, first_token=reply.first_token))
                alone = pb.Request()
                alone.CopyFrom(request)
                alone.request_id = "alone-" + request.request_id
                assert pushed[0] == reply.first_token
                assert pushed == await _tokens(decode, pb.GenerateRequest(request=alone))
                assert len(pushed) == NEW_TOKENS
            running.cancel()
            for stub in (prefill, decode):
                s = await stub.Stats(pb.StatsRequest(), timeout=10)
                assert (s.num_running, s.num_waiting, s.kv_blocks_free) == (
                    0, 0, s.kv_blocks_total)

    asyncio.run(scenario())
