"""The cluster secret in the KV transfer handshake.

A sender proves it belongs to the cluster in its `begin` frame with `proof(secret,
request_id)`: an HMAC-SHA256 of the request id keyed by the cluster secret, so the secret
itself never crosses the transfer port and a proof seen on the wire opens no other
request's sink. The receiver checks it in constant time before it accepts anything.
Without a secret (`None`, the laptop default) no proof is sent or asked for.

A connector that sets something up per connection before any begin (nccl: a process
group) asks its hello for `hello_fields(secret)` first: an HMAC of a fresh nonce and the
time, which `HelloCheck` takes once, within `HELLO_WINDOW_S` of its time.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import threading
import time
from typing import Any

_CONTEXT = b"tandem-kv-begin\0"
_HELLO = b"tandem-kv-hello\0"
HELLO_WINDOW_S = 120.0  # a hello's time may be this far from the receiver's clock


def proof(secret: bytes | None, request_id: str) -> str | None:
    """The `auth` field of a begin frame for `request_id`; None without a secret."""
    if secret is None:
        return None
    return hmac.new(secret, _CONTEXT + request_id.encode(), hashlib.sha256).hexdigest()


def verify(secret: bytes | None, request_id: str, given: object) -> bool:
    """Whether a begin frame's `auth` field proves the cluster secret (always, without
    a secret here)."""
    if secret is None:
        return True
    expected = proof(secret, request_id)
    assert expected is not None
    return isinstance(given, str) and hmac.compare_digest(expected, given)


def _hello_mac(secret: bytes, nonce: str, at: float) -> str:
    return hmac.new(secret, _HELLO + f"{nonce}/{at!r}".encode(), hashlib.sha256).hexdigest()


def hello_fields(secret: bytes | None) -> dict[str, Any]:
    """The proof a connection's hello carries: nonce, time and their HMAC; {} without a
    secret."""
    if secret is None:
        return {}
    nonce, at = secrets.token_hex(16), time.time()
    return {"nonce": nonce, "at": at, "auth": _hello_mac(secret, nonce, at)}


class HelloCheck:
    """Whether a hello proves the cluster secret: a valid HMAC, a time within the window,
    a nonce not seen before (a hello copied off the wire opens nothing)."""

    def __init__(self, secret: bytes | None, window_s: float = HELLO_WINDOW_S) -> None:
        self._secret, self._window_s = secret, window_s
        self._seen: dict[str, float] = {}  # nonce -> when it stops mattering
        self._lock = threading.Lock()

    def __call__(self, header: dict[str, Any]) -> bool:
        if self._secret is None:
            return True
        nonce, at, given = header.get("nonce"), header.get("at"), header.get("auth")
        if not (isinstance(nonce, str) and isinstance(at, float) and isinstance(given, str)):
            return False
        now = time.time()
        if abs(now - at) > self._window_s:
            return False
        if not hmac.compare_digest(_hello_mac(self._secret, nonce, at), given):
            return False
        with self._lock:
            self._seen = {n: until for n, until in self._seen.items() if until > now}
            if nonce in self._seen:
                return False
            self._seen[nonce] = at + self._window_s
        return True
