"""The early start's first token, sent to the client ahead of the decode node's first
chunk: which first outputs may go (`sendable_first`), and how the router takes what the
decode node brings again off its chunks (`_Repeat`). The path end to end, real processes:
tests/test_serving_cluster.py."""

from __future__ import annotations

import asyncio

import pytest

from tandem.engine.outputs import RequestOutput
from tandem.engine.sampling_params import SamplingParams
from tandem.prefill_node.role import sendable_first
from tandem.protos import node_pb2 as pb
from tandem.router.flow import StreamBroken, _first_from, _Repeat


def _first(delta: str = " the", finish: str = "length", token: int = 7) -> RequestOutput:
    return RequestOutput(request_id="r", prompt_token_ids=[1, 2], text=delta,
                         token_ids=[token], finish_reason=finish, stop_reason=None,
                         logprobs=None, num_cached_tokens=0, delta=delta)


def test_only_a_first_output_the_decode_node_repeats_whole_may_go_early() -> None:
    plain = SamplingParams(max_tokens=16, temperature=0.7)
    assert sendable_first(plain, _first())
    assert sendable_first(SamplingParams(max_tokens=None), _first())
    assert not sendable_first(plain, _first(finish="stop"))  # EOS or a stop token
    assert not sendable_first(SamplingParams(max_tokens=1), _first())  # it ends there
    assert not sendable_first(SamplingParams(max_tokens=16, stop=["\n"]), _first())
    assert not sendable_first(SamplingParams(max_tokens=16, logprobs=2), _first())
    assert not sendable_first(plain, _first(delta="caf\ufffd"))  # a character unfinished


def _chunk(tokens: list[int], text: str, finish: str = "") -> pb.GenerateChunk:
    return pb.GenerateChunk(request_id="r", token_ids=tokens, text=text, finish_reason=finish)


def test_the_repeated_first_token_and_text_are_taken_off_the_decode_nodes_chunks() -> None:
    repeat = _Repeat(_chunk([7], " the"))
    first = _chunk([7], " th")  # its text held back in part: the rest comes next
    repeat.strip(first)
    assert (list(first.token_ids), first.text, repeat.done) == ([], "", False)
    second = _chunk([8, 9], "e cat")
    repeat.strip(second)
    assert (list(second.token_ids), second.text, repeat.done) == ([8, 9], " cat", True)

    whole = _Repeat(_chunk([7], " the"))
    chunk = _chunk([7, 8], " the cat", finish="length")
    whole.strip(chunk)
    assert (list(chunk.token_ids), chunk.text, chunk.finish_reason, whole.done) == (
        [8], " cat", "length", True)


def test_a_decode_node_that_brings_another_first_token_breaks_the_stream() -> None:
    with pytest.raises(StreamBroken, match="another"):
        _Repeat(_chunk([7], " the")).strip(_chunk([5, 8], " a cat"))
    with pytest.raises(StreamBroken, match="text"):
        _Repeat(_chunk([7], " the")).strip(_chunk([7, 8], " a cat"))


def _merge(early_s: float, node_s: float, chunk: bool = True) -> list[tuple[bool, list[int]]]:
    """What `_first_from` yields when the early reply comes after `early_s` and the
    decode node's first chunk after `node_s` (one event loop: timers fire in order)."""
    async def node() -> object:
        await asyncio.sleep(node_s)
        yield _chunk([7, 8], " the cat")
        yield _chunk([9], " sat", finish="length")

    async def early() -> pb.PrefillReply:
        await asyncio.sleep(early_s)
        return pb.PrefillReply(first_token=7, first_chunk=_chunk([7], " the") if chunk else None)

    async def run() -> list[tuple[bool, list[int]]]:
        task = asyncio.ensure_future(early())
        return [(by, list(c.token_ids)) async for by, c in _first_from(node(), task)]

    return asyncio.run(run())


def test_the_early_chunk_goes_first_only_when_it_comes_first() -> None:
    assert _merge(0.0, 0.05) == [(True, [7]), (False, [7, 8]), (False, [9])]
    assert _merge(0.05, 0.0) == [(False, [7, 8]), (False, [9])]
    assert _merge(0.0, 0.05, chunk=False) == [(False, [7, 8]), (False, [9])]  # not sendable
