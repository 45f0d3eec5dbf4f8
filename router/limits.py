"""What the router accepts, in one place (no imports: `tandem --help` reads the defaults)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Limits:
    """Each is a `tandem router` / `tandem up` flag; each refusal is the OpenAI error JSON."""

    max_body_bytes: int = 8 << 20  # a larger body is refused with 413
    max_stop_strings: int = 16
    max_stop_chars: int = 256  # per stop string
    default_chat_max_tokens: int = 1024  # chat without max_tokens: this, or the context left
    # Completions in flight at once, queued or running; more get 429 (0: no limit: the
    # queue's length is the limit, FlowConfig.max_queued_requests).
    max_concurrent_requests: int = 0
    # Requests waiting for a decode node with room (every one at its --max-requests);
    # more get 429 with Retry-After. Generous: a queued request costs a few KB.
    max_queued_requests: int = 10_000
    queue_timeout_s: float = 600.0  # queued this long: 503 queue_timeout
