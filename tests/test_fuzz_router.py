"""The running router, fuzzed with Hypothesis: `tandem up` for real (one colocated node,
the SmolLM2 weights, a 96-token context so that every valid request ends quickly), and
800 request bodies for each of `/v1/completions` and `/v1/chat/completions`: 500
OpenAI-shaped objects with fields drawn from valid, boundary and wrong-typed values, 300
raw bodies that are no JSON object at all or JSON no encoder writes. Whatever the body,
the answer is a 200 with a completion (or an SSE stream ending in `data: [DONE]`) or a 400
with the OpenAI error JSON; never a 5xx, and the router stays healthy with no KV block held.

Run it: `.venv/bin/python -m pytest tests/test_fuzz_router.py -q`."""

from __future__ import annotations

import json
import math
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
import requests
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from serving_helpers import metric_samples, tandem_up

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m-instruct"
MAX_MODEL_LEN = 96
VOCAB_SIZE = 49152  # SmolLM2's tokenizer, added tokens included
ROUTES = ("/v1/completions", "/v1/chat/completions")
CASES_PER_ROUTE = 500  # request objects; and raw bodies:
RAW_CASES_PER_ROUTE = 300
TIMEOUT_S = 60  # per request; a valid one here takes well under a second

FUZZ = settings(deadline=None, derandomize=True, database=None,
                suppress_health_check=list(HealthCheck))


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    # A chat without max_tokens generates 4 tokens at most, too.
    flags = ["--colocated", "1", "--max-model-len", str(MAX_MODEL_LEN), "--num-kv-blocks", "64",
             "--default-chat-max-tokens", "4"]
    with tandem_up(flags) as (address, _, _):
        yield address


# -- values ----------------------------------------------------------------------------

SURROGATES = ("\ud800", "\udbff", "\udc00", "\udfff")
INT_EDGES = (0, 1, -1, 2, 2**31 - 1, 2**31, -(2**31), -(2**31) - 1, 2**32, 2**63 - 1, 2**63,
             -(2**63), -(2**63) - 1, 2**64, 10**30, 10**400, VOCAB_SIZE - 1, VOCAB_SIZE)
FLOAT_EDGES = (0.0, -0.0, 0.5, 1.0, 2.0, 2.0000001, -2.0000001, 1e-45, 1e-50, 5e-324, 3.4e38,
               3.5e38, 1e39, 1e308, -1e308, math.inf, -math.inf, math.nan)
STRING_EDGES = ("", " ", "0", "1", "3", " 3 ", "-1", "1.5", "1e308", "1e999", "NaN", "nan",
                "Infinity", "-inf", "0x10", "1_000", "true", "null", "None", "\x00",
                "<|im_end|>", "<|endoftext|>", "\U0001f600" * 3, "x" * 300, *SURROGATES)

texts = st.text(max_size=24)
surrogate_texts = st.builds(lambda a, s, b: a + s + b, texts, st.sampled_from(SURROGATES), texts)
strings = st.one_of(texts, st.sampled_from(STRING_EDGES), surrogate_texts,
                    st.text(st.characters(), max_size=24))
scalars = st.one_of(st.none(), st.booleans(), st.integers(), st.sampled_from(INT_EDGES),
                    st.floats(), st.sampled_from(FLOAT_EDGES), strings)
junk = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4)
                    | st.dictionaries(strings, inner, max_size=4), max_leaves=10)
huge = st.sampled_from(([0] * 100_000, [VOCAB_SIZE] * 1_000, ["a"] * 10_000, [[1, 2]] * 1_000,
                        [{"role": "user", "content": "hi"}] * 2_000, "hi " * 20_000))
# Any field may get one of these instead of a value it accepts.
wrong = st.one_of(scalars, scalars, junk, huge)

tokens = st.integers(0, VOCAB_SIZE - 1)
few_tokens = st.integers(1, 4)  # what a valid request generates, at most: keeps it cheap
short_texts = st.text(max_size=8)

SHARED: dict[str, st.SearchStrategy[Any]] = {
    "max_tokens": few_tokens,
    "temperature": st.one_of(st.sampled_from((0, 0.0, 0.7, 1, 2)), st.floats(0, 2)),
    "top_p": st.floats(0.01, 1),
    "top_k": st.sampled_from((-1, 0, 1, 5, 50, VOCAB_SIZE, 2**31 - 1)),
    "min_p": st.floats(0, 1),
    "n": st.just(1),
    "best_of": st.sampled_from((None, 1)),
    "stop": st.one_of(st.none(), st.text(min_size=1, max_size=6),
                      st.lists(st.text(min_size=1, max_size=6), max_size=4)),
    "stop_token_ids": st.lists(tokens, max_size=4),
    "seed": st.integers(-(2**63), 2**63 - 1),
    "stream": st.booleans(),
    "stream_options": st.one_of(st.none(), st.fixed_dictionaries(
        {}, optional={"include_usage": st.booleans()})),
    "presence_penalty": st.floats(-2, 2),
    "frequency_penalty": st.floats(-2, 2),
    "repetition_penalty": st.floats(0.5, 2),
    "ignore_eos": st.booleans(),
    "min_tokens": st.integers(0, 1),
    "skip_special_tokens": st.booleans(),
    "include_stop_str_in_output": st.booleans(),
    "user": texts,
    "logit_bias": st.sampled_from((None, {})),
}
prompts = st.one_of(
    st.text(min_size=1, max_size=16),
    st.lists(st.text(min_size=1, max_size=16), min_size=1, max_size=1),
    st.lists(tokens, min_size=1, max_size=16),
    st.lists(st.lists(tokens, min_size=1, max_size=16), min_size=1, max_size=1),
)
COMPLETION: dict[str, st.SearchStrategy[Any]] = {
    **SHARED, "prompt": prompts, "echo": st.just(False), "logprobs": st.none(),
    "suffix": st.sampled_from((None, "")),
}
parts = st.lists(st.fixed_dictionaries({"type": st.just("text")},
                                       optional={"text": st.one_of(st.none(), short_texts)}),
                 max_size=3)
messages = st.lists(st.fixed_dictionaries({
    "role": st.sampled_from(("system", "developer", "user", "assistant", "tool")),
    "content": st.one_of(short_texts, parts, st.none()),
}, optional={"name": short_texts}), min_size=1, max_size=2)
CHAT: dict[str, st.SearchStrategy[Any]] = {
    **SHARED, "messages": messages, "max_completion_tokens": few_tokens,
    "logprobs": st.sampled_from((None, False)), "top_logprobs": st.sampled_from((None, 0)),
    "tools": st.sampled_from((None, [])), "tool_choice": st.sampled_from((None, "none", "auto")),
    "response_format": st.sampled_from((None, {"type": "text"})),
}
# Wrong in the shape only that field has: near misses inside lists and objects.
bad_messages = st.lists(st.fixed_dictionaries({}, optional={
    "role": st.one_of(st.sampled_from(("user", "robot", "USER", "", "function")), wrong),
    "content": st.one_of(short_texts, wrong, st.lists(st.fixed_dictionaries({}, optional={
        "type": st.one_of(st.sampled_from(("text", "image_url", "input_audio", "")), wrong),
        "text": st.one_of(short_texts, wrong)}), max_size=3)),
}), max_size=3)
NEAR_MISSES: dict[str, st.SearchStrategy[Any]] = {
    "messages": bad_messages,
    "prompt": st.sampled_from(([], [""], [[]], ["a", "b"], [[1], [2]], [1, "a"], [[1], "a"],
                               [-1], [VOCAB_SIZE], [2**31], [1.5], [True], [None], [[-1]])),
    "stop": st.sampled_from(("", [""], ["a"] * 17, "x" * 257, ["x" * 257], [1], [None])),
    "stop_token_ids": st.sampled_from(([-1], [2**31], [VOCAB_SIZE], [1.5], ["1"], [[1]])),
    "stream_options": st.sampled_from(({"include_usage": "yes"}, {"include_usage": None},
                                       {"continuous_usage_stats": True}, [], "")),
    "logit_bias": st.sampled_from(({"1": 5}, {"x": "y"}, {"1": math.nan}, [1])),
    "min_tokens": st.sampled_from((5, -1, 2**31)),
    "top_k": st.sampled_from((-2, 2**31)),
}
EXTRA_FIELDS = ("unknown", "functions", "metadata", "guided_json", "priority", "")
FIELDS = {route: (required, schema) for route, required, schema in (
    ("/v1/completions", "prompt", COMPLETION), ("/v1/chat/completions", "messages", CHAT))}


@st.composite
def objects(draw: st.DrawFn, route: str) -> dict[str, Any]:
    """A request object: valid fields, streamed or not, generating at most 4 tokens but
    for one in forty; then often one or two fields replaced by wrong values or dropped,
    and the odd unknown field."""
    required, schema = FIELDS[route]
    body = {"model": MODEL, required: draw(schema[required]), "stream": draw(st.booleans())}
    if draw(st.integers(0, 39)) != 20:
        chat_name = "messages" in body and draw(st.booleans())
        body["max_completion_tokens" if chat_name else "max_tokens"] = draw(few_tokens)
    for name in draw(st.lists(st.sampled_from(sorted(schema)), max_size=4, unique=True)):
        body[name] = draw(schema[name])
    names = ["model", *sorted(schema), *EXTRA_FIELDS]
    for name in draw(st.lists(st.sampled_from(names), max_size=2, unique=True)):
        if draw(st.integers(0, 7)):
            body[name] = draw(st.one_of(wrong, NEAR_MISSES.get(name, wrong)))
        else:
            body.pop(name, None)
    return body


# Raw JSON text the encoder would never write: nesting deeper than a parser recurses,
# numbers no integer or float holds, keys with lone surrogates, duplicate keys.
def _nested(depth: int, inner: str = "1") -> str:
    return '{"a": ' * depth + inner + "}" * depth


def _raw(template: str) -> str:
    return (template.replace("$M", MODEL).replace("$DEEP", _nested(900))
            .replace("$LONG", "0" * 5_000))


RAW = tuple(map(_raw, (
    "", " ", "null", "true", "0", "-1", "1e999", "NaN", '"a string"', "[]", "[{}]", "{",
    "}", "{}", '{"model": }', "{'model': 'x'}", '{"model": "$M",}',
    "[" * 100_000 + "]" * 100_000, _nested(100_000),
    '{"model": "$M", "prompt": "hi", "max_tokens": 1$LONG}',
    '{"model": "$M", "prompt": "hi", "seed": -9$LONG}',
    '{"model": "$M", "prompt": "hi", "temperature": 1' + "0" * 400 + '.5}',
    '{"model": "$M", "prompt": "hi", "max_tokens": 2, "max_tokens": -2}',
    '{"model": "$M", "prompt": "hi", "max_tokens": 1, "temperature": NaN}',
    '{"model": "$M", "prompt": "hi", "max_tokens": 1, "top_p": -Infinity}',
    '{"\\ud800": "\\ud800", "model": "$M"}',
    '{"model": "$M", "prompt": "hi", "logit_bias": {"\\udfff": "x"}}',
    '{"model": "$M", "prompt": "hi", "stream_options": {"\\ud800": true}}',
    '{"model": "$M", "messages": [{"role": "user", "content": "hi", "\\ud800": 1}], '
    '"max_tokens": 1}',
    '{"model": "$M", "messages": [{"role": "\\ud800", "content": "hi"}]}',
    '{"model": "$M", "prompt": "hi", "max_tokens": 1, "tool_choice": $DEEP}',
    '{"model": "$M", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, '
    '"response_format": $DEEP}',
    '{"model": "$M", "prompt": "hi", "stream_options": $DEEP}',
    '{"model": "$M", "prompt": ' + "[" * 900 + "]" * 900 + "}",
)))
raw_bodies = st.one_of(
    st.sampled_from(RAW).map(str.encode),
    st.sampled_from([b"\xff\xfe{", b"\xef\xbb\xbf{}", b'{"model": "\xc3\x28"}',
                     '{"model": "x"}'.encode("utf-16"), b"\x00" * 16]),
    st.binary(max_size=64),
    st.text(max_size=64).map(str.encode),
    junk.map(lambda value: json.dumps(value).encode()),
)


def encoded(body: dict[str, Any], raw_utf8: bool) -> bytes:
    """JSON text of `body`: ASCII with `\\uXXXX` escapes (lone surrogates included), or
    raw UTF-8, where a lone surrogate becomes bytes no UTF-8 decoder accepts."""
    if raw_utf8:
        return json.dumps(body, ensure_ascii=False).encode("utf-8", "surrogatepass")
    return json.dumps(body).encode()


def requests_for(route: str) -> st.SearchStrategy[bytes]:
    return st.builds(encoded, objects(route), st.booleans())


# -- what every answer must be -----------------------------------------------------------

def check_error(reply: Any) -> dict[str, Any]:
    assert isinstance(reply, dict) and set(reply) == {"error"}, reply
    error = reply["error"]
    assert isinstance(error, dict) and set(error) == {"message", "type", "param", "code"}, reply
    assert isinstance(error["message"], str) and error["message"], reply
    assert isinstance(error["type"], str), reply
    assert error["param"] is None or isinstance(error["param"], str), reply
    assert error["code"] is None or isinstance(error["code"], str), reply
    return error


def check_usage(usage: Any) -> None:
    assert set(usage) == {"prompt_tokens", "completion_tokens", "total_tokens",
                          "prompt_tokens_details"}, usage
    prompt, completion = usage["prompt_tokens"], usage["completion_tokens"]
    assert 1 <= prompt and 1 <= completion and prompt + completion <= MAX_MODEL_LEN, usage
    assert usage["total_tokens"] == prompt + completion, usage
    assert 0 <= usage["prompt_tokens_details"]["cached_tokens"] <= prompt, usage


def check_whole(reply: Any, chat: bool) -> None:
    assert reply["object"] == ("chat.completion" if chat else "text_completion"), reply
    assert reply["model"] == MODEL and reply["id"].startswith("chatcmpl-" if chat else "cmpl-")
    [choice] = reply["choices"]
    assert choice["index"] == 0 and choice["finish_reason"] in ("stop", "length"), reply
    if chat:
        assert choice["message"]["role"] == "assistant", reply
        assert isinstance(choice["message"]["content"], str), reply
    else:
        assert isinstance(choice["text"], str), reply
    check_usage(reply["usage"])


def check_stream(payload: str, chat: bool) -> None:
    """SSE: `data: <json>` events, each ended by a blank line, the last `data: [DONE]`; an
    error event, if any, comes just before it, else one chunk carries the finish reason."""
    *events, done, rest = payload.split("\n\n")
    assert done == "data: [DONE]" and rest == "" and events, payload[-2000:]
    finished = 0
    for i, line in enumerate(events):
        assert line.startswith("data: {") and "\n" not in line, line
        event = json.loads(line.removeprefix("data: "))
        if "error" in event:
            check_error(event)
            assert i == len(events) - 1, payload[-2000:]
            return
        assert event["object"] == ("chat.completion.chunk" if chat else "text_completion")
        assert event["model"] == MODEL, event
        if not event["choices"]:  # the usage chunk
            check_usage(event["usage"])
            continue
        [choice] = event["choices"]
        finished += choice["finish_reason"] is not None
        assert isinstance(choice["delta"] if chat else choice["text"], dict if chat else str)
    assert finished == 1, payload[-2000:]


def check(url: str, route: str, body: bytes) -> str:
    """POST `body`, assert the answer is well-formed, and say what it was."""
    r = requests.post(url + route, data=body, headers={"Content-Type": "application/json"},
                      timeout=TIMEOUT_S)  # a connection of its own: no 500 blames the next body
    status, kind, payload = r.status_code, r.headers.get("content-type", ""), r.content.decode()
    assert status in (200, 400), (status, payload[:2000], body[:2000])
    if status == 400:
        error = check_error(json.loads(payload))
        assert error["type"] == "invalid_request_error", error
        return "400"
    chat = route == "/v1/chat/completions"
    if kind.startswith("text/event-stream"):
        check_stream(payload, chat)
        return "200 stream"
    check_whole(json.loads(payload), chat)
    return "200"


def fuzz(url: str, route: str, bodies: st.SearchStrategy[bytes], cases: int) -> Counter[str]:
    """`cases` bodies sent to `route`, each answer checked; how many got each answer."""
    seen: Counter[str] = Counter()

    @settings(FUZZ, max_examples=cases)
    @given(bodies)
    def one(body: bytes) -> None:
        seen[check(url, route, body)] += 1

    one()
    assert sum(seen.values()) >= cases, seen
    return seen


@pytest.mark.parametrize("route", ROUTES)
def test_request_objects_never_get_a_5xx(url: str, route: str) -> None:
    seen = fuzz(url, route, requests_for(route), CASES_PER_ROUTE)
    # Deep enough: many were served, streamed and not.
    assert seen["200"] >= 50 and seen["200 stream"] >= 50, seen


@pytest.mark.parametrize("route", ROUTES)
def test_raw_bodies_never_get_a_5xx(url: str, route: str) -> None:
    fuzz(url, route, raw_bodies, RAW_CASES_PER_ROUTE)


# -- what the fuzzer found, pinned ---------------------------------------------------------

def post(url: str, route: str, body: bytes | dict[str, Any]) -> tuple[int, dict[str, Any]]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = requests.post(url + route, data=data, headers={"Content-Type": "application/json"},
                      timeout=TIMEOUT_S)
    return r.status_code, r.json()


@pytest.mark.parametrize(("route", "body", "param", "text"), [
    # An error naming a lone surrogate was a 500: no UTF-8 encoder takes it.
    ("/v1/completions", b'{"\\ud800": "\\ud800", "model": "x"}', "\\ud800",
     "\\ud800 is not valid Unicode"),
    # What a 32-bit float on the wire to the node turns into inf or 0 is the router's 400,
    # naming the parameter, not the node's, naming none.
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "temperature": 1e39}, "temperature",
     "32-bit float"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "top_p": 1e-50}, "top_p",
     "top_p must be finite and in (0.0, 1.0], got 0.0"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                              "repetition_penalty": 1e-46}, "repetition_penalty",
     "repetition_penalty must be finite and in (0.0, inf], got 0.0"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                              "repetition_penalty": 1e39}, "repetition_penalty",
     "which a 32-bit float holds as inf"),
    # max_completion_tokens 0 was read as "not given"; below 1 it is named, not max_tokens.
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                              "max_completion_tokens": 0, "max_tokens": 2},
     "max_completion_tokens", "greater than or equal to 1"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                              "max_completion_tokens": -5}, "max_completion_tokens",
     "greater than or equal to 1"),
    # An integer literal too long for Python's int() is not a 500.
    ("/v1/completions", b'{"model": "x", "max_tokens": 1' + b"0" * 5000 + b"}", None,
     "not valid JSON"),
])
def test_what_the_fuzzer_found_is_a_400(url: str, route: str, body: bytes | dict[str, Any],
                                        param: str | None, text: str) -> None:
    status, reply = post(url, route, body)
    assert status == 400, reply
    error = check_error(reply)
    assert error["param"] == param and text in error["message"], error


def test_the_router_is_healthy_and_idle_after_the_fuzzing(url: str) -> None:
    r = requests.get(f"{url}/health", timeout=TIMEOUT_S)
    assert r.status_code == 200 and r.json()["status"] == "ok", r.text
    status, reply = post(url, "/v1/completions", {"model": MODEL, "prompt": "Hello",
                                                   "max_tokens": 2, "ignore_eos": True})
    assert status == 200 and reply["usage"]["completion_tokens"] == 2, reply

    def used() -> list[float]:
        return [v for name, _, v in metric_samples(url) if name == "tandem:kv_blocks_used"]

    deadline = time.monotonic() + 20
    while any(used()) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert used() and not any(used()), used()
