"""The router's HTTP API, OpenAI-compatible: `/v1/completions`, `/v1/chat/completions`
(streaming SSE ending in `data: [DONE]`, or one JSON body), `/v1/models`, `/health`,
`/metrics`. It validates and tokenizes here (the chat template too), then hands the
token ids to `Flow`, which runs them through the pools.

Every response carries `X-Request-Id`: the client's, or one made here; the nodes know
the request by it. A rejected request gets the OpenAI error JSON with a 4xx status; an
error after a stream started ends the stream with an error event, then `[DONE]`.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ValidationError

from tandem.engine.sampling_params import SamplingParams
from tandem.engine.tokenizer import Tokenizer
from tandem.node import convert
from tandem.protos import node_pb2 as pb
from tandem.router.flow import Flow, FlowConfig, StreamBroken
from tandem.router.index import RouterIndex
from tandem.router.metrics import RouterMetrics
from tandem.router.pool import Pool
from tandem.router.protocol import APIError, ChatRequest, CompletionRequest

DEFAULT_MAX_TOKENS = 16  # OpenAI's completions default; chat defaults to the context left


@dataclass
class RouterSettings:
    model: str  # the model id clients name
    tokenizer: Tokenizer | None  # None: token ids only (--skip-tokenizer-init)
    prefill: list[str]  # host:port of each prefill node
    decode: list[str]
    flow: FlowConfig = field(default_factory=FlowConfig)
    max_model_len: int = 8192
    index: str = "memory"  # or redis://...: see router/index.py
    vocab_size: int | None = None  # bounds prompt token ids; None: the tokenizer's


def create_app(settings: RouterSettings) -> FastAPI:
    pool = Pool(settings.prefill, settings.decode)
    index = RouterIndex(settings.index, pool, settings.model)
    metrics = RouterMetrics(pool, index)
    flow = Flow(pool, settings.flow, metrics, index)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await pool.start()
        await index.start()
        yield
        await index.close()
        await pool.close()

    app = FastAPI(title="Tandem", lifespan=lifespan)
    app.state.pool, app.state.metrics = pool, metrics

    @app.exception_handler(APIError)
    async def api_error(_: Request, exc: APIError) -> JSONResponse:
        metrics.errors.labels(str(exc.status)).inc()
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.get("/health")
    async def health() -> JSONResponse:
        up = {n.name: n.healthy for n in pool.nodes}
        ok = any(n.healthy for n in pool.decode)
        return JSONResponse({"status": "ok" if ok else "unavailable", "nodes": up},
                            status_code=200 if ok else 503)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": settings.model, "object": "model",
                                            "created": 0, "owned_by": "tandem"}]}

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    vocab_size = settings.vocab_size or (settings.tokenizer.vocab_size
                                         if settings.tokenizer is not None else 0)

    def need_tokenizer(what: str, param: str) -> None:
        # Without a tokenizer there is no text to read or to stop on.
        if settings.tokenizer is None:
            raise APIError(f"this server runs without a tokenizer (--skip-tokenizer-init): "
                           f"{what}", param, "tokenizer_skipped")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        body = await _parse(request, CompletionRequest, settings.model)
        prompt = body.single_prompt()
        if isinstance(prompt, str):
            need_tokenizer("send the prompt as token ids", "prompt")
        if body.stop:
            need_tokenizer("stop strings cannot match; use stop_token_ids", "stop")
        params = body.sampling_params(body.max_tokens, DEFAULT_MAX_TOKENS)
        ids = await asyncio.to_thread(_tokens, settings.tokenizer, prompt, vocab_size)
        return await _respond(request, body, ids, params, chat=False)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        body = await _parse(request, ChatRequest, settings.model)
        need_tokenizer("chat needs a chat template; use /v1/completions with token ids",
                       "messages")
        conversation = body.conversation()
        text = await asyncio.to_thread(settings.tokenizer.apply_chat_template, conversation)
        ids = await asyncio.to_thread(_tokens, settings.tokenizer, text, vocab_size)
        max_tokens = body.max_completion_tokens or body.max_tokens
        room = max(1, settings.max_model_len - len(ids))
        params = body.sampling_params(max_tokens, room)
        return await _respond(request, body, ids, params, chat=True)

    async def _respond(request: Request, body: CompletionRequest | ChatRequest,
                       ids: list[int], params: SamplingParams, chat: bool) -> Response:
        rid = request.headers.get("x-request-id") or f"{'chatcmpl' if chat else 'cmpl'}-" \
            f"{uuid.uuid4().hex}"
        call = pb.Request(request_id=rid, prompt_token_ids=ids,
                          sampling=convert.sampling_to_pb(params))
        started = time.monotonic()
        chunks = flow.run(call)
        try:
            first = await anext(chunks)  # errors before any token are plain HTTP errors
        except StopAsyncIteration:
            raise APIError("the decode node ended the stream early", status=502,
                           kind="server_error") from None
        except StreamBroken as exc:
            raise APIError(str(exc), status=502, kind="server_error") from None
        metrics.ttft.observe(time.monotonic() - started)
        shape = _Shape(rid, settings.model, chat, settings.tokenizer is None)
        headers = {"X-Request-Id": rid}
        if not body.stream:
            return JSONResponse(await _collect(first, chunks, shape, started), headers=headers)
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return StreamingResponse(_sse(first, chunks, shape, include_usage, started),
                                 media_type="text/event-stream", headers=headers)

    async def _collect(first: pb.GenerateChunk, chunks: AsyncIterator[pb.GenerateChunk],
                       shape: _Shape, started: float) -> dict[str, Any]:
        text, ids, last = [first.text], list(first.token_ids), first
        try:
            async for chunk in chunks:
                text.append(chunk.text)
                ids += chunk.token_ids
                last = chunk
        except StreamBroken as exc:
            raise APIError(str(exc), status=502, kind="server_error") from None
        _observe_end(last, started)
        return shape.whole("".join(text), last, ids)

    async def _sse(first: pb.GenerateChunk, chunks: AsyncIterator[pb.GenerateChunk],
                   shape: _Shape, include_usage: bool, started: float) -> AsyncIterator[str]:
        try:
            if shape.chat:
                yield _event(shape.chunk({"role": "assistant", "content": ""}, None))
            last, previous = first, time.monotonic()
            yield _event(shape.delta(first))
            async for chunk in chunks:
                now = time.monotonic()
                metrics.itl.observe(now - previous)
                previous, last = now, chunk
                yield _event(shape.delta(chunk))
            _observe_end(last, started)
            if include_usage:
                yield _event({**shape.chunk(None, None), "choices": [],
                              "usage": _usage(last)})
        except StreamBroken as exc:
            metrics.errors.labels("502").inc()
            yield _event(APIError(str(exc), status=502, kind="server_error").body())
        finally:
            await chunks.aclose()  # a client gone mid-stream: the flow aborts the request
        yield "data: [DONE]\n\n"

    def _observe_end(last: pb.GenerateChunk, started: float) -> None:
        metrics.e2e.observe(time.monotonic() - started)
        metrics.prompt_tokens.inc(last.prompt_tokens)
        metrics.generation_tokens.inc(last.completion_tokens)

    return app


async def _parse(request: Request, model: type[BaseModel], served: str) -> Any:
    raw = await request.body()
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise APIError(f"the body is not valid JSON: {exc}", code="invalid_json") from None
    if not isinstance(data, dict):
        raise APIError("the body must be a JSON object")
    try:
        body = model.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        where = ".".join(str(p) for p in err["loc"])
        param = str(err["loc"][0]) if err["loc"] else None  # the body's field at fault
        raise APIError(f"{where}: {err['msg']}" if where else err["msg"], param) from None
    if body.model != served:
        raise APIError(f"the model {body.model!r} does not exist; this server has "
                       f"{served!r}", "model", "model_not_found")
    if names := body.unsupported():
        raise APIError(f"not supported: {', '.join(names)}", names[0].split(" ")[0],
                       "unsupported_parameter")
    return body


def _tokens(tokenizer: Tokenizer | None, prompt: str | list[int], vocab_size: int
            ) -> list[int]:
    if isinstance(prompt, str):
        assert tokenizer is not None
        return tokenizer.encode(prompt)
    if not all(isinstance(t, int) and 0 <= t < vocab_size for t in prompt):
        raise APIError(f"prompt token ids must be in [0, {vocab_size})", "prompt")
    return list(prompt)


def _usage(last: pb.GenerateChunk) -> dict[str, Any]:
    return {"prompt_tokens": last.prompt_tokens, "completion_tokens": last.completion_tokens,
            "total_tokens": last.prompt_tokens + last.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": last.cached_tokens}}


def _event(data: dict[str, Any]) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


def _finish(reason: str) -> str | None:
    return {"stop": "stop", "length": "length"}.get(reason, reason or None)


@dataclass(frozen=True)
class _Shape:
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

    def delta(self, chunk: pb.GenerateChunk) -> dict[str, Any]:
        finish = _finish(chunk.finish_reason)
        if self.chat:
            return self.chunk({"content": chunk.text} if chunk.text or not finish else {},
                              finish)
        out = self.chunk(chunk.text, finish)
        if self.token_ids:
            out["choices"][0]["token_ids"] = list(chunk.token_ids)
        return out

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
                "usage": _usage(last)}
