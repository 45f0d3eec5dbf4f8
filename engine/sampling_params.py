"""Per-request sampling parameters, validated and normalized once at construction."""

from __future__ import annotations

import functools
import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass

# Like vLLM: temperatures this small are treated as greedy, since dividing logits by them
# only amplifies float noise.
_SAMPLING_EPS = 1e-5
MAX_LOGPROBS = 20

# (field, low, high, low bound exclusive); every bound is finite-checked too.
_FLOAT_BOUNDS: tuple[tuple[str, float, float, bool], ...] = (
    ("temperature", 0.0, math.inf, False),
    ("top_p", 0.0, 1.0, True),
    ("min_p", 0.0, 1.0, False),
    ("presence_penalty", -2.0, 2.0, False),
    ("frequency_penalty", -2.0, 2.0, False),
    ("repetition_penalty", 0.0, math.inf, True),
)


@dataclass(frozen=True)
class SamplingParams:
    """Mirrors vLLM's keyword arguments. Frozen so requests sharing one instance can't
    mutate each other's params; `stop`/`stop_token_ids` are normalized to tuples and a
    disabled `top_k` (0 or -1) to None."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    # None means up to the context length.
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: str | Sequence[str] | None = None  # normalized to tuple[str, ...]
    stop_token_ids: Sequence[int] | None = None  # normalized to tuple[int, ...]
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    # Number of top logprobs returned per generated token (plus the sampled token's).
    logprobs: int | None = None
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        n = _int("n", self.n)
        if n < 1:
            raise ValueError(f"n must be at least 1, got {n}")
        if n > 1:
            raise ValueError(f"n > 1 is not supported, got n={n}")
        object.__setattr__(self, "n", n)
        for name, lo, hi, lo_open in _FLOAT_BOUNDS:
            object.__setattr__(self, name, _real(name, getattr(self, name), lo, hi, lo_open))
        object.__setattr__(self, "top_k", _top_k(self.top_k))
        if self.seed is not None:
            seed = _int("seed", self.seed)
            # The range torch.Generator.manual_seed accepts.
            if not -(2**63) <= seed < 2**64:
                raise ValueError(f"seed must fit in 64 bits, got {seed}")
            object.__setattr__(self, "seed", seed)
        if self.max_tokens is not None:
            max_tokens = _int("max_tokens", self.max_tokens)
            if max_tokens < 1:
                raise ValueError(f"max_tokens must be at least 1, got {max_tokens}")
            object.__setattr__(self, "max_tokens", max_tokens)
        min_tokens = _int("min_tokens", self.min_tokens)
        if min_tokens < 0:
            raise ValueError(f"min_tokens must be non-negative, got {min_tokens}")
        if self.max_tokens is not None and min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({min_tokens}) must be <= max_tokens ({self.max_tokens})")
        object.__setattr__(self, "min_tokens", min_tokens)
        if self.logprobs is not None:
            logprobs = _int("logprobs", self.logprobs)
            if not 0 <= logprobs <= MAX_LOGPROBS:
                raise ValueError(f"logprobs must be in [0, {MAX_LOGPROBS}], got {logprobs}")
            object.__setattr__(self, "logprobs", logprobs)

        object.__setattr__(self, "stop", _stop(self.stop))
        object.__setattr__(self, "stop_token_ids", _stop_token_ids(self.stop_token_ids))
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature < _SAMPLING_EPS or self.top_k == 1

    # Asked of every request at every step: computed once (the params are frozen).
    @functools.cached_property
    def device_sampled(self) -> bool:
        """A request's next token can be drawn without the host knowing its newest token
        or reading anything back: no penalties (they count the output), no logprobs."""
        return self.logprobs is None and not self.has_penalty

    @functools.cached_property
    def has_penalty(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0
                or self.presence_penalty != 0.0)

    @functools.cached_property
    def token_only_stops(self) -> bool:
        """Whether a new token is all a stop check needs: no stop strings, logprobs or
        min_tokens (the engine lands such a request's token with the fewest calls)."""
        return self.logprobs is None and not self.stop and self.min_tokens == 0

    @functools.cached_property
    def greedy_on_device(self) -> bool:
        """Greedy and `device_sampled`: its token is the logits' argmax (once min_tokens
        is reached)."""
        return self.is_greedy and self.device_sampled


def _int(name: str, value: object) -> int:
    if type(value) is int:  # nearly always: no ABC check (every request makes params)
        return value
    # bool is an Integral, but max_tokens=True is a caller bug, not 1.
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name} must be an int, got {value!r}")
    return int(value)


def _real(name: str, value: object, lo: float, hi: float, lo_open: bool) -> float:
    if type(value) is not float and type(value) is not int and (
            isinstance(value, bool) or not isinstance(value, numbers.Real)):
        raise ValueError(f"{name} must be a number, got {value!r}")
    v = float(value)
    # Written so NaN fails every bound.
    above_lo = v > lo if lo_open else v >= lo
    if not (math.isfinite(v) and above_lo and v <= hi):
        interval = f"{'(' if lo_open else '['}{lo}, {hi}]"
        raise ValueError(f"{name} must be finite and in {interval}, got {value!r}")
    return v


def _top_k(value: object) -> int | None:
    if value is None:
        return None
    k = _int("top_k", value)
    if k in (0, -1):  # vLLM's spellings of "disabled"
        return None
    if k < 1:
        raise ValueError(f"top_k must be None, 0, -1 or >= 1, got {k}")
    return k


def _stop(value: object) -> tuple[str, ...]:
    if value is None:
        return ()
    items = (value,) if isinstance(value, str) else value
    if not isinstance(items, Sequence):
        raise ValueError(f"stop must be a string or a list of strings, got {value!r}")
    for s in items:
        if not isinstance(s, str) or not s:
            raise ValueError(f"stop must contain only non-empty strings, got {s!r}")
    return tuple(items)


def _stop_token_ids(value: object) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise ValueError(f"stop_token_ids must be a list of ints, got {value!r}")
    ids = tuple(_int("stop_token_ids", t) for t in value)
    if any(t < 0 for t in ids):
        raise ValueError(f"stop_token_ids must be non-negative, got {list(ids)}")
    return ids
