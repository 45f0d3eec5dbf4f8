"""The operator's path, on real processes (`tandem node`, `tandem router`, `tandem ctl`)
with SmolLM2: the node listing, a node added at run time, a drain and a role switch under
load (no request fails, outputs stay the offline engine's), and bad operator input that
gets a clear error and changes nothing."""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import grpc
import pytest
from redis_server import RedisServer
from serving_helpers import Cluster, cluster, free_port, node_address, start, stop, wait_up

from tandem import LLM, SamplingParams
from tandem.node import auth
from tandem.protos import node_pb2 as pb
from tandem.protos import node_pb2_grpc as pb_grpc

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m-instruct"
SECRET, ADMIN, API_KEY = "operator-secret", "operator-admin", "operator-key"
ENGINE = ["--num-kv-blocks", "384", "--max-model-len", "2048"]
ROUTER = ["--admin-token", ADMIN, "--api-key", API_KEY]
TOKENS = 24  # ignore_eos: every request generates exactly this many


@dataclass
class Outcome:
    text: str = ""
    error: str | None = None
    sent: float = 0.0  # time.monotonic() when sent
    ttft: float | None = None  # seconds to the first token


def _complete(url: str, prompt: str, outcome: Outcome,
              first_token: threading.Event | None = None, max_tokens: int = TOKENS) -> None:
    """One streaming completion; its text, or what went wrong, in `outcome`."""
    host, port = url.removeprefix("http://").split(":")
    outcome.sent = time.monotonic()
    try:
        conn = http.client.HTTPConnection(host, int(port), timeout=300)
        body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                "ignore_eos": True, "stream": True}
        conn.request("POST", "/v1/completions", json.dumps(body),
                     {"Content-Type": "application/json", "Authorization": f"Bearer {API_KEY}"})
        r = conn.getresponse()
        if r.status != 200:
            outcome.error = f"{r.status}: {r.read()[:300]!r}"
            return
        pieces, done = [], False
        for raw in r:
            line = raw.decode().strip()
            if line == "data: [DONE]":
                done = True
                break
            if line.startswith("data: "):
                event = json.loads(line[6:])
                if "error" in event:
                    outcome.error = event["error"]["message"]
                    continue
                pieces.append(event["choices"][0]["text"])
                if outcome.ttft is None:
                    outcome.ttft = time.monotonic() - outcome.sent
                if first_token is not None:
                    first_token.set()
        outcome.text = "".join(pieces)
        if not done:
            outcome.error = outcome.error or "the stream ended without [DONE]"
    except (OSError, http.client.HTTPException) as exc:
        outcome.error = repr(exc)


def _want(offline: LLM, prompts: list[str]) -> list[str]:
    greedy = SamplingParams(temperature=0.0, max_tokens=TOKENS, ignore_eos=True)
    return [o.text for o in offline.generate(prompts, greedy)]


def _ctl(url: str, *args: str, token: str = ADMIN) -> subprocess.CompletedProcess:
    env = {**os.environ, "TANDEM_ADMIN_TOKEN": token}
    return subprocess.run([sys.executable, "-m", "tandem.cli", "ctl", "--router", url, *args],
                          env=env, capture_output=True, text=True, timeout=300)


def _nodes(url: str) -> dict[str, dict]:
    done = _ctl(url, "status", "--json")
    assert done.returncode == 0, done.stderr
    return {n["address"]: n for n in json.loads(done.stdout)["nodes"]}


def _generated(address: str) -> int:
    """Tokens the node has generated since it started, read from the node itself."""
    with auth.authenticated(grpc.insecure_channel(address), SECRET.encode()) as channel:
        return pb_grpc.NodeStub(channel).Stats(pb.StatsRequest(), timeout=10).generation_tokens


def _address(c: Cluster, proc: subprocess.Popen) -> str:
    return c.addresses[proc.pid]


def test_status_bad_input_and_a_node_added_at_run_time(offline: LLM) -> None:
    with cluster(1, 1, SECRET, ENGINE, router_flags=ROUTER) as c:
        prefill, decode = _address(c, c.prefill[0]), _address(c, c.decode[0])
        table = _ctl(c.url, "status")
        assert table.returncode == 0 and prefill in table.stdout and decode in table.stdout
        nodes = _nodes(c.url)
        assert {a: (n["role"], n["state"]) for a, n in nodes.items()} == {
            prefill: ("prefill", "up"), decode: ("decode", "up")}
        assert nodes[decode]["pid"] == c.decode[0].pid and nodes[decode]["loaded_at"] > 0
        assert set(nodes[decode]["load"]) >= {"running", "waiting", "kv_usage",
                                              "prompt_tokens_per_s", "ttft_ms", "itl_ms"}

        # Bad operator input: a clear error, an exit code a script can rely on, and
        # nothing changed.
        bad = [(("drain", "10.9.9.9:1"), 1, "unknown_node"),
               (("nodes", "remove", decode), 1, "last_in_pool"),
               (("drain", decode), 1, "last_in_pool"),
               (("set-role", prefill, "decode"), 1, "pool_would_be_empty"),
               (("nodes", "add", "127.0.0.1:1"), 1, "node_unreachable"),
               (("nodes", "add", decode), 1, "node_exists")]
        for args, code, why in bad:
            done = _ctl(c.url, *args)
            assert (done.returncode, why in done.stderr) == (code, True), (args, done.stderr)
            assert "Traceback" not in done.stderr
        for token, code in (("wrong-token", 4), (API_KEY, 4)):
            done = _ctl(c.url, "status", token=token)
            assert done.returncode == code and "Traceback" not in done.stderr, done.stderr
        assert _nodes(c.url).keys() == nodes.keys()
        assert all(n["state"] == "up" for n in _nodes(c.url).values())

        # A fresh node, added while serving: with the first decode node drained, the
        # next requests can only go to it.
        fresh = start(["node", "--role", "decode", *ENGINE])
        try:
            address = node_address(fresh)
            added = _ctl(c.url, "nodes", "add", address)
            assert added.returncode == 0, added.stderr
            assert _nodes(c.url)[address]["state"] == "up"
            assert _ctl(c.url, "drain", decode).returncode == 0
            assert _nodes(c.url)[decode]["state"] == "draining"
            before = _generated(address)
            prompts = ["Name a colour.", "Name a fruit."]
            outcomes = [Outcome() for _ in prompts]
            for p, o in zip(prompts, outcomes):
                _complete(c.url, p, o)
            assert [o.error for o in outcomes] == [None, None]
            assert [o.text for o in outcomes] == _want(offline, prompts)
            assert _generated(address) - before == TOKENS * len(prompts)
            ttft = _nodes(c.url)[address]["load"]["ttft_ms"]
            assert ttft is not None and 0 < ttft["p50"] <= ttft["p99"] < 60_000
            assert _ctl(c.url, "undrain", decode).returncode == 0
            assert _nodes(c.url)[decode]["state"] == "up"

            # Rebalanced to 2:1 and back, then the fresh node removed (drained first).
            for want in ((2, 1), (1, 2)):
                done = _ctl(c.url, "rebalance", "--prefill", str(want[0]),
                            "--decode", str(want[1]))
                assert done.returncode == 0, done.stderr
                roles = [n["role"] for n in _nodes(c.url).values()]
                assert (roles.count("prefill"), roles.count("decode")) == want
            fresh_role = _nodes(c.url)[address]["role"]
            removed = _ctl(c.url, "nodes", "remove", address)
            assert removed.returncode == (0 if fresh_role == "decode" else 1), removed.stderr
            if fresh_role == "decode":
                assert address not in _nodes(c.url)
                with auth.authenticated(grpc.insecure_channel(address),
                                        SECRET.encode()) as channel:  # free for another router
                    assert pb_grpc.NodeStub(channel).Health(pb.HealthRequest(),
                                                            timeout=10).accepting
        finally:
            stop([fresh])


@contextlib.contextmanager
def _second_router(c: Cluster, index: str) -> Iterator[str]:
    """Another router over the cluster's nodes (their roles learned with --node) and
    its Redis index; its URL."""
    port = free_port()
    other = start(["router", "--port", str(port), "--index", index, *ROUTER,
                   *[f"--node={a}" for a in c.addresses.values()]])
    try:
        url = f"http://127.0.0.1:{port}"
        wait_up(url, other, every_node=True)
        yield url
    finally:
        stop([other])


def test_drain_under_load_through_two_routers_loses_no_request(offline: LLM) -> None:
    """Two routers over the same nodes and Redis index, 16 streams through both: a drain
    of a busy decode node made through one router lets its streams finish, and neither
    router sends it anything new (the drain is the node's own); undrain brings it back."""
    prompts = [f"Write a short poem about the number {i}." for i in range(16)]
    redis = RedisServer().start()
    try:
        with (cluster(1, 2, SECRET, ENGINE, index=redis.url, router_flags=ROUTER) as c,
              _second_router(c, redis.url) as url2):
            assert {a: n["role"] for a, n in _nodes(url2).items()} == {
                a: n["role"] for a, n in _nodes(c.url).items()}
            outcomes = [Outcome() for _ in prompts]
            started = [threading.Event() for _ in prompts]
            threads = [threading.Thread(target=_complete, args=(u, p, o, e), daemon=True)
                       for u, p, o, e in zip([c.url, url2] * 8, prompts, outcomes, started)]
            for t in threads:
                t.start()
            assert all(e.wait(120) for e in started)
            busy = [a for a, n in _nodes(c.url).items()
                    if n["role"] == "decode" and n["in_flight"]]
            assert busy, "no decode node serves a request of the first router"
            drained = busy[0]
            done = _ctl(c.url, "drain", drained)
            assert done.returncode == 0, done.stderr
            deadline = time.monotonic() + 10  # the other router's next poll
            while _nodes(url2)[drained]["state"] != "draining":
                assert time.monotonic() < deadline
                time.sleep(0.2)
            for t in threads:
                t.join(120)
            assert [o.error for o in outcomes] == [None] * len(prompts)
            assert [o.text for o in outcomes] == _want(offline, prompts)
            # New requests, through either router, go to the other decode node only.
            before = _generated(drained)
            more = [Outcome() for _ in range(4)]
            for u, o in zip([c.url, url2] * 2, more):
                _complete(u, "Say hello.", o)
            assert [o.error for o in more] == [None] * 4 and _generated(drained) == before
            assert _ctl(c.url, "undrain", drained).returncode == 0
            assert _nodes(c.url)[drained]["state"] == "up"
    finally:
        redis.close()


def test_a_role_switch_under_load_keeps_the_weights_and_loses_no_request(
        offline: LLM) -> None:
    prompts = [f"Give me one fact about the planet number {i % 8}." for i in range(200)]
    with cluster(2, 2, SECRET, ENGINE, router_flags=ROUTER) as c:
        moved = _address(c, c.prefill[0])
        before = _nodes(c.url)[moved]
        outcomes: list[Outcome] = []
        stopping = threading.Event()

        def steady() -> None:  # requests back to back, two at a time
            i = 0
            while not stopping.is_set() and i < len(prompts):
                pair = [Outcome(), Outcome()]
                ts = [threading.Thread(target=_complete, args=(c.url, prompts[i + k], o))
                      for k, o in enumerate(pair)]
                for t in ts:
                    t.start()
                for t in ts:
                    t.join()
                outcomes.extend(pair)
                i += 2

        load = threading.Thread(target=steady, daemon=True)
        load.start()
        time.sleep(3)
        done = _ctl(c.url, "set-role", moved, "decode", "--timeout", "120")
        assert done.returncode == 0, done.stderr
        after = _nodes(c.url)[moved]
        assert (after["role"], after["state"]) == ("decode", "up")
        # The same process, its weights loaded once.
        assert (after["pid"], after["loaded_at"]) == (before["pid"], before["loaded_at"])
        assert after["pid"] == c.prefill[0].pid
        time.sleep(3)
        stopping.set()
        load.join(300)
        assert outcomes and [o.error for o in outcomes] == [None] * len(outcomes)
        assert [o.text for o in outcomes] == _want(offline, prompts[:len(outcomes)])
        # It serves decode: with the two first decode nodes drained, only it can.
        for proc in c.decode:
            assert _ctl(c.url, "drain", _address(c, proc)).returncode == 0
        generated = _generated(moved)
        last = Outcome()
        _complete(c.url, prompts[0], last)
        assert last.error is None and last.text == _want(offline, prompts[:1])[0]
        assert _generated(moved) - generated == TOKENS


class _Load:
    """`clients` threads sending one kind of request back to back until stopped."""

    def __init__(self, url: str, clients: int, prompt: str, max_tokens: int) -> None:
        self.outcomes: list[Outcome] = []
        self._stop = threading.Event()

        def client(i: int) -> None:
            n = 0
            while not self._stop.is_set():
                o = Outcome()
                n += 1  # a prompt of its own: no prefix-cache hit
                _complete(url, f"Request {n} of client {i}. {prompt}", o, max_tokens=max_tokens)
                self.outcomes.append(o)

        self._threads = [threading.Thread(target=client, args=(i,), daemon=True)
                         for i in range(clients)]
        for t in self._threads:
            t.start()

    def stop(self) -> list[Outcome]:
        self._stop.set()
        for t in self._threads:
            t.join(300)
        return self.outcomes

    def ttft_p90(self, since: float, until: float) -> tuple[float, int]:
        ttfts = sorted(o.ttft for o in self.outcomes
                       if o.ttft is not None and since <= o.sent < until)
        assert len(ttfts) >= 5, f"{len(ttfts)} requests in the window"
        return ttfts[-(-9 * len(ttfts) // 10) - 1], len(ttfts)


def _planner(url: str) -> dict:
    done = _ctl(url, "planner", "show", "--json")
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def _until_switch(url: str, to: str, timeout_s: float) -> tuple[dict, float]:
    """The planner's first switch to `to` that is done, and when its node was seen in
    the new pool, up (time.monotonic())."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        done = [d for d in _planner(url)["decisions"] if d["to"] == to and d["outcome"] == "done"]
        if done:
            node = _nodes(url)[done[0]["node"]]
            assert (node["role"], node["state"]) == (to, "up")
            return done[0], time.monotonic()
        time.sleep(0.5)
    raise AssertionError(f"no switch to {to} within {timeout_s:g}s: {_planner(url)}")


def test_the_planner_moves_a_node_to_the_pool_that_needs_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """1 prefill + 3 decode nodes, one core's worth of threads each. Prompt-heavy load
    queues on the prefill node: in advisory mode the planner says to move a decode node
    and moves nothing; enabled, it moves one, and TTFT p90 drops. Then output-heavy load
    queues on the decode nodes and it moves one back."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # a node is one device's worth of compute
    prompt = "Summarise the history of the lighthouse in a single short line. " * 8
    flags = [*ROUTER, "--planner", "load", "--planner-advisory"]
    with cluster(1, 3, SECRET, [*ENGINE, "--max-num-seqs", "4"], router_flags=flags) as c:
        assert _ctl(c.url, "planner", "set", "interval_s=1", "cooldown_s=4",
                    "window_s=10").returncode == 0
        roles = {a: n["role"] for a, n in _nodes(c.url).items()}
        heavy = _Load(c.url, 10, prompt, max_tokens=2)
        try:
            deadline = time.monotonic() + 90
            while not [d for d in _planner(c.url)["decisions"] if d["outcome"] == "advised"]:
                assert time.monotonic() < deadline, "no advice within 90 s"
                time.sleep(0.5)
            advice = _planner(c.url)["decisions"][0]
            assert (advice["from"], advice["to"]) == ("decode", "prefill"), advice
            assert {a: n["role"] for a, n in _nodes(c.url).items()} == roles
            assert _ctl(c.url, "planner", "enable", "--mode", "load").returncode == 0
            enabled = time.monotonic()
            decision, switched = _until_switch(c.url, "prefill", 90)
            time.sleep(20)
        finally:
            outcomes = heavy.stop()
        assert [o.error for o in outcomes] == [None] * len(outcomes)
        before, n_before = heavy.ttft_p90(enabled - 20, enabled)
        after, n_after = heavy.ttft_p90(switched + 2, switched + 20)
        print(f"TTFT p90 before the move {before:.2f}s ({n_before} requests), after "
              f"{after:.2f}s ({n_after}); the decision: {decision['reason']}")
        assert after < before

        chatty = _Load(c.url, 16, "Count slowly.", max_tokens=48)
        try:
            back, _ = _until_switch(c.url, "decode", 120)
        finally:
            outcomes = chatty.stop()
        assert [o.error for o in outcomes] == [None] * len(outcomes)
        assert back["from"] == "prefill"
