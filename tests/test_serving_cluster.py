"""A router over one prefill node and two decode nodes, each its own process (`tandem node`,
`tandem router`), with a local-prefill threshold: conditional disaggregation in a
multi-turn chat, then nodes killed under it while requests keep completing."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import pytest
from openai import OpenAI

from tandem import LLM, SamplingParams

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m-instruct"
THRESHOLD = 48
ENGINE = ["--num-kv-blocks", "256", "--max-model-len", "2048"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(args: list[str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "tandem.cli", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True, start_new_session=True)


def _ready_address(proc: subprocess.Popen) -> str:
    assert proc.stdout is not None
    for line in proc.stdout:
        if m := re.search(r"tandem node ready: .* grpc=(\S+)", line):
            return m.group(1)
    raise AssertionError(f"node exited with {proc.wait()}")


@dataclass
class Cluster:
    url: str
    prefill: subprocess.Popen
    decodes: list[subprocess.Popen]
    router: subprocess.Popen


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    prefill = _start(["node", "--role", "prefill", *ENGINE])
    decodes = [_start(["node", "--role", "decode", *ENGINE]) for _ in range(2)]
    procs = [prefill, *decodes]
    try:
        addresses = [_ready_address(p) for p in procs]
        port = _free_port()
        router = _start(["router", "--port", str(port), "--prefill", addresses[0],
                         *[f"--decode={a}" for a in addresses[1:]],
                         "--local-prefill-threshold", str(THRESHOLD)])
        procs.append(router)
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while True:
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                    if json.loads(r.read())["status"] == "ok":
                        break
            except OSError:
                pass
            assert time.monotonic() < deadline and router.poll() is None, "router not up"
            time.sleep(0.2)
        yield Cluster(url, prefill, decodes, router)
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        for p in procs:
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)


@pytest.fixture(scope="module")
def client(cluster: Cluster) -> OpenAI:
    return OpenAI(base_url=f"{cluster.url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def offline() -> LLM:
    return LLM(MODEL)


def _counters(url: str) -> dict[str, float]:
    text = urllib.request.urlopen(f"{url}/metrics", timeout=10).read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if m := re.match(r'tandem:router_requests_total\{pool="([\w-]+)"\} (\S+)', line):
            out[m[1]] = float(m[2])
        elif m := re.match(r'tandem:router_retries_total\{stage="(\w+)"\} (\S+)', line):
            out[f"retries-{m[1]}"] = float(m[2])
        elif m := re.match(r'tandem:node_prompt_tokens_computed_total\{node="prefill@', line):
            out["prefill_tokens"] = float(line.split()[-1])
    return out


def test_a_short_follow_up_turn_skips_the_prefill_pool(cluster: Cluster, client: OpenAI,
                                                       offline: LLM) -> None:
    """Turn 1 goes through the prefill pool. Turn 2 repeats turn 1 and its answer, which
    the decode node has cached, plus a few new tokens: fewer than the threshold, so the
    decode node prefills them itself and the prefill node computes nothing."""
    greedy = SamplingParams(temperature=0.0, max_tokens=24)
    system = {"role": "system", "content": "You are a helpful assistant who answers in one "
                                           "short sentence, politely and precisely."}
    turn1 = [system, {"role": "user", "content": "What is the capital of France?"}]
    answer = client.chat.completions.create(model=MODEL, messages=turn1, max_tokens=24,
                                            temperature=0).choices[0].message.content
    assert answer == offline.chat(turn1, greedy)[0].text
    time.sleep(1.5)  # the router polls its nodes every second
    before = _counters(cluster.url)
    turn2 = [*turn1, {"role": "assistant", "content": answer},
             {"role": "user", "content": "And of Spain?"}]
    reply = client.chat.completions.create(model=MODEL, messages=turn2, max_tokens=24,
                                           temperature=0)
    assert reply.choices[0].message.content == offline.chat(turn2, greedy)[0].text
    assert reply.usage.prompt_tokens_details.cached_tokens >= reply.usage.prompt_tokens - THRESHOLD
    time.sleep(1.5)
    after = _counters(cluster.url)
    assert after.get("decode-local", 0) == before.get("decode-local", 0) + 1
    assert after.get("prefill", 0) == before.get("prefill", 0)
    assert after["prefill_tokens"] == before["prefill_tokens"]


def test_requests_complete_when_a_prefill_node_dies(cluster: Cluster, client: OpenAI,
                                                    offline: LLM) -> None:
    """The prefill node is killed; the router does not know yet, its Prefill call fails,
    and the decode node computes the prompt instead (--on-transfer-failure recompute)."""
    prompt = "Tell me about the moon. " * 8  # over the threshold: it goes to the prefill pool
    want = offline.generate(prompt, SamplingParams(temperature=0.0, max_tokens=16))[0].text
    os.killpg(cluster.prefill.pid, signal.SIGKILL)
    cluster.prefill.wait(timeout=10)
    before = _counters(cluster.url)
    got = client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0)
    assert got.choices[0].text == want
    after = _counters(cluster.url)
    # Either the router tried the dead node and fell back, or it had already noticed.
    assert (after.get("retries-prefill", 0) == before.get("retries-prefill", 0) + 1
            or after.get("decode-local", 0) == before.get("decode-local", 0) + 1)


def test_requests_complete_when_a_decode_node_dies(cluster: Cluster, client: OpenAI,
                                                   offline: LLM) -> None:
    """One decode node is killed and requests arrive at once, spread over both nodes by
    their load: those that pick the dead one before the router notices are retried on
    the other one, and every one completes."""
    want = offline.generate("Once upon a time",
                            SamplingParams(temperature=0.0, max_tokens=8))[0].text
    os.killpg(cluster.decodes[0].pid, signal.SIGKILL)
    cluster.decodes[0].wait(timeout=10)
    with ThreadPoolExecutor(6) as pool:
        texts = list(pool.map(lambda _: client.completions.create(
            model=MODEL, prompt="Once upon a time", max_tokens=8,
            temperature=0).choices[0].text, range(6)))
    assert texts == [want] * 6
    assert _counters(cluster.url).get("retries-decode", 0) >= 1  # the dead one was tried
