"""The router's doors, as ASGI middleware around the whole app (so unknown routes are
guarded too, and a refusal costs no routing):

- `Authenticate`: with an API key, every route but `/health` (and `/metrics`, unless
  protected) needs `Authorization: Bearer <key>`; routes under `/admin/` need the admin
  token instead, never the API key, and are closed while no admin token is set. Both are
  compared in constant time; a refusal is 401 (403 for a closed admin API, or for the
  API key sent to it) with the OpenAI error JSON.
- `ConcurrencyLimit`: at most `limit` completion requests in flight (a stream counts
  until its last byte); more get 429 with `Retry-After`.
"""

from __future__ import annotations

import hmac
import json
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass
from typing import Any

from tandem.router.protocol import APIError

Scope = MutableMapping[str, Any]
ASGIApp = Callable[[Scope, Callable[[], Awaitable[Any]], Callable[[Any], Awaitable[None]]],
                   Awaitable[None]]

ADMIN_PREFIX = "/admin/"
COMPLETION_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})
RETRY_AFTER_S = 1  # what a 429 asks a client to wait


@dataclass(frozen=True)
class Credentials:
    api_key: str | None = None  # None: the OpenAI routes are open
    admin_token: str | None = None  # None: the admin routes are closed
    protect_metrics: bool = False  # /metrics needs the API key too


class Authenticate:
    def __init__(self, app: ASGIApp, credentials: Credentials) -> None:
        self.app, self.credentials = app, credentials

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or (self.credentials.api_key is None
                                       and not scope["path"].startswith(ADMIN_PREFIX)):
            return await self.app(scope, receive, send)  # open: no header to look at
        error = self._check(scope["path"], _bearer(scope))
        if error is None:
            return await self.app(scope, receive, send)
        await _send_error(send, error, {"www-authenticate": "Bearer"})

    def _check(self, path: str, given: bytes | None) -> APIError | None:
        c = self.credentials
        if path.startswith(ADMIN_PREFIX):
            if c.admin_token is None:
                return APIError("the admin API is closed: start the router with "
                                "--admin-token", status=403, code="admin_api_closed")
            refused = _verify(given, c.admin_token, "admin token")
            if refused is not None and c.api_key is not None and given is not None and (
                    hmac.compare_digest(given, c.api_key.encode())):
                return APIError("the API key does not open the admin API: send the admin "
                                "token", status=403, code="api_key_not_admin")
            return refused
        if c.api_key is None or path == "/health" or (
                path == "/metrics" and not c.protect_metrics):
            return None
        return _verify(given, c.api_key, "API key")


class ConcurrencyLimit:
    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app, self.limit = app, limit
        self.in_flight = 0  # on the event loop only: no lock

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        counted = (scope["type"] == "http" and self.limit > 0
                   and scope["path"] in COMPLETION_PATHS)
        if not counted:
            return await self.app(scope, receive, send)
        if self.in_flight >= self.limit:
            error = APIError(f"more than {self.limit} requests are in flight; retry later",
                             status=429, kind="rate_limit_error", code="too_many_requests")
            return await _send_error(send, error, {"retry-after": str(RETRY_AFTER_S)})
        self.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.in_flight -= 1


def _bearer(scope: Scope) -> bytes | None:
    for name, value in scope.get("headers", ()):
        if name == b"authorization":
            scheme, _, credential = value.partition(b" ")
            return credential.strip() if scheme.lower() == b"bearer" else None
    return None


def _verify(given: bytes | None, expected: str, what: str) -> APIError | None:
    if given is not None and hmac.compare_digest(given, expected.encode()):
        return None
    message = (f"no {what} given: send Authorization: Bearer <{what}>" if given is None
               else f"the {what} is not valid")
    return APIError(message, status=401, code="invalid_api_key" if what == "API key"
                    else "invalid_admin_token")


async def _send_error(send: Any, error: APIError, headers: dict[str, str]) -> None:
    body = json.dumps(error.body()).encode()
    raw = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
           *((k.encode(), v.encode()) for k, v in headers.items())]
    await send({"type": "http.response.start", "status": error.status, "headers": raw})
    await send({"type": "http.response.body", "body": body})
