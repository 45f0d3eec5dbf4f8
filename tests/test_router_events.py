"""The router's SSE events of token chunks, made from a per-request template: each is
exactly the OpenAI chunk object, for completions and chat, with and without text, on the
last chunk and before it, with characters JSON must escape."""

from __future__ import annotations

import json

import pytest

from tandem.protos import node_pb2 as pb
from tandem.router.sse import Shape

TEXTS = ["", "Paris", 'a "quoted"\nline\\', "é 東京 \U0001f600", "</s>"]


def _data(event: str) -> dict:
    assert event.startswith("data: ") and event.endswith("\n\n")
    return json.loads(event[len("data: "):])


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("finish", ["", "stop", "length"])
def test_completion_chunk(text: str, finish: str) -> None:
    shape = Shape("cmpl-1", "m", chat=False, created=7)
    chunk = pb.GenerateChunk(text=text, token_ids=[5], finish_reason=finish)
    assert _data(shape.event(chunk)) == {
        "id": "cmpl-1", "object": "text_completion", "created": 7, "model": "m",
        "choices": [{"index": 0, "logprobs": None, "finish_reason": finish or None,
                     "text": text}]}


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("finish", ["", "stop"])
def test_chat_chunk(text: str, finish: str) -> None:
    shape = Shape("chatcmpl-1", "m", chat=True, created=7)
    chunk = pb.GenerateChunk(text=text, finish_reason=finish)
    delta = {"content": text} if text or not finish else {}
    assert _data(shape.event(chunk)) == {
        "id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 7, "model": "m",
        "choices": [{"index": 0, "logprobs": None, "finish_reason": finish or None,
                     "delta": delta}]}


def test_token_ids_without_a_tokenizer() -> None:
    shape = Shape("cmpl-2", "m", chat=False, token_ids=True, created=7)
    event = shape.event(pb.GenerateChunk(token_ids=[3, 4], finish_reason="length"))
    assert _data(event)["choices"] == [{"index": 0, "logprobs": None,
                                        "finish_reason": "length", "text": "",
                                        "token_ids": [3, 4]}]


def test_text_is_not_escaped_to_ascii() -> None:
    event = Shape("cmpl-3", "m", chat=False).event(pb.GenerateChunk(text="東京"))
    assert '"text": "東京"' in event
