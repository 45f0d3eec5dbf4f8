"""The router's HTTP API, OpenAI-compatible: `/v1/completions`, `/v1/chat/completions`
(streaming SSE ending in `data: [DONE]`, or one JSON body), `/v1/models`, `/health`,
`/metrics`. It validates and tokenizes here (the chat template too), then hands the
token ids to `Flow`, which runs them through the pools.

Every request gets an id made here, which the nodes know it by; a client's
`X-Request-Id` is echoed back, never used as a key (two clients may send the same). Every
error status carries the OpenAI error JSON (404, 405, 413 and 500 included); an error
after a stream started ends the stream with an error event, then `[DONE]`. A client that
goes away aborts its request, streaming or not.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException

from tandem.engine import trace
from tandem.engine.sampling_params import SamplingParams
from tandem.engine.tokenizer import Tokenizer
from tandem.node import convert
from tandem.protos import node_pb2 as pb
from tandem.router.admin import Operations, add_admin_routes
from tandem.router.fast_routes import FastRoutes, error_response, internal_error_response
from tandem.router.flow import Flow, FlowConfig, StreamBroken
from tandem.router.guard import Authenticate, ConcurrencyLimit, Credentials
from tandem.router.index import RouterIndex
from tandem.router.limits import Limits
from tandem.router.metrics import RouterMetrics
from tandem.router.planner import Planner, PlannerSettings
from tandem.router.pool import Pool
from tandem.router.protocol import APIError, ChatRequest, CompletionRequest
from tandem.router.sse import DONE, ClientGone, EventStream, Shape, event, until_gone, usage

log = logging.getLogger(__name__)

DEFAULT_MAX_TOKENS = 16  # OpenAI's completions default; chat's is Limits.default_chat_max_tokens


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
    limits: Limits = field(default_factory=Limits)
    credentials: Credentials = field(default_factory=Credentials)
    cluster_secret: bytes | None = None  # every call to a node carries it (node/auth.py)
    nodes: list[str] = field(default_factory=list)  # host:port, role learned from Health
    planner: PlannerSettings = field(default_factory=PlannerSettings)
    # Sampling fields a request leaves unset take these (the model's generation_config).
    generation_defaults: dict[str, float | int] = field(default_factory=dict)


def create_app(settings: RouterSettings) -> FastAPI:
    pool = Pool(settings.prefill, settings.decode, settings.cluster_secret, settings.nodes)
    index = RouterIndex(settings.index, pool, settings.model)
    metrics = RouterMetrics(pool, index)
    flow = Flow(pool, settings.flow, metrics, index)
    ops = Operations(pool)
    planner = Planner(settings.planner, ops.signals, ops.switch,
                      on_action=lambda d: metrics.planner_actions.labels(d.from_role,
                                                                         d.to_role).inc())

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await pool.start()
        await index.start()
        planning = asyncio.create_task(planner.run())
        yield
        planning.cancel()
        await index.close()
        await pool.close()

    app = FastAPI(title="Tandem", lifespan=lifespan)
    app.state.pool, app.state.metrics, app.state.planner = pool, metrics, planner

    @app.exception_handler(HTTPException)  # 404, 405, ...: the same JSON as the rest
    async def http_error(_: Request, exc: HTTPException) -> JSONResponse:
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        error = APIError(str(exc.detail), status=exc.status_code, kind=kind)
        return JSONResponse(error.body(), status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        return JSONResponse(APIError(str(exc.errors()[:1])).body(), status_code=400)

    @app.exception_handler(Exception)
    async def internal_error(_: Request, exc: Exception) -> JSONResponse:
        return internal_error_response(exc)

    def count_error(exc: APIError) -> None:
        metrics.errors.labels(str(exc.status)).inc()

    @app.exception_handler(APIError)
    async def api_error(_: Request, exc: APIError) -> JSONResponse:
        count_error(exc)
        return error_response(exc)

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

    add_admin_routes(app, ops, planner)  # behind the admin token (router/guard.py)

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    limits = settings.limits
    vocab_size = settings.vocab_size or (settings.tokenizer.vocab_size
                                         if settings.tokenizer is not None else 0)

    def need_tokenizer(what: str, param: str) -> None:
        # Without a tokenizer there is no text to read or to stop on.
        if settings.tokenizer is None:
            raise APIError(f"this server runs without a tokenizer (--skip-tokenizer-init): "
                           f"{what}", param, "tokenizer_skipped")

    async def completions(request: Request) -> Response:
        body = await _parse(request, CompletionRequest, settings.model, limits)
        prompt = body.single_prompt()
        if isinstance(prompt, str):
            need_tokenizer("send the prompt as token ids", "prompt")
        if body.stop:
            need_tokenizer("stop strings cannot match; use stop_token_ids", "stop")
        ids = (_tokens(None, prompt, vocab_size) if isinstance(prompt, list)  # checked only
               else await asyncio.to_thread(_tokens, settings.tokenizer, prompt, vocab_size))
        params = body.sampling_params(_max_tokens(len(ids), body.max_tokens, None),
                                      DEFAULT_MAX_TOKENS, settings.generation_defaults)
        return await _respond(request, body, ids, params, chat=False)

    async def chat(request: Request) -> Response:
        body = await _parse(request, ChatRequest, settings.model, limits)
        need_tokenizer("chat needs a chat template; use /v1/completions with token ids",
                       "messages")
        conversation = body.conversation()
        text = await asyncio.to_thread(settings.tokenizer.apply_chat_template, conversation)
        ids = await asyncio.to_thread(_tokens, settings.tokenizer, text, vocab_size)
        asked = body.max_completion_tokens or body.max_tokens
        max_tokens = _max_tokens(len(ids), asked, limits.default_chat_max_tokens)
        params = body.sampling_params(max_tokens, DEFAULT_MAX_TOKENS,
                                      settings.generation_defaults)
        return await _respond(request, body, ids, params, chat=True)

    # Served by FastRoutes; the routes registered with FastAPI too keep the schema and
    # its 405 for another method. The last middleware added runs first: a caller without
    # the key takes no concurrency slot.
    fast = {"/v1/completions": completions, "/v1/chat/completions": chat}
    for path, handler in fast.items():
        app.post(path)(handler)
    app.add_middleware(FastRoutes, routes=fast, on_error=count_error)
    app.add_middleware(ConcurrencyLimit, limit=settings.limits.max_concurrent_requests)
    app.add_middleware(Authenticate, credentials=settings.credentials)

    def _max_tokens(num_prompt: int, asked: int | None, default: int | None) -> int | None:
        """`asked`, refused if the prompt and it do not fit the context; without it,
        `default` cut to the context left (None: the completions default)."""
        room = settings.max_model_len - num_prompt
        if room <= 0:
            raise APIError(f"the prompt has {num_prompt} tokens; the context length is "
                           f"{settings.max_model_len}", "prompt", "context_length_exceeded")
        if asked is not None and asked > room:
            raise APIError(f"this model's context length is {settings.max_model_len} "
                           f"tokens; the prompt has {num_prompt} and max_tokens asks for "
                           f"{asked}", "max_tokens", "context_length_exceeded")
        if asked is None and default is not None:
            return min(default, room)
        return asked if asked is not None else min(DEFAULT_MAX_TOKENS, room)

    async def _respond(request: Request, body: CompletionRequest | ChatRequest,
                       ids: list[int], params: SamplingParams, chat: bool) -> Response:
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"  # never the client's
        call = pb.Request(request_id=rid, prompt_token_ids=ids,
                          sampling=convert.sampling_to_pb(params))
        started = time.monotonic()
        trace.mark(rid, "router.request")
        chunks = flow.run(call)
        try:
            # Errors before any token are plain HTTP errors; a client that leaves while
            # its request is queued or prefilling aborts it everywhere.
            first = await _until_disconnected(request, anext(chunks))
        except StopAsyncIteration:
            raise APIError("the decode node ended the stream early", status=502,
                           kind="server_error") from None
        except StreamBroken as exc:
            raise APIError(str(exc), status=502, kind="server_error") from None
        trace.mark(rid, "router.first_chunk")
        metrics.ttft.observe(time.monotonic() - started)
        shape = Shape(rid, settings.model, chat, settings.tokenizer is None)
        headers = {"X-Request-Id": request.headers.get("x-request-id") or rid}
        if not body.stream:
            whole = await _until_disconnected(request, _collect(first, chunks, shape, started))
            return JSONResponse(whole, headers=headers)
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return EventStream(_sse(first, chunks, shape, include_usage, started), headers)

    async def _collect(first: pb.GenerateChunk, chunks: AsyncIterator[pb.GenerateChunk],
                       shape: Shape, started: float) -> dict[str, Any]:
        text, ids, last = [first.text], list(first.token_ids), first
        try:
            async for chunk in chunks:
                text.append(chunk.text)
                ids += chunk.token_ids
                last = chunk
        except StreamBroken as exc:
            raise APIError(str(exc), status=502, kind="server_error") from None
        finally:
            await chunks.aclose()  # cancelled (the client went away): the flow aborts it
        _observe_end(last, started)
        return shape.whole("".join(text), last, ids)

    async def _sse(first: pb.GenerateChunk, chunks: AsyncIterator[pb.GenerateChunk],
                   shape: Shape, include_usage: bool, started: float) -> AsyncIterator[str]:
        """The stream's events; the last chunk's goes with the usage and `[DONE]`, in
        the one write that ends the response."""
        end = ""
        try:
            role = (event(shape.chunk({"role": "assistant", "content": ""}, None))
                    if shape.chat else "")
            last = first
            if first.finish_reason:  # the last: it ends the stream (below)
                end = role + shape.event(first)
            else:
                yield role + shape.event(first)
            async for chunk in chunks:  # to their end: the flow sees the request finish
                last = chunk
                if chunk.finish_reason:
                    end = shape.event(chunk)
                else:
                    yield shape.event(chunk)
            _observe_end(last, started)
            if include_usage:
                end += event({**shape.chunk(None, None), "choices": [], "usage": usage(last)})
        except StreamBroken as exc:
            metrics.errors.labels("502").inc()
            end += event(APIError(str(exc), status=502, kind="server_error").body())
        finally:
            await chunks.aclose()  # a client gone mid-stream: the flow aborts the request
        yield end + DONE

    def _observe_end(last: pb.GenerateChunk, started: float) -> None:
        metrics.e2e.observe(time.monotonic() - started)
        metrics.prompt_tokens.inc(last.prompt_tokens)
        metrics.generation_tokens.inc(last.completion_tokens)

    return app


async def _parse(request: Request, model: type[BaseModel], served: str, limits: Limits
                 ) -> Any:
    raw = await _body(request, limits.max_body_bytes)
    try:
        data = json.loads(raw)
    except ValueError as exc:  # not JSON, not UTF-8, or an integer of too many digits
        raise APIError(f"the body is not valid JSON: {exc}", code="invalid_json") from None
    except RecursionError:
        raise APIError("the body is nested too deeply", code="invalid_json") from None
    if not isinstance(data, dict):
        raise APIError("the body must be a JSON object")
    _check_text(data)
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
    body.check_stop(limits)
    return body


async def _body(request: Request, limit: int) -> bytes:
    """The request body, refused with 413 once it passes `limit` bytes (read no further)."""
    too_big = APIError(f"the request body is larger than {limit} bytes", status=413,
                       code="request_too_large")
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise too_big
    parts, size = [], 0
    async for part in request.stream():
        size += len(part)
        if size > limit:
            raise too_big
        parts.append(part)
    return b"".join(parts)


def _check_text(data: dict[str, Any]) -> None:
    """Every string in the body must be valid Unicode: JSON can carry lone UTF-16
    surrogates (\\ud800), which no tokenizer or protobuf string can."""
    todo: list[tuple[str, Any]] = [(key, value) for key, value in data.items()]
    while todo:
        key, value = todo.pop()
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                raise APIError(f"{key} is not valid Unicode (a lone surrogate)", key) from None
        elif isinstance(value, dict):
            todo += [(key, v) for v in value.values()]
        elif isinstance(value, list):  # a prompt of token ids: nothing to look at
            todo += [(key, v) for v in value if not isinstance(v, int)]


async def _until_disconnected(request: Request, work: Any) -> Any:
    """Await `work` (a coroutine); cancelled, and 499, the moment the client goes away."""
    try:
        return await until_gone(request.receive, work)
    except ClientGone:
        raise APIError("the client went away", status=499, code="client_closed") from None


def _tokens(tokenizer: Tokenizer | None, prompt: str | list[int], vocab_size: int
            ) -> list[int]:
    if isinstance(prompt, str):
        assert tokenizer is not None
        return tokenizer.encode(prompt)
    if not all(isinstance(t, int) and 0 <= t < vocab_size for t in prompt):
        raise APIError(f"prompt token ids must be in [0, {vocab_size})", "prompt")
    return list(prompt)
