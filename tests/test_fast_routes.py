"""router/fast_routes.py: the completion routes' handlers answer straight from the ASGI
call, their errors as the OpenAI error JSON; every other path and method goes on."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from tandem.router.fast_routes import FastRoutes
from tandem.router.protocol import APIError


def _call(app: Any, method: str, path: str, body: bytes = b"") -> tuple[int, dict, Any]:
    """One HTTP request through `app`: its status, headers and JSON body."""
    sent: list[dict[str, Any]] = []
    messages = [{"type": "http.request", "body": body, "more_body": False}]

    async def receive() -> dict[str, Any]:
        if messages:
            return messages.pop(0)
        await asyncio.Event().wait()  # no disconnect: the response ends first
        raise AssertionError

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {"type": "http", "method": method, "path": path, "headers": [],
             "query_string": b""}
    asyncio.run(app(scope, receive, send))
    start, *bodies = sent
    headers = {k.decode(): v.decode() for k, v in start["headers"]}
    return start["status"], headers, json.loads(b"".join(m["body"] for m in bodies))


async def _echo(request: Request) -> Response:
    body = json.loads(await request.body())
    if body.get("fail") == "busy":
        raise APIError("the queue is full", status=429, kind="rate_limit_error")
    if body.get("fail") == "bug":
        raise KeyError("oops")
    return JSONResponse({"echo": body})


async def _fallback(scope: dict[str, Any], receive: Any, send: Any) -> None:
    await JSONResponse({"fallback": [scope["method"], scope["path"]]})(scope, receive, send)


def _app() -> tuple[FastRoutes, list[APIError]]:
    errors: list[APIError] = []
    return FastRoutes(_fallback, {"/v1/completions": _echo}, errors.append), errors


def test_a_post_to_a_fast_route_is_answered_by_its_handler_the_rest_go_on() -> None:
    app, errors = _app()
    assert _call(app, "POST", "/v1/completions", b'{"a": 1}')[::2] == (200, {"echo": {"a": 1}})
    assert _call(app, "GET", "/v1/completions")[::2] == (
        200, {"fallback": ["GET", "/v1/completions"]})
    assert _call(app, "POST", "/v1/models")[::2] == (200, {"fallback": ["POST", "/v1/models"]})
    assert errors == []


def test_a_handlers_api_error_is_the_openai_error_json_and_is_counted() -> None:
    app, errors = _app()
    status, headers, body = _call(app, "POST", "/v1/completions", b'{"fail": "busy"}')
    assert status == 429 and headers["retry-after"] == "1"
    assert body == {"error": {"message": "the queue is full", "type": "rate_limit_error",
                              "param": None, "code": None}}
    assert [e.status for e in errors] == [429]


def test_a_handlers_unexpected_failure_is_a_500_with_the_error_json(caplog) -> None:
    app, errors = _app()
    status, _, body = _call(app, "POST", "/v1/completions", b'{"fail": "bug"}')
    assert status == 500
    assert body["error"]["message"] == "internal error: KeyError"
    assert body["error"]["type"] == "server_error"
    assert "request failed" in caplog.text and errors == []
