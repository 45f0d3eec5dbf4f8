"""Load past the router's limit (`tandem up`, real SmolLM2, 1P1D): 256 streaming requests
at once against `--max-concurrent-requests 64`. The excess gets 429 with Retry-After and
the OpenAI error JSON, every accepted request completes, /health answers within a second
throughout, and the nodes' memory after the run is within 10% of before."""

from __future__ import annotations

import http.client
import json
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
from serving_helpers import tandem_up

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m-instruct"
LIMIT, REQUESTS, TOKENS = 64, 256, 16


@dataclass
class Answer:
    status: int = 0
    retry_after: str | None = None
    error: dict | None = None
    tokens: int = 0
    done: bool = False


def _stream(port: int, i: int, answer: Answer) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    body = {"model": MODEL, "prompt": f"Request {i}: say something about the sky.",
            "max_tokens": TOKENS, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    conn.request("POST", "/v1/completions", json.dumps(body),
                 {"Content-Type": "application/json"})
    r = conn.getresponse()
    answer.status, answer.retry_after = r.status, r.getheader("Retry-After")
    if r.status != 200:
        answer.error = json.loads(r.read())["error"]
        return
    for raw in r:
        line = raw.decode().strip()
        if line == "data: [DONE]":
            answer.done = True
        elif line.startswith("data: "):
            event = json.loads(line[6:])
            answer.error = event.get("error", answer.error)
            # An event may carry several tokens (those that queued while the stream was
            # busy): the usage event counts them.
            if event.get("usage"):
                answer.tokens = event["usage"]["completion_tokens"]
    conn.close()


def _node_rss_kib(up: subprocess.Popen) -> dict[int, int]:
    """The resident memory of each node process `tandem up` started."""
    children = subprocess.run(["pgrep", "-f", "tandem.cli node"], capture_output=True,
                              text=True).stdout.split()
    out = {}
    for pid in map(int, children):
        try:
            status = open(f"/proc/{pid}/status").read()
        except FileNotFoundError:
            continue
        if f"PPid:\t{up.pid}\n" in status:
            out[pid] = int(status.split("VmRSS:")[1].split()[0])
    return out


def _run(port: int, n: int) -> list[Answer]:
    answers = [Answer() for _ in range(n)]
    threads = [threading.Thread(target=_stream, args=(port, i, a), daemon=True)
               for i, a in enumerate(answers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not any(t.is_alive() for t in threads), "a request hung"
    return answers


@pytest.fixture(scope="module")
def up() -> Iterator[tuple[str, subprocess.Popen, int]]:
    with tandem_up(["--max-concurrent-requests", str(LIMIT), "--num-kv-blocks", "512",
                    "--max-model-len", "512"]) as running:
        yield running


def test_256_streams_against_a_limit_of_64(up: tuple[str, subprocess.Popen, int]) -> None:
    url, proc, port = up
    warm = _run(port, LIMIT)  # the allocators' pools grow to the load once
    assert all(a.status == 200 and a.done for a in warm)
    before = _node_rss_kib(proc)
    assert len(before) == 2

    health_s: list[float] = []
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            started = time.monotonic()
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
            conn.request("GET", "/health")
            assert conn.getresponse().status == 200
            health_s.append(time.monotonic() - started)
            conn.close()
            time.sleep(0.1)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    answers = _run(port, REQUESTS)
    stop.set()
    watcher.join(10)

    accepted = [a for a in answers if a.status == 200]
    refused = [a for a in answers if a.status != 200]
    assert refused and len(accepted) >= LIMIT
    for a in refused:
        assert a.status == 429 and a.retry_after == "1"
        assert a.error is not None and a.error["code"] == "too_many_requests"
        assert set(a.error) == {"message", "type", "param", "code"}
    for a in accepted:
        assert a.done and a.error is None and a.tokens == TOKENS
    assert health_s and max(health_s) < 1.0, max(health_s)
    after = _node_rss_kib(proc)
    for pid, rss in before.items():
        assert abs(after[pid] - rss) <= 0.1 * rss, (before, after)
