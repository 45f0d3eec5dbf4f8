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
    max_concurrent_requests: int = 256  # completions in flight; more get 429 (0: no limit)
