"""The router's admin API (`/admin/v1`, notes/admin_api.md) over the standard library: one
method per route, answering the route's JSON, or raising `RouterError` (the router said
no) or `Unreachable` (no answer at all)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from urllib.parse import quote, urlencode

if TYPE_CHECKING:
    from urllib.error import HTTPError

Json = dict[str, Any]

# A call that waits on the router (a drain, a role switch) gets its own wait plus this
# much before the HTTP read gives up, so the router always answers first.
WAIT_MARGIN_S = 15.0


class RouterError(Exception):
    """The router answered with an error status; `message` and `code` come from its
    OpenAI error JSON (`code` None when it had none)."""

    def __init__(self, message: str, code: str | None, status: int) -> None:
        super().__init__(message)
        self.message, self.code, self.status = message, code, status


class Unreachable(Exception):
    """No answer from the router: refused, unknown host, a broken connection, a timeout."""


@dataclass(frozen=True)
class AdminClient:
    router: str  # base URL, without a trailing slash
    token: str | None  # None: send no Authorization header
    timeout_s: float

    def nodes(self) -> Json:
        return self._call("GET", "/nodes")

    def add_node(self, address: str, role: str | None) -> Json:
        return self._call("POST", "/nodes", {"address": address, "role": role})

    def remove_node(self, address: str, force: bool, timeout_s: float) -> Json:
        query = urlencode({"force": "true" if force else "false", "timeout_s": timeout_s})
        return self._call("DELETE", f"{_node(address)}?{query}",
                          wait_s=None if force else timeout_s)

    def drain(self, address: str) -> Json:
        return self._call("POST", f"{_node(address)}/drain")

    def undrain(self, address: str) -> Json:
        return self._call("POST", f"{_node(address)}/undrain")

    def set_role(self, address: str, role: str, timeout_s: float) -> Json:
        return self._call("POST", f"{_node(address)}/role",
                          {"role": role, "timeout_s": timeout_s}, wait_s=timeout_s)

    def planner(self) -> Json:
        return self._call("GET", "/planner")

    def set_planner(self, settings: Json) -> Json:
        return self._call("PUT", "/planner", settings)

    def _call(self, method: str, path: str, body: Json | None = None,
              wait_s: float | None = None) -> Json:
        # Imported here: `tandem --help` builds this CLI and should not pay for urllib.
        import http.client
        import urllib.error
        import urllib.request

        headers = {"Accept": "application/json"}
        data = None if body is None else json.dumps(body).encode()
        if data is not None:
            headers["Content-Type"] = "application/json"
        if self.token is not None:
            headers["Authorization"] = f"Bearer {self.token}"
        request = urllib.request.Request(f"{self.router}/admin/v1{path}", data, headers,
                                         method=method)
        timeout = self.timeout_s if wait_s is None else max(self.timeout_s,
                                                           wait_s + WAIT_MARGIN_S)
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                return _answer(response.read(), response.status)
        except urllib.error.HTTPError as exc:
            raise _error(exc) from None
        except urllib.error.URLError as exc:
            raise self._unreachable(exc.reason, timeout) from None
        except (OSError, http.client.HTTPException) as exc:
            raise self._unreachable(exc, timeout) from None

    def _unreachable(self, reason: object, timeout: float) -> Unreachable:
        if isinstance(reason, TimeoutError):
            return Unreachable(f"no answer from the router at {self.router} within "
                               f"{timeout:g} s")
        why = reason.strerror if isinstance(reason, OSError) and reason.strerror else reason
        return Unreachable(f"cannot reach the router at {self.router} ({why})")


def _node(address: str) -> str:
    """The path of a node: its address as is, colon included, anything else escaped."""
    return f"/nodes/{quote(address, safe=':[]')}"


def _answer(raw: bytes, status: int) -> Json:
    try:
        answer = json.loads(raw)
    except ValueError:
        answer = None
    if not isinstance(answer, dict):
        raise RouterError("the router's answer is not a JSON object", None, status)
    return answer


def _error(exc: HTTPError) -> RouterError:
    """The OpenAI error JSON's message and code, or the bare HTTP status for any other
    body (a proxy's page, say)."""
    try:
        error = json.loads(exc.read())["error"]
        return RouterError(str(error["message"]), error.get("code"), exc.code)
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return RouterError(str(exc.reason or "no error message"), None, exc.code)
