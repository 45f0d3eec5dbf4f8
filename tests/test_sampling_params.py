from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest

from tandem.engine.sampling_params import SamplingParams


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", -0.1),
        ("temperature", float("nan")),
        ("temperature", float("inf")),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_p", -0.5),
        ("max_tokens", 0),
        ("max_tokens", -1),
        ("top_k", -2),
        ("min_p", 1.5),
        ("min_p", -0.1),
        ("presence_penalty", 2.5),
        ("frequency_penalty", -2.5),
        ("repetition_penalty", 0.0),
        ("min_tokens", -1),
        ("logprobs", 21),
        ("logprobs", -1),
        ("n", 0),
        ("seed", 2**64),
        # Wrong types.
        ("temperature", "0.5"),
        ("top_p", None),
        ("max_tokens", True),
        ("max_tokens", 1.5),
        ("top_k", 2.0),
        ("seed", "42"),
        ("n", False),
        ("logprobs", 1.0),
        ("min_tokens", None),
        ("ignore_eos", 1),
        ("skip_special_tokens", "yes"),
        ("stop", 5),
        ("stop", ["a", 3]),
        ("stop_token_ids", "12"),
        ("stop_token_ids", [1, "2"]),
        ("stop_token_ids", [1, True]),
        ("stop_token_ids", [-3]),
    ],
)
def test_bad_value_raises_naming_field(field: str, value: Any) -> None:
    with pytest.raises(ValueError, match=rf"^{field} must") as info:
        SamplingParams(**{field: value})
    # The message shows the offending value (or, for sequences, the offending item).
    shown = value[-1] if isinstance(value, list) else value
    assert repr(shown) in str(info.value) or str(shown) in str(info.value)


def test_n_above_one_is_unsupported() -> None:
    with pytest.raises(ValueError, match=r"n > 1 is not supported"):
        SamplingParams(n=2)


@pytest.mark.parametrize("stop", ["", ["ok", ""]])
def test_empty_stop_string_rejected(stop: str | list[str]) -> None:
    with pytest.raises(ValueError, match="stop must contain only non-empty strings"):
        SamplingParams(stop=stop)


def test_min_tokens_above_max_tokens_rejected() -> None:
    with pytest.raises(ValueError, match=r"min_tokens \(5\) must be <= max_tokens \(4\)"):
        SamplingParams(min_tokens=5, max_tokens=4)


def test_defaults() -> None:
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p) == (1, 1.0, 1.0, None, 0.0)
    assert (p.max_tokens, p.min_tokens, p.seed, p.logprobs) == (16, 0, None, None)
    assert (p.stop, p.stop_token_ids) == ((), ())
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.0, 0.0, 1.0)
    assert not p.ignore_eos and not p.include_stop_str_in_output and p.skip_special_tokens
    assert not p.is_greedy


def test_boundaries_accepted() -> None:
    p = SamplingParams(
        temperature=0,
        top_p=1,
        min_p=1,
        top_k=1,
        presence_penalty=-2,
        frequency_penalty=2,
        max_tokens=1,
        min_tokens=1,
        logprobs=0,
    )
    assert p.top_p == 1.0 and p.min_p == 1.0 and p.logprobs == 0
    assert SamplingParams(logprobs=20).logprobs == 20
    assert SamplingParams(max_tokens=None, min_tokens=1000).max_tokens is None


def test_normalization() -> None:
    assert SamplingParams(stop="x").stop == ("x",)
    assert SamplingParams(stop=["a", "b"]).stop == ("a", "b")
    assert SamplingParams(stop_token_ids=[3, 4]).stop_token_ids == (3, 4)
    assert SamplingParams(top_k=0).top_k is None
    assert SamplingParams(top_k=-1).top_k is None
    assert SamplingParams(top_k=7).top_k == 7
    # Ints for floats and numpy scalars come out as plain Python numbers.
    p = SamplingParams(temperature=1, top_k=np.int64(3), seed=np.int32(5))
    assert type(p.temperature) is float and p.temperature == 1.0
    assert type(p.top_k) is int and p.top_k == 3
    assert type(p.seed) is int and p.seed == 5


def test_is_greedy() -> None:
    assert SamplingParams(temperature=0.0).is_greedy
    assert SamplingParams(temperature=0.8, top_k=1).is_greedy
    assert not SamplingParams(temperature=0.8, top_k=2).is_greedy


def test_frozen_and_hashable() -> None:
    p = SamplingParams(stop=["a"], stop_token_ids=[1])
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.temperature = 0.0  # type: ignore[misc]
    assert hash(p) == hash(SamplingParams(stop="a", stop_token_ids=(1,)))
