"""The completion routes, served straight from the ASGI call: every request of a burst and
every chunk of its stream pass through them, and FastAPI's way to an endpoint (its
exception, telemetry, body-limit and exit-stack middleware, the route table's matching,
the dependency solving) is a dozen coroutine layers on each request and two wrappers on
each chunk sent. `FastRoutes` sits inside the router's guards (router/guard.py), so a
request here has passed the same doors; anything it does not serve (another path, another
method) goes on to FastAPI, whose routes keep the OpenAPI schema and answer 405 for a GET.

A handler takes the Starlette `Request` and returns a `Response`; an `APIError` it
raises becomes the OpenAI error JSON with its status (`error_response`, which FastAPI's
handler for APIError uses too), anything else a logged 500 with the same JSON.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi.responses import JSONResponse
from starlette.requests import Request
from starlette.responses import Response

from tandem.router.guard import RETRY_AFTER_S, ASGIApp, Scope
from tandem.router.protocol import APIError

log = logging.getLogger(__name__)

Handler = Callable[[Request], Awaitable[Response]]


def error_response(exc: APIError) -> JSONResponse:
    """The OpenAI error JSON of `exc`; no capacity now (the queue full, every node down, a
    deadline passed in the queue) asks the client to retry soon."""
    headers = {"Retry-After": str(RETRY_AFTER_S)} if exc.status in (429, 503) else None
    return JSONResponse(exc.body(), status_code=exc.status, headers=headers)


def internal_error_response(exc: Exception) -> JSONResponse:
    """A 500 for an unexpected failure, logged with its trace."""
    log.exception("request failed", exc_info=exc)
    error = APIError(f"internal error: {type(exc).__name__}", status=500, kind="server_error")
    return JSONResponse(error.body(), status_code=500)


class FastRoutes:
    def __init__(self, app: ASGIApp, routes: dict[str, Handler],
                 on_error: Callable[[APIError], None]) -> None:
        """`routes`: POST handlers by path; `on_error(exc)` counts each APIError answered."""
        self.app, self.routes, self.on_error = app, routes, on_error

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        handler = (self.routes.get(scope["path"])
                   if scope["type"] == "http" and scope["method"] == "POST" else None)
        if handler is None:
            return await self.app(scope, receive, send)
        try:
            response = await handler(Request(scope, receive))
        except APIError as exc:
            self.on_error(exc)
            response = error_response(exc)
        except Exception as exc:  # noqa: BLE001 - the client gets a 500, the log the trace
            response = internal_error_response(exc)
        await response(scope, receive, send)
