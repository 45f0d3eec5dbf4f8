"""The OpenAI API's request bodies as the router accepts them, and its error JSON.

Every rejected request gets HTTP 4xx and `{"error": {"message", "type", "param",
"code"}}`, naming the parameter at fault. Parameters Tandem does not implement are
refused by name rather than ignored, so a client never gets something other than what
it asked for.
"""

from __future__ import annotations

import dataclasses
import math
import struct
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from tandem.engine.sampling_params import SamplingParams
from tandem.router.limits import Limits

# What the wire to the nodes carries (protobuf int32 / int64): larger is a 400, not a 500.
Int32 = Annotated[int, Field(ge=-(2**31), le=2**31 - 1)]
Int64 = Annotated[int, Field(ge=-(2**63), le=2**63 - 1)]
# ... and its floats are 32-bit: what the node reads is the value rounded to one.
_FLOAT32_FIELDS = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                   "repetition_penalty")


class APIError(Exception):
    """An OpenAI-style error: `status` and the JSON body's fields."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None,
                 status: int = 400, kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.message, self.param, self.code, self.status, self.kind = (
            message, param, code, status, kind)

    def body(self) -> dict[str, Any]:
        param = None if self.param is None else _utf8(self.param)
        return {"error": {"message": _utf8(self.message), "type": self.kind, "param": param,
                          "code": self.code}}


def _utf8(text: str) -> str:
    """`text` as UTF-8 can carry it: a lone surrogate from the request (JSON's `\\ud800`,
    echoed in a message or a parameter's name) is written out as that escape."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


class _Sampling(BaseModel):
    """What both endpoints share: OpenAI's sampling fields and vLLM's common extras."""

    model_config = ConfigDict(extra="ignore")

    model: str
    max_tokens: Int32 | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: Int64 | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    user: str | None = None
    # vLLM's extras
    top_k: Int32 | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    stop_token_ids: list[Int32] | None = None
    min_tokens: Int32 | None = None
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

    def check_stop(self, limits: Limits) -> None:
        stops = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        if len(stops) > limits.max_stop_strings:
            raise APIError(f"at most {limits.max_stop_strings} stop strings, got {len(stops)}",
                           "stop")
        if any(len(stop) > limits.max_stop_chars for stop in stops):
            raise APIError(f"a stop string may have at most {limits.max_stop_chars} "
                           f"characters", "stop")

    def sampling_params(self, max_tokens: int | None, default_max_tokens: int,
                        defaults: dict[str, float | int] | None = None) -> SamplingParams:
        """The engine's parameters, `defaults` (the model's generation_config.json) for
        the sampling fields the request leaves unset; raises APIError naming the first
        bad one."""
        if max_tokens is not None and max_tokens <= 0:
            raise APIError(f"max_tokens must be at least 1, got {max_tokens}", "max_tokens")
        fields = {
            "temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k,
            "min_p": self.min_p, "seed": self.seed, "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
            "repetition_penalty": self.repetition_penalty, "min_tokens": self.min_tokens,
        }
        for name, value in (defaults or {}).items():
            if fields.get(name, 0) is None:
                fields[name] = value
        kwargs = {k: v for k, v in fields.items() if v is not None}
        if kwargs.get("top_k") == -1:  # vLLM's "no top-k"
            del kwargs["top_k"]
        try:
            params = SamplingParams(
                max_tokens=max_tokens if max_tokens is not None else default_max_tokens,
                stop=self.stop, stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos,
                skip_special_tokens=self.skip_special_tokens,
                include_stop_str_in_output=self.include_stop_str_in_output, **kwargs)
        except ValueError as exc:
            raise APIError(str(exc), _param_named_in(str(exc), fields)) from None
        _check_float32(params)
        return params


def _check_float32(params: SamplingParams) -> None:
    """Refuse, naming it, a float the node would read as another, invalid one (1e39 as inf,
    a top_p of 1e-50 as 0): it checks the params again after the wire's rounding."""
    wire = {name: _float32(getattr(params, name)) for name in _FLOAT32_FIELDS}
    try:
        dataclasses.replace(params, **wire)  # one check of all: the usual case passes
        return
    except ValueError as exc:
        error = APIError(f"as 32-bit floats the sampling parameters are invalid: {exc}")
    for name, rounded in wire.items():  # name the one at fault
        try:
            dataclasses.replace(params, **{name: rounded})
        except ValueError as exc:
            raise APIError(f"{name} is {getattr(params, name)!r}, which a 32-bit float "
                           f"holds as {rounded!r}: {exc}", name) from None
    raise error


def _float32(value: float) -> float:
    """`value` as a protobuf `float` field carries it: the nearest 32-bit float, or inf."""
    try:
        return struct.unpack("f", struct.pack("f", value))[0]
    except OverflowError:  # past the largest 32-bit float
        return math.copysign(math.inf, value)


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
    # At least 1 here: 0 must not read as "not given" and fall back to max_tokens.
    max_completion_tokens: Annotated[int, Field(ge=1, le=2**31 - 1)] | None = None
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
