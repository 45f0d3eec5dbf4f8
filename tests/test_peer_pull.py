"""Prefix pulls between peers (node/pull.py), real processes: two prefill nodes and a
decode node publishing their blocks to a real redis-server, a router over them, SmolLM2.
A prefix computed on prefill node A is pulled by prefill node B while A is drained,
counted under tier="peer", the outputs the offline engine's; a holder killed in the
middle of a pull leaves the request computed, no block held anywhere, nothing hung; a
pull with the wrong cluster secret is refused."""

from __future__ import annotations

import json
import os
import random
import signal
import threading
import time
import urllib.request
from collections.abc import Iterator

import grpc
import pytest
from redis_server import RedisServer
from serving_helpers import Cluster, cluster, metric_samples

from tandem import LLM, SamplingParams
from tandem.node import auth
from tandem.protos import node_pb2 as pb
from tandem.protos import node_pb2_grpc as pb_grpc

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m-instruct"
SECRET = "peer-pull-secret"
ENGINE = ["--num-kv-blocks", "256", "--max-model-len", "1024"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8)


@pytest.fixture(scope="module")
def pool() -> Iterator[Cluster]:
    redis = RedisServer().start()
    try:
        # Pull whenever a peer holds more (by default, where the measured rates say a
        # pull is faster: on 2 CPU cores, with this small model, about even).
        with cluster(2, 1, SECRET, ENGINE, index=redis.url,
                     router_flags=["--prefix-pull", "always"]) as c:
            yield c
    finally:
        redis.stop()


def _prompt(seed: int, n: int = 320) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 40000) for _ in range(n)]


def _complete(url: str, prompt: list[int]) -> str:
    body = json.dumps({"model": MODEL, "prompt": prompt, "max_tokens": 8, "temperature": 0})
    req = urllib.request.Request(f"{url}/v1/completions", data=body.encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())["choices"][0]["text"]


def _by_node(url: str) -> dict[str, dict[str, float]]:
    """node address -> {metric (tier-labelled ones as name:tier): value}."""
    out: dict[str, dict[str, float]] = {}
    for name, labels, value in metric_samples(url):
        if "@" in labels.get("node", ""):
            key = name.removeprefix("tandem:") + (f":{labels['tier']}" if "tier" in labels else "")
            out.setdefault(labels["node"].split("@", 1)[1], {})[key] = value
    return out


def _settled(url: str, until: callable, seconds: float = 15) -> dict[str, dict[str, float]]:
    """The nodes' metrics once `until(metrics)` holds (the router polls every second)."""
    deadline = time.monotonic() + seconds
    while not until(now := _by_node(url)) and time.monotonic() < deadline:
        time.sleep(0.3)
    return now


def _stub(address: str, secret: str = SECRET) -> tuple[grpc.Channel, pb_grpc.NodeStub]:
    channel = auth.authenticated(grpc.insecure_channel(address), secret.encode())
    return channel, pb_grpc.NodeStub(channel)


def _drain(address: str, drain: bool) -> None:
    channel, stub = _stub(address)
    with channel:
        stub.Drain(pb.DrainRequest(drain=drain), timeout=30)
    time.sleep(1.5)  # the router's next Health poll sees it


def _computed_on(pool: Cluster, before: dict[str, dict[str, float]]) -> str:
    """The prefill node that computed the last prompt."""
    prefills = [pool.addresses[p.pid] for p in pool.prefill]
    now = _settled(pool.url, lambda m: any(
        m[a]["node_prompt_tokens_computed_total"]
        > before[a]["node_prompt_tokens_computed_total"] for a in prefills))
    return max(prefills, key=lambda a: now[a]["node_prompt_tokens_computed_total"]
               - before[a]["node_prompt_tokens_computed_total"])


def test_a_prefix_computed_on_one_prefill_node_is_pulled_by_the_other(pool: Cluster,
                                                                     offline: LLM) -> None:
    prefix, follow_up = _prompt(1), _prompt(1) + _prompt(2, 40)
    want = [o.text for o in offline.generate([prefix, follow_up], GREEDY)]
    before = _by_node(pool.url)
    assert _complete(pool.url, prefix) == want[0]
    a = _computed_on(pool, before)
    b = next(pool.addresses[p.pid] for p in pool.prefill if pool.addresses[p.pid] != a)
    _drain(a, True)
    try:
        before = _by_node(pool.url)
        assert _complete(pool.url, follow_up) == want[1]  # computed on b, its prefix pulled
        now = _settled(pool.url, lambda m: m[b]["prefix_cache_hits_total:peer"]
                       > before[b]["prefix_cache_hits_total:peer"])
    finally:
        _drain(a, False)
    pulled = now[b]["prefix_cache_hits_total:peer"] - before[b]["prefix_cache_hits_total:peer"]
    assert pulled >= 304  # the prefix's whole blocks but the last token's
    assert now[b]["kv_pulled_bytes_total"] > before[b]["kv_pulled_bytes_total"]
    computed = (now[b]["node_prompt_tokens_computed_total"]
                - before[b]["node_prompt_tokens_computed_total"])
    assert computed == len(follow_up) - pulled  # only what it lacked


def test_a_pull_with_the_wrong_cluster_secret_is_refused(pool: Cluster) -> None:
    channel, stub = _stub(pool.addresses[pool.prefill[0].pid], secret="not-the-secret")
    with channel, pytest.raises(grpc.RpcError) as refused:
        stub.Pull(pb.PullRequest(request=pb.Request(request_id="x/pull",
                                                    prompt_token_ids=_prompt(1, 32))),
                  timeout=10)
    assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_a_holder_killed_in_the_middle_of_a_pull_leaves_it_computed(pool: Cluster,
                                                                     offline: LLM) -> None:
    """The holder's engine process stops answering while the pull waits on it, then is
    killed: the pull fails, the prompt is computed, and no block stays held."""
    prefix, follow_up = _prompt(3), _prompt(3) + _prompt(4, 40)
    want = [o.text for o in offline.generate([prefix, follow_up], GREEDY)]
    before = _by_node(pool.url)
    assert _complete(pool.url, prefix) == want[0]
    a = _computed_on(pool, before)
    holder = next(p for p in pool.prefill if pool.addresses[p.pid] == a)
    b = next(pool.addresses[p.pid] for p in pool.prefill if p is not holder)
    _drain(a, True)
    before = _by_node(pool.url)
    os.kill(holder.pid, signal.SIGSTOP)  # its gRPC front takes the Pull, forwards it, waits
    got: list[str] = []
    began = time.monotonic()
    call = threading.Thread(target=lambda: got.append(_complete(pool.url, follow_up)))
    call.start()
    time.sleep(1.0)  # the request is on b, its pull waiting on a
    os.kill(holder.pid, signal.SIGKILL)
    call.join(60)
    assert got == [want[1]] and time.monotonic() - began < 30
    decode = pool.addresses[pool.decode[0].pid]
    now = _settled(pool.url, lambda m: m[b]["kv_pulls_failed_total"]
                   > before[b]["kv_pulls_failed_total"]
                   and not m[b]["kv_blocks_used"] and not m[decode]["kv_blocks_used"])
    assert now[b]["kv_pulls_failed_total"] == before[b]["kv_pulls_failed_total"] + 1
    assert now[b]["prefix_cache_hits_total:peer"] == before[b]["prefix_cache_hits_total:peer"]
    assert now[b]["kv_blocks_used"] == 0 and now[decode]["kv_blocks_used"] == 0


def test_a_prefix_in_the_holders_host_tier_is_pulled_too(offline: LLM) -> None:
    """The devices are too small to keep the prefix: it sits in the holders' host tiers
    when B pulls it, and the holder copies it back to its device to push it."""
    engine = ["--num-kv-blocks", "48", "--max-model-len", "1024", "--kv-host-gib", "0.05"]
    prefix, follow_up = _prompt(5), _prompt(5) + _prompt(6, 40)
    others = [_prompt(10 + i) for i in range(3)]  # each fills most of a device cache
    want = [o.text for o in offline.generate([prefix, follow_up, *others], GREEDY)]
    redis = RedisServer().start()
    try:
        with cluster(2, 1, SECRET, engine, index=redis.url,
                     router_flags=["--prefix-pull", "always"]) as c:
            before = _by_node(c.url)
            assert _complete(c.url, prefix) == want[0]
            a = _computed_on(c, before)
            b = next(c.addresses[p.pid] for p in c.prefill if c.addresses[p.pid] != a)
            _drain(b, True)  # the others go to a too, and push the prefix out of its device
            assert [_complete(c.url, p) for p in others] == want[2:]
            _drain(b, False)
            _drain(a, True)
            before = _by_node(c.url)
            assert _complete(c.url, follow_up) == want[1]
            now = _settled(c.url, lambda m: m[b]["prefix_cache_hits_total:peer"]
                           > before[b]["prefix_cache_hits_total:peer"])
            # Every node's device lost the prefix to the others: it came from a host tier.
            assert now[b]["prefix_cache_hits_total:peer"] >= 304
    finally:
        redis.stop()
