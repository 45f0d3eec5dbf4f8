"""The Submit stream (router/submit.py, node/front.py) against a real decode node (its
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
from tandem.protos import node_pb2 as pb
from tandem.protos import node_pb2_grpc as pb_grpc
from tandem.router.submit import CALL_ENDED, Submitter

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
