"""The OpenAI API's request bodies as the router accepts them, and its error JSON.

Every rejected request gets HTTP 4xx and `{"error": {"message", "type", "param",
"code"}}`, naming the parameter at fault. Parameters Tandem does not implement are
refused by name rather than ignored, so a client never gets something other than what
it asked for.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from tandem.engine.sampling_params import SamplingParams


class APIError(Exception):
    """An OpenAI-style error: `status` and the JSON body's fields."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None,
                 status: int = 400, kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.message, self.param, self.code, self.status, self.kind = (
            message, param, code, status, kind)

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param,
                          "code": self.code}}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


class _Sampling(BaseModel):
    """What both endpoints share: OpenAI's sampling fields and vLLM's common extras."""

    model_config = ConfigDict(extra="ignore")

    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    user: str | None = None
    # vLLM's extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    min_tokens: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # Recognized but not implemented: refused by name (`unsupported`).
    logit_bias: dict[str, float] | None = None
    best_of: int | None = None

    def unsupported(self) -> list[str]:
        names = []
        if self.n != 1:
            names.append("n")
        if self.best_of not in (None, 1):
            names.append("best_of")
        if self.logit_bias:
            names.append("logit_bias")
        return names

    def sampling_params(self, max_tokens: int | None, default_max_tokens: int) -> SamplingParams:
        """The engine's parameters; raises APIError naming the first bad one."""
        if max_tokens is not None and max_tokens <= 0:
            raise APIError(f"max_tokens must be at least 1, got {max_tokens}", "max_tokens")
        fields = {
            "temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k,
            "min_p": self.min_p, "seed": self.seed, "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
            "repetition_penalty": self.repetition_penalty, "min_tokens": self.min_tokens,
        }
        kwargs = {k: v for k, v in fields.items() if v is not None}
        if kwargs.get("top_k") == -1:  # vLLM's "no top-k"
            del kwargs["top_k"]
        try:
            return SamplingParams(
                max_tokens=max_tokens if max_tokens is not None else default_max_tokens,
                stop=self.stop, stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos,
                skip_special_tokens=self.skip_special_tokens,
                include_stop_str_in_output=self.include_stop_str_in_output, **kwargs)
        except ValueError as exc:
            raise APIError(str(exc), _param_named_in(str(exc), fields)) from None


def _param_named_in(message: str, fields: dict[str, Any]) -> str | None:
    for name in (*fields, "max_tokens", "stop_token_ids", "stop"):
        if name in message:
            return name
    return None


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False
    logprobs: int | None = None
    suffix: str | None = None

    def unsupported(self) -> list[str]:
        names = super().unsupported()
        if self.echo:
            names.append("echo")
        if self.logprobs is not None:
            names.append("logprobs")
        if self.suffix:
            names.append("suffix")
        if self._batched() and len(self.prompt) != 1:
            names.append("prompt (more than one prompt per request)")
        return names

    def _batched(self) -> bool:
        p = self.prompt
        return isinstance(p, list) and bool(p) and isinstance(p[0], (str, list))

    def single_prompt(self) -> str | list[int]:
        prompt = self.prompt[0] if self._batched() else self.prompt
        if not prompt:
            raise APIError("prompt is empty", "prompt")
        return prompt  # type: ignore[return-value]


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        bad = [p.type for p in self.content if p.type != "text"]
        if bad:
            raise APIError(f"content parts of type {bad[0]!r} are not supported; send text",
                           "messages")
        return "".join(p.text or "" for p in self.content)


class ChatRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    response_format: dict[str, Any] | None = None

    def unsupported(self) -> list[str]:
        names = super().unsupported()
        if self.logprobs or self.top_logprobs:
            names.append("logprobs")
        if self.tools:
            names.append("tools")
        if self.response_format and self.response_format.get("type") not in (None, "text"):
            names.append("response_format")
        return names

    def conversation(self) -> list[dict[str, str]]:
        return [{"role": "system" if m.role == "developer" else m.role, "content": m.text()}
                for m in self.messages]
