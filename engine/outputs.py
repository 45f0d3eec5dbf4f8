"""What the engine hands back per request, shaped like vLLM's outputs."""

from __future__ import annotations

from dataclasses import dataclass

from tandem.engine.request import FINISHED, Request


# Not frozen: one is made per request per step, and a frozen init costs twice as much.
@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop" | "length" | "abort" | None while running
    # The stop string or stop token id that ended the request, if any.
    stop_reason: int | str | None
    logprobs: list[dict[int, float]] | None
    # Prompt tokens whose KV came from the prefix cache, not computed.
    num_cached_tokens: int
    # Text added since the previous output of this request (for streaming).
    delta: str = ""

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @classmethod
    def of(cls, req: Request, delta: str = "") -> RequestOutput:
        # Positional, and the request's fields read directly: one per request per step.
        status = req.status
        return cls(req.request_id, req.prompt_token_ids, req.output_text,
                   list(req.output_token_ids),
                   status.value if status in FINISHED else None, req.stop_reason,
                   list(req.output_logprobs) if req.params.logprobs is not None else None,
                   req.num_cached_tokens, delta)
