"""The cluster secret in the KV transfer handshake.

A sender proves it belongs to the cluster in its `begin` frame with `proof(secret,
request_id)`: an HMAC-SHA256 of the request id keyed by the cluster secret, so the secret
itself never crosses the transfer port and a proof seen on the wire opens no other
request's sink. The receiver checks it in constant time before it accepts anything.
Without a secret (`None`, the laptop default) no proof is sent or asked for.
"""

from __future__ import annotations

import hashlib
import hmac

_CONTEXT = b"tandem-kv-begin\0"


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
