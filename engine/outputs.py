"""What the engine hands back per request, shaped like vLLM's outputs."""

from __future__ import annotations

from tandem.engine.request import FINISHED, Request


class RequestOutput:
    """A request's state after a step. `token_ids`: its output tokens so far. One is
    made per request per step, so it copies nothing: it reads the request's own token
    list up to `num_tokens` (later tokens only ever go after those), and `token_ids`
    copies only when asked for; `tokens_since(i)` gives the new ones alone."""

    __slots__ = ("_token_ids", "delta", "finish_reason", "logprobs", "num_cached_tokens",
                 "num_tokens", "prompt_token_ids", "request_id", "stop_reason", "text")

    def __init__(self, request_id: str, prompt_token_ids: list[int], text: str,
                 token_ids: list[int], finish_reason: str | None,
                 stop_reason: int | str | None, logprobs: list[dict[int, float]] | None,
                 num_cached_tokens: int, delta: str = "", num_tokens: int | None = None
                 ) -> None:
        self.request_id, self.prompt_token_ids, self.text = request_id, prompt_token_ids, text
        self._token_ids = token_ids
        self.num_tokens = len(token_ids) if num_tokens is None else num_tokens
        self.finish_reason = finish_reason  # "stop" | "length" | "abort" | None while running
        self.stop_reason = stop_reason  # the stop string or stop token id that ended it
        self.logprobs = logprobs
        self.num_cached_tokens = num_cached_tokens  # prompt tokens found in the prefix cache
        self.delta = delta  # text added since the request's previous output (streaming)

    @property
    def token_ids(self) -> list[int]:
        return self._token_ids[:self.num_tokens]

    def tokens_since(self, start: int) -> list[int]:
        """The output tokens from index `start` on."""
        return self._token_ids[start:self.num_tokens]

    def token_at(self, i: int) -> int:
        """Output token i (< num_tokens)."""
        return self._token_ids[i]

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def __repr__(self) -> str:
        return (f"RequestOutput(request_id={self.request_id!r}, text={self.text!r}, "
                f"token_ids={self.token_ids}, finish_reason={self.finish_reason!r})")

    @classmethod
    def of(cls, req: Request, delta: str = "") -> RequestOutput:
        # Positional, and the request's fields read directly: one per request per step.
        status, tokens = req.status, req.output_token_ids
        return cls(req.request_id, req.prompt_token_ids, req.output_text, tokens,
                   status.value if status in FINISHED else None, req.stop_reason,
                   list(req.output_logprobs) if req.params.logprobs is not None else None,
                   req.num_cached_tokens, delta, len(tokens))
