"""`tandem up` for real (a router, a prefill node and a decode node, three processes, the
SmolLM2 weights) against the official `openai` SDK and raw HTTP: output equal to the
offline engine's, disaggregation visible in the metrics, clear 400s, nothing leaked."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
from openai import OpenAI
from serving_helpers import metric_samples, tandem_up

from tandem import LLM, SamplingParams

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m-instruct"
BLOCK_BYTES = 2 * 30 * 16 * 3 * 64 * 4  # SmolLM2-135M, fp32: a block of every layer's KV
QUESTIONS = ["What is the capital of France?", "Name three colors.",
             "Write one sentence about the sea."]


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    with tandem_up(["--num-kv-blocks", "512", "--max-model-len", "2048"]) as (url, proc, port):
        yield url
    # Its nodes are gone with it.
    out = subprocess.run(["pgrep", "-f", f"--port {port}|tandem.cli node"], capture_output=True)
    assert proc.returncode == 0 and out.stdout.strip() == b"", out.stdout


@pytest.fixture(scope="module")
def client(url: str) -> OpenAI:
    return OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)


def _chat(question: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": question}]


def _metrics(url: str) -> dict[str, float]:
    """`name:role` -> value for the per-node metrics (one node of each role here)."""
    return {f"{name}:{labels['node'].split('@')[0]}": value
            for name, labels, value in metric_samples(url) if "node" in labels}


def _post(url: str, path: str, body: bytes | dict[str, Any]) -> tuple[int, dict[str, Any]]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(f"{url}{path}", data=data,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _idle(url: str) -> bool:
    m = _metrics(url)
    return all(m[f"tandem:kv_blocks_used:{role}"] == 0 for role in ("prefill", "decode"))


def _settled(url: str) -> dict[str, float]:
    """The metrics once two reads a poll apart (the router reads nodes every second) agree."""
    last = _metrics(url)
    for _ in range(20):
        time.sleep(1.1)
        now = _metrics(url)
        if now == last:
            return now
        last = now
    raise AssertionError("the metrics never settled")


def _wait(cond, timeout: float = 20.0) -> bool:  # noqa: ANN001
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.2)
    return cond()


def test_models_and_health(url: str, client: OpenAI) -> None:
    assert [m.id for m in client.models.list().data] == [MODEL]
    with urllib.request.urlopen(f"{url}/health", timeout=10) as r:
        assert r.status == 200 and json.loads(r.read())["status"] == "ok"


def test_chat_equals_the_offline_engine(client: OpenAI, offline: LLM) -> None:
    greedy = SamplingParams(temperature=0.0, max_tokens=32)
    for question in QUESTIONS:
        want = offline.chat(_chat(question), greedy)[0]
        got = client.chat.completions.create(model=MODEL, messages=_chat(question),
                                             max_tokens=32, temperature=0)
        assert got.choices[0].message.content == want.text
        assert got.choices[0].finish_reason == want.finish_reason
        assert got.usage.prompt_tokens == len(want.prompt_token_ids)
        assert got.usage.completion_tokens == len(want.token_ids)
        # The same, streamed, with the usage chunk at the end.
        stream = client.chat.completions.create(
            model=MODEL, messages=_chat(question), max_tokens=32, temperature=0,
            stream=True, stream_options={"include_usage": True})
        text, usage, finish = [], None, None
        for chunk in stream:
            if chunk.choices:
                text.append(chunk.choices[0].delta.content or "")
                finish = chunk.choices[0].finish_reason or finish
            if chunk.usage:
                usage = chunk.usage
        assert "".join(text) == want.text and finish == want.finish_reason
        assert usage is not None and usage.completion_tokens == len(want.token_ids)


def test_completions_equal_the_offline_engine(client: OpenAI, offline: LLM) -> None:
    prompt = "The three primary colors are"
    want = offline.generate(prompt, SamplingParams(temperature=0.0, max_tokens=24))[0]
    got = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0)
    assert got.choices[0].text == want.text
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=24, temperature=0, stream=True))
    assert streamed == want.text


def _streams(url: str) -> dict[str, float]:
    return {labels["path"]: value for name, labels, value in metric_samples(url)
            if name == "tandem:router_streams_total"}


def test_tokens_come_through_the_decode_nodes_outputs_stream(url: str, client: OpenAI) -> None:
    """The decode node sends every request's tokens, batched per step, through the
    router's one Outputs stream, not in a stream per request."""
    assert _wait(lambda: _metrics(url)["tandem:router_outputs_stream_open:decode"] == 1)
    before = _streams(url)
    text = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt="Count to five:", max_tokens=8, temperature=0, stream=True))
    after = _streams(url)
    assert text
    assert after.get("outputs", 0) - before.get("outputs", 0) == 1
    assert after.get("call", 0) == before.get("call", 0)


def test_the_prompt_is_computed_on_the_prefill_node(url: str, client: OpenAI,
                                                    offline: LLM) -> None:
    """Disaggregation is real: the prompt's tokens are computed on the prefill node,
    none on the decode node, and the KV bytes moved are its blocks' bytes."""
    before = _settled(url)  # earlier tests' counts all read
    prompt = "A prompt nobody sent before, to count its blocks: " + "zebra " * 40
    num_tokens = len(offline.get_tokenizer().encode(prompt))
    client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0)
    moved = ("tandem:node_prompt_tokens_computed_total:prefill",
             "tandem:kv_transfer_bytes_sent_total:prefill",
             "tandem:kv_transfer_bytes_received_total:decode")
    # The metrics are the nodes' figures as the router last polled them (every second).
    assert _wait(lambda: all(_metrics(url)[name] > before[name] for name in moved))
    after = _metrics(url)

    def delta(name: str) -> float:
        return after[name] - before[name]

    assert delta("tandem:node_prompt_tokens_computed_total:prefill") == num_tokens
    assert delta("tandem:node_prompt_tokens_computed_total:decode") == 0
    blocks = -(-num_tokens // 16)
    assert delta("tandem:kv_transfer_bytes_sent_total:prefill") == blocks * BLOCK_BYTES
    assert delta("tandem:kv_transfer_bytes_received_total:decode") == blocks * BLOCK_BYTES


@pytest.mark.parametrize(("body", "param", "text"), [
    (b"{not json", None, "not valid JSON"),
    ({"model": "gpt-4", "prompt": "hi"}, "model", "does not exist"),
    ({"model": MODEL, "prompt": "hi", "max_tokens": "many"}, "max_tokens", "integer"),
    ({"model": MODEL, "prompt": "hi", "max_tokens": 0}, "max_tokens", "at least 1"),
    ({"model": MODEL, "prompt": "hi " * 3000}, None, "context length"),
    ({"model": MODEL, "prompt": "hi", "n": 2}, "n", "not supported: n"),
    ({"model": MODEL, "prompt": "hi", "temperature": -1}, "temperature", "temperature"),
    ({"model": MODEL, "prompt": 5}, "prompt", "prompt"),
    # What the wire to the nodes cannot carry is a 400 too, never a 500.
    ({"model": MODEL, "prompt": "hi", "top_k": 2**31}, "top_k", "less than or equal"),
    ({"model": MODEL, "prompt": "hi", "max_tokens": 10**12}, "max_tokens", "less than"),
    ({"model": MODEL, "prompt": "hi", "max_tokens": 2048}, "max_tokens", "context length"),
    ({"model": MODEL, "prompt": "hi", "seed": 2**70}, "seed", "less than or equal"),
    (b'{"model": "%s", "prompt": "\\ud800 alone"}' % MODEL.encode(), "prompt", "surrogate"),
    (b'{"model": "%s", "prompt": "hi", "stop": ["\\udfff"]}' % MODEL.encode(), "stop",
     "surrogate"),
    (b'{"model": "x", "prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", None,
     "nested too deeply"),
    ({"model": MODEL, "prompt": "hi", "stop": [str(i) for i in range(17)]}, "stop",
     "at most 16 stop strings"),
    ({"model": MODEL, "prompt": "hi", "stop": "x" * 257}, "stop", "at most 256 characters"),
])
def test_bad_input_is_a_400_with_the_openai_error(url: str, body, param, text) -> None:  # noqa: ANN001
    status, reply = _post(url, "/v1/completions", body)
    assert status == 400, reply
    error = reply["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert text in error["message"] and error["type"] == "invalid_request_error"
    if param is not None:
        assert error["param"] == param


def test_every_error_status_carries_the_openai_error_json(url: str) -> None:
    def call(method: str, path: str) -> tuple[int, dict]:
        req = urllib.request.Request(f"{url}{path}", method=method,
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    for (method, path), status in ((("GET", "/v1/nothing-here"), 404),
                                   (("GET", "/v1/completions"), 405)):
        got, reply = call(method, path)
        assert got == status, (path, got, reply)
        assert set(reply["error"]) == {"message", "type", "param", "code"}, reply
    # A body over the limit (8 MiB by default) is refused from its Content-Length, before
    # it is read: the headers alone get the answer.
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as conn:
        conn.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                     b"application/json\r\nContent-Length: %d\r\n\r\n" % (9 << 20))
        response = conn.makefile("rb")
        assert response.readline().split()[1] == b"413"
        headers = {}
        while (line := response.readline().strip()):
            name, _, value = line.decode().partition(":")
            headers[name.lower()] = value.strip()
        reply = json.loads(response.read(int(headers["content-length"])))
    assert reply["error"]["code"] == "request_too_large"


def test_two_clients_with_the_same_request_id_both_complete(url: str, offline: LLM) -> None:
    """X-Request-Id is echoed back, not used as the request's key: a second stream with
    the same id runs beside the first and neither is aborted."""
    prompt = "List some animals:"
    want = offline.generate(prompt, SamplingParams(temperature=0.0, max_tokens=24))[0].text
    results: list[tuple[str, str]] = []

    def stream() -> None:
        body = json.dumps({"model": MODEL, "prompt": prompt, "max_tokens": 24,
                           "temperature": 0, "stream": True}).encode()
        req = urllib.request.Request(f"{url}/v1/completions", data=body, headers={
            "Content-Type": "application/json", "X-Request-Id": "same-id"})
        with urllib.request.urlopen(req, timeout=120) as r:
            echoed = r.headers["X-Request-Id"]
            text = [json.loads(line[6:])["choices"][0]["text"] for line in r
                    if line.startswith(b"data: {")]
        results.append((echoed, "".join(text)))

    threads = [threading.Thread(target=stream) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    assert results == [("same-id", want)] * 2


def test_a_non_streaming_client_that_goes_away_frees_every_block(url: str) -> None:
    body = json.dumps({"model": MODEL, "prompt": "Count: one, two,", "max_tokens": 1000,
                       "temperature": 0, "ignore_eos": True}).encode()
    req = urllib.request.Request(f"{url}/v1/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    with pytest.raises((TimeoutError, urllib.error.URLError)):
        urllib.request.urlopen(req, timeout=2)  # gives up long before 1,000 tokens
    assert _wait(lambda: _idle(url)), _metrics(url)


def test_bad_chat_input_is_a_400(url: str) -> None:
    for body in ({"model": MODEL, "messages": []},
                 {"model": MODEL, "messages": [{"role": "robot", "content": "hi"}]},
                 {"model": MODEL, "messages": _chat("hi"), "tools": [{"type": "function"}]},
                 {"model": MODEL, "messages": _chat("hi"), "max_completion_tokens": 2**31},
                 {"model": MODEL, "messages": _chat("hi"), "max_completion_tokens": 2040}):
        status, reply = _post(url, "/v1/chat/completions", body)
        assert status == 400 and "error" in reply, reply


def test_a_client_that_disconnects_frees_every_block(url: str, client: OpenAI) -> None:
    stream = client.completions.create(model=MODEL, prompt="Count: one, two,", max_tokens=1000,
                                       temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})
    for i, _ in enumerate(stream):
        if i == 3:
            break
    stream.close()
    assert _wait(lambda: _idle(url)), _metrics(url)


def test_32_concurrent_streams_complete_with_correct_usage(url: str, client: OpenAI,
                                                           offline: LLM) -> None:
    tok = offline.get_tokenizer()
    results: dict[int, tuple[int, Any]] = {}
    errors: list[BaseException] = []

    def one(i: int) -> None:
        try:
            prompt = f"Request {i}: tell me a fact about the number {i}."
            chunks, usage = 0, None
            for c in client.completions.create(
                    model=MODEL, prompt=prompt, max_tokens=12, temperature=0.8, seed=i,
                    stream=True, stream_options={"include_usage": True},
                    extra_body={"ignore_eos": True}):
                chunks += bool(c.choices)
                usage = c.usage or usage
            results[i] = (len(tok.encode(prompt)), usage)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(32)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not errors, errors[:3]
    assert len(results) == 32
    for prompt_tokens, usage in results.values():
        assert usage.prompt_tokens == prompt_tokens and usage.completion_tokens == 12
        assert usage.total_tokens == prompt_tokens + 12
    assert _wait(lambda: _idle(url)), _metrics(url)


# What vLLM's `vllm bench serve --save-result` writes, and the type of each.
VLLM_RESULT_KEYS: dict[str, type | tuple[type, ...]] = {
    "date": str, "endpoint_type": str, "backend": str, "label": (str, type(None)),
    "model_id": str, "tokenizer_id": (str, type(None)), "num_prompts": int,
    "request_rate": (float, int, str), "burstiness": (float, int),
    "max_concurrency": (int, type(None)), "duration": float, "completed": int, "failed": int,
    "total_input_tokens": int, "total_output_tokens": int, "request_throughput": float,
    "request_goodput": (float, type(None)), "output_throughput": float,
    "total_token_throughput": float, "latencies": list, "queue_times": list,
    "max_output_tokens_per_s": float, "max_concurrent_requests": int, "rtfx": float,
    **{f"{stat}_{metric}_ms": float for stat in ("mean", "median", "std", "p99")
       for metric in ("ttft", "tpot", "itl")},
}
VLLM_DETAILED_KEYS = {"input_lens": list, "output_lens": list, "start_times": list,
                      "ttfts": list, "itls": list, "generated_texts": list, "errors": list}


@pytest.mark.parametrize("detailed", [False, True], ids=["save-result", "save-detailed"])
def test_bench_serve_random_run_writes_vllms_json(url: str, tmp_path, detailed: bool) -> None:  # noqa: ANN001
    cmd = [sys.executable, "-m", "tandem.cli", "bench", "serve", "--base-url", url,
           "--dataset-name", "random", "--num-prompts", "4", "--random-input-len", "24",
           "--random-output-len", "6", "--max-concurrency", "2", "--request-rate", "50",
           "--goodput", "ttft:60000", "tpot:60000", "--save-result", "--result-dir",
           str(tmp_path), "--result-filename", "run.json", "--disable-tqdm"]
    if detailed:
        cmd.append("--save-detailed")
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "Serving Benchmark Result" in done.stdout
    result = json.loads((tmp_path / "run.json").read_text())
    expected = VLLM_RESULT_KEYS | (VLLM_DETAILED_KEYS if detailed else {})
    for key, kind in expected.items():
        assert key in result, key
        assert isinstance(result[key], kind), (key, result[key])
    if not detailed:
        assert not VLLM_DETAILED_KEYS.keys() & result.keys()
    assert (result["completed"], result["failed"], result["num_prompts"]) == (4, 0, 4)
    assert result["model_id"] == MODEL and result["max_concurrency"] == 2
    # Random prompts are sent as token ids with ignore_eos: exact lengths both ways.
    assert result["total_input_tokens"] == 4 * 24 and result["total_output_tokens"] == 4 * 6
    assert result["request_goodput"] == pytest.approx(4 / result["duration"])
    assert 0 < result["median_ttft_ms"] <= result["p99_ttft_ms"] < 60000
    assert 0 < result["mean_tpot_ms"] and result["max_concurrent_requests"] <= 2
    if detailed:
        assert result["output_lens"] == [6] * 4 and result["input_lens"] == [24] * 4
        assert [len(itl) for itl in result["itls"]] == [5] * 4  # a chunk per token
        assert result["errors"] == [""] * 4
