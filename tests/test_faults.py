"""The fault matrix: a real cluster (`tandem node` and `tandem router` processes, SmolLM2,
the cluster secret on every call) with one part killed, stopped or taken away under
load. Each case ends with every request either completed with the offline engine's
greedy output or ended with a clean error (the OpenAI error JSON; in a stream, an error
event and then `[DONE]`), none hung, and no KV block held on any live node once idle.

Client disconnects (streaming and not) and two clients sending one `X-Request-Id` are
cases of `tests/test_serving.py`, against `tandem up`."""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import grpc
import pytest
from redis_server import RedisServer
from serving_helpers import Cluster, cluster, metric_samples, stderr_tail

from tandem import LLM, SamplingParams
from tandem.node import auth
from tandem.protos import node_pb2 as pb
from tandem.protos import node_pb2_grpc as pb_grpc

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m-instruct"
SECRET = "fault-matrix-secret"
ENGINE = ["--num-kv-blocks", "384", "--max-model-len", "2048"]
TOKENS = 8
HUNG_S = 120.0  # a request with no end by then is hung
LASTING = {"max_tokens": 48, "ignore_eos": True}  # a stream still going seconds later


def _long(i: int) -> str:  # ~700 tokens: a prefill of a second or two on the CPU
    return f"Story {i}: tell me about the moon and its phases, please. " * 60


@contextlib.contextmanager
def _cluster(prefill: int = 1, decode: int = 1, index: str | None = None
             ) -> Iterator[Cluster]:
    with cluster(prefill, decode, SECRET, ENGINE, index) as c:
        yield c


@dataclass
class Outcome:
    text: str = ""
    error: dict | None = None  # the OpenAI error JSON (a status, or a stream's event)
    done: bool = False  # a stream's [DONE], or a whole body
    tokens_before_error: int = 0
    lost: str | None = None  # the connection broke: only the router's death may do that


def _request(url: str, prompt: str, stream: bool, outcome: Outcome,
             first_token: threading.Event | None = None, **extra: object) -> None:
    try:
        _exchange(url, prompt, stream, outcome, first_token, extra)
    except (OSError, http.client.HTTPException) as exc:
        outcome.lost = repr(exc)


def _exchange(url: str, prompt: str, stream: bool, outcome: Outcome,
              first_token: threading.Event | None, extra: dict[str, object]) -> None:
    """One completion over raw HTTP, its end recorded in `outcome`."""
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=HUNG_S)
    body = {"model": MODEL, "prompt": prompt, "max_tokens": TOKENS, "temperature": 0,
            "stream": stream, **extra}
    conn.request("POST", "/v1/completions", json.dumps(body),
                 {"Content-Type": "application/json"})
    r = conn.getresponse()
    if r.status != 200:
        outcome.error, outcome.done = json.loads(r.read())["error"], True
        return
    if not stream:
        outcome.text, outcome.done = json.loads(r.read())["choices"][0]["text"], True
        return
    pieces = []
    for raw in r:
        line = raw.decode().strip()
        if not line.startswith("data: "):
            continue
        if line == "data: [DONE]":
            outcome.done = True
            break
        event = json.loads(line[6:])
        if "error" in event:
            outcome.error, outcome.tokens_before_error = event["error"], len(pieces)
            continue
        pieces.append(event["choices"][0]["text"])
        if first_token is not None:
            first_token.set()
    outcome.text = "".join(pieces)
    if not outcome.done:
        outcome.lost = "the stream ended without [DONE]"


def _run(url: str, prompts: list[str], stream: bool, fault: Callable[[], None],
         ) -> list[Outcome]:
    """The prompts' requests all at once, `fault()` meanwhile; each one's outcome, none
    hung."""
    outcomes = [Outcome() for _ in prompts]
    threads = [threading.Thread(target=_request, args=(url, p, stream, o), daemon=True)
               for p, o in zip(prompts, outcomes)]
    for t in threads:
        t.start()
    fault()
    for t in threads:
        t.join(HUNG_S)
    assert not any(t.is_alive() for t in threads), "a request hung"
    return outcomes


def _check(outcomes: list[Outcome], want: list[str]) -> None:
    for o, w in zip(outcomes, want):
        assert o.lost is None and o.done, f"a request ended without [DONE] or a body: {o}"
        if o.error is None:
            assert o.text == w
        else:  # a clean error: the OpenAI shape
            assert set(o.error) == {"message", "type", "param", "code"}
            assert o.error["message"]


def _stub(address: str) -> pb_grpc.NodeStub:
    channel = auth.authenticated(grpc.insecure_channel(address), SECRET.encode())
    return pb_grpc.NodeStub(channel)


def _held(address: str) -> dict[str, int]:
    """What the node at `address` holds: requests running, waiting, reserved, and blocks
    in use; nothing is {}."""
    s = _stub(address).Stats(pb.StatsRequest(), timeout=10)
    held = {"running": s.num_running, "waiting": s.num_waiting, "reserved": s.num_reserved,
            "blocks": s.kv_blocks_total - s.kv_blocks_free}
    return {what: n for what, n in held.items() if n}


def _holding(cluster: Cluster, alive: list[subprocess.Popen]) -> dict[str, dict[str, int]]:
    """The live nodes that hold something, by address: what each holds."""
    held = {cluster.addresses[p.pid]: _held(cluster.addresses[p.pid]) for p in alive}
    return {address: h for address, h in held.items() if h}


def _all_idle(cluster: Cluster, alive: list[subprocess.Popen], timeout: float = 60.0) -> None:
    """Every live node holds nothing, read from the nodes and from the router's /metrics."""
    deadline = time.monotonic() + timeout
    while held := _holding(cluster, alive):
        if time.monotonic() > deadline:
            logs = "".join(f"\n--- {cluster.addresses[p.pid]}'s stderr ends:\n"
                           f"{stderr_tail(p)}" for p in alive
                           if cluster.addresses[p.pid] in held)
            raise AssertionError(f"still held once idle: {held}{logs}\n--- the router's "
                                 f"stderr ends:\n{stderr_tail(cluster.router)}")
        time.sleep(0.2)
    live = {cluster.addresses[p.pid] for p in alive}
    while True:  # the router polls its nodes every second
        used = {labels["node"]: v for name, labels, v in metric_samples(cluster.url)
                if name == "tandem:kv_blocks_used" and labels["node"].split("@")[1] in live}
        if len(used) == len(live) and not any(used.values()):
            return
        assert time.monotonic() < deadline + 10, f"the router still counts blocks: {used}"
        time.sleep(0.5)


def _want(offline: LLM, prompts: list[str], **extra: object) -> list[str]:
    greedy = SamplingParams(temperature=0.0, **{"max_tokens": TOKENS, **extra})
    return [o.text for o in offline.generate(prompts, greedy)]


def _kill(proc: subprocess.Popen, sig: int = signal.SIGKILL) -> None:
    os.killpg(proc.pid, sig)


def test_the_prefill_node_killed_mid_prefill(offline: LLM) -> None:
    """The decode nodes compute the prompts themselves (the default recompute)."""
    prompts = [_long(i) for i in range(3)]
    with _cluster(prefill=1, decode=1) as c:
        outcomes = _run(c.url, prompts, True, lambda: (time.sleep(0.7), _kill(c.prefill[0])))
        _check(outcomes, _want(offline, prompts))
        assert all(o.error is None for o in outcomes)  # nothing had reached the client
        _all_idle(c, c.decode)


def test_a_decode_node_killed_mid_stream(offline: LLM) -> None:
    """Streams on the killed node that had sent tokens end with an error event and
    [DONE]; the others complete (on either node)."""
    prompts = [f"Tell me a long story about the number {i}." for i in range(6)]
    started = [threading.Event() for _ in prompts]
    outcomes = [Outcome() for _ in prompts]
    with _cluster(prefill=1, decode=2) as c:
        threads = []
        for p, o, e in zip(prompts, outcomes, started):
            threads.append(threading.Thread(target=_request, args=(c.url, p, True, o, e),
                                            kwargs=LASTING, daemon=True))
            threads[-1].start()
        assert all(e.wait(HUNG_S) for e in started)
        _kill(c.decode[0])
        for t in threads:
            t.join(HUNG_S)
        assert not any(t.is_alive() for t in threads), "a request hung"
        _check(outcomes, _want(offline, prompts, **LASTING))
        broken = [o for o in outcomes if o.error is not None]
        assert broken, "no stream was on the killed node"
        assert all(o.tokens_before_error >= 1 and o.error["type"] == "server_error"
                   for o in broken)
        _all_idle(c, [*c.prefill, c.decode[1]])


def test_the_router_killed_mid_request_frees_every_block() -> None:
    """The router dies with requests in their prefill and in their decode: each node
    sees its call end and frees the request's blocks, without waiting for a lease."""
    with _cluster(prefill=1, decode=1) as c:
        outcomes = [Outcome() for _ in range(3)]
        decoding = threading.Event()  # the first request streams: it is in its decode
        endless = {"max_tokens": 1000, "ignore_eos": True}
        jobs = [("Count to one hundred.", decoding, endless), (_long(0), None, {}),
                (_long(1), None, {})]
        threads = [threading.Thread(target=_request, args=(c.url, p, True, o, e), kwargs=x,
                                    daemon=True) for (p, e, x), o in zip(jobs, outcomes)]
        threads[0].start()
        assert decoding.wait(HUNG_S)
        for t in threads[1:]:
            t.start()
        time.sleep(0.5)  # the long prompts are in their prefill
        _kill(c.router)
        for t in threads:
            t.join(HUNG_S)
        assert all(o.lost and not o.done for o in outcomes), outcomes
        deadline = time.monotonic() + 30
        alive = [*c.prefill, *c.decode]
        while held := _holding(c, alive):
            assert time.monotonic() < deadline, f"kept after the router died: {held}"
            time.sleep(0.2)


def test_redis_killed_and_restarted_during_a_run(offline: LLM) -> None:
    """Twenty requests in a row; Redis is killed after five and back after ten: every
    request completes, and once Redis is back the index answers prefix lookups again."""
    system = "You are a careful assistant. Answer in one short sentence. " * 4
    prompts = [f"{system}Question {i}: what is {i} plus {i}?" for i in range(20)]
    redis = RedisServer().start()
    try:
        with _cluster(prefill=1, decode=1, index=redis.url) as c:
            texts = []
            for i, prompt in enumerate(prompts):
                if i == 5:
                    redis.kill()
                elif i == 10:
                    redis.start()
                outcome = Outcome()
                _request(c.url, prompt, False, outcome)
                assert outcome.error is None, outcome.error
                texts.append(outcome.text)
            assert texts == _want(offline, prompts)
            # A prefix new since the restart: published again, then found by the router.
            fresh = "A brand new preamble about lighthouses and the sea. " * 6
            hits = _hit_blocks(c.url)
            for i in range(2):
                _request(c.url, f"{fresh}Question {i}?", False, Outcome())
                time.sleep(0.5)  # the node publishes its new blocks
            assert redis.client().dbsize() > 0
            assert _hit_blocks(c.url) > hits
            _all_idle(c, [*c.prefill, *c.decode])
    finally:
        redis.close()


def _hit_blocks(url: str) -> float:
    return next(v for name, _, v in metric_samples(url)
                if name == "tandem:router_index_hit_blocks_total")


def test_a_decode_node_that_stops_reading_during_a_push(offline: LLM) -> None:
    """The decode node a long prompt's KV is pushed to is stopped (SIGSTOP) mid-push:
    the prefill node keeps serving requests bound for the other decode node, the stopped
    node's request is retried there once the router finds it silent, and after SIGCONT
    nothing stays held."""
    stuck = _long(7)
    others = [f"Name a fruit that starts with the letter {c}." for c in "ABCD"]
    with _cluster(prefill=1, decode=2) as c:
        first = Outcome()
        t = threading.Thread(target=_request, args=(c.url, stuck, True, first), daemon=True)
        t.start()  # both decode nodes idle: the router picks the first
        time.sleep(0.5)  # reserved there; the prefill node computes, then pushes
        _kill(c.decode[0], signal.SIGSTOP)
        began = time.monotonic()
        outcomes = _run(c.url, others, False, lambda: None)
        took = time.monotonic() - began
        _check(outcomes, _want(offline, others))
        assert all(o.error is None for o in outcomes)
        assert took < 25, f"the other requests waited {took:.1f}s on the stuck push"
        t.join(HUNG_S)
        assert not t.is_alive() and first.done
        _check([first], _want(offline, [stuck]))
        _kill(c.decode[0], signal.SIGCONT)
        _all_idle(c, [*c.prefill, *c.decode])
