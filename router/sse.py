"""The router's response bodies: a request's chunks as OpenAI objects, whole or as
server-sent events, and the streaming response that writes the events.

Every token of every stream passes through `Shape.event` and `EventStream`, so both do
the least per event: the event is a per-request template completed with the chunk's
fields (never an object built and encoded whole), and the stream hands each event to
the server as it comes, watching for the client's disconnect in a second task rather
than polling for it.
"""

from __future__ import annotations

import asyncio
import functools
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from starlette.responses import Response

from tandem.protos import node_pb2 as pb

T = TypeVar("T")
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]

_encode = json.JSONEncoder(ensure_ascii=False).encode  # json.dumps makes one per call
_FINISH_JSON = {"": "null", "stop": '"stop"', "length": '"length"'}


class ClientGone(Exception):
    """The client closed its connection."""


async def until_gone(receive: Receive, work: Awaitable[T]) -> T:
    """`work`'s result, awaited in this task; it is cancelled, and ClientGone raised, the
    moment the client goes away first (the request's body is read: its next ASGI message
    is the disconnect). The disconnect is watched by a second task, so `work` starts at
    once: a task of its own would wait its turn behind everything else ready on the loop
    (in a burst, a whole round of the other requests' handlers)."""
    this = asyncio.current_task()
    assert this is not None, "until_gone runs in a task"
    left = waiting = False

    def on_gone(watch: asyncio.Future) -> None:  # may run after `work` ended: `waiting`
        nonlocal left
        if waiting and not watch.cancelled() and watch.exception() is None:
            left = True
            this.cancel()

    gone = asyncio.ensure_future(_disconnected(receive))
    gone.add_done_callback(on_gone)
    waiting = True
    try:
        return await work
    except asyncio.CancelledError:
        if not left:
            raise  # this caller was cancelled, not by the client's leaving
        this.uncancel()
        raise ClientGone from None
    finally:
        waiting = False
        gone.cancel()


async def _disconnected(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


DONE = "data: [DONE]\n\n"  # a stream's last event


class EventStream(Response):
    """A 200 `text/event-stream` response of the texts `events` yields, each sent as
    it comes; one that ends with `DONE` ends the response in the same write. When the
    client goes away the stream stops and `events` is closed (its `finally` runs: the
    request is aborted upstream)."""

    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[str], headers: dict[str, str]) -> None:
        self.events, self.status_code, self.background = events, 200, None
        self.init_headers(headers)

    async def __call__(self, scope: dict[str, Any], receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": 200,
                    "headers": self.raw_headers})
        try:
            await until_gone(receive, self._stream(send))
        except ClientGone:
            pass

    async def _stream(self, send: Send) -> None:
        try:
            async for event in self.events:
                last = event.endswith(DONE)
                await send({"type": "http.response.body", "body": event.encode(),
                            "more_body": not last})
                if last:
                    return
        finally:
            await self.events.aclose()
        await send({"type": "http.response.body", "body": b"", "more_body": False})


def usage(last: pb.GenerateChunk) -> dict[str, Any]:
    return {"prompt_tokens": last.prompt_tokens, "completion_tokens": last.completion_tokens,
            "total_tokens": last.prompt_tokens + last.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": last.cached_tokens}}


def event(data: dict[str, Any]) -> str:
    return f"data: {_encode(data)}\n\n"


def _finish(reason: str) -> str | None:
    return {"stop": "stop", "length": "length"}.get(reason, reason or None)


@dataclass(frozen=True)
class Shape:
    """The response objects of one request, completion or chat."""

    rid: str
    model: str
    chat: bool
    token_ids: bool = False  # no tokenizer: each choice carries its token ids
    created: int = field(default_factory=lambda: int(time.time()))

    def chunk(self, delta: dict[str, Any] | str | None, finish: str | None) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": finish}
        if self.chat:
            choice["delta"] = delta or {}
        else:
            choice["text"] = delta or ""
        return {"id": self.rid, "object": "chat.completion.chunk" if self.chat
                else "text_completion", "created": self.created, "model": self.model,
                "choices": [choice]}

    def event(self, chunk: pb.GenerateChunk) -> str:
        """The SSE event of a token chunk, from the request's template. Chat: the delta
        has the text (none on a last chunk without text)."""
        reason = chunk.finish_reason
        finish = _FINISH_JSON.get(reason) or _encode(reason)
        if self.chat:
            delta = (f'{{"content": {_encode(chunk.text)}}}' if chunk.text or not reason
                     else "{}")
            tail = f'"delta": {delta}'
        else:
            tail = f'"text": {_encode(chunk.text)}'
            if self.token_ids:
                tail += f', "token_ids": {list(chunk.token_ids)}'
        return f'{self._head}{finish}, {tail}}}]}}\n\n'

    @functools.cached_property
    def _head(self) -> str:
        """A chunk's event up to its choice's finish_reason."""
        text = event(self.chunk(None, None))
        return text[: text.rindex('"finish_reason": ') + len('"finish_reason": ')]

    def whole(self, text: str, last: pb.GenerateChunk, token_ids: list[int]) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0, "logprobs": None,
                                  "finish_reason": _finish(last.finish_reason)}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
            if self.token_ids:
                choice["token_ids"] = token_ids
        return {"id": self.rid, "object": "chat.completion" if self.chat else "text_completion",
                "created": self.created, "model": self.model, "choices": [choice],
                "usage": usage(last)}
