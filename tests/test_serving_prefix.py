"""Prefix-aware routing across nodes: two prefill nodes and a decode node publish their
KV blocks to a real redis-server (started here, on a free port); the router looks each
prompt up there. A request sharing a 512-token prefix with an earlier one goes to the
prefill node that computed it, and that node's prefix-cache hits show in the metrics.
The same with the router's in-memory index, fed by the nodes' block events."""

from __future__ import annotations

import json
import random
import time
import urllib.request
from collections.abc import Iterator

import pytest
from redis_server import RedisServer
from serving_helpers import free_port, metric_samples, node_address, start, stop, wait_up

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m-instruct"
ENGINE = ["--num-kv-blocks", "512", "--max-model-len", "2048"]
PREFIX_TOKENS = 512


@pytest.fixture(scope="module")
def routers() -> Iterator[dict[str, str]]:
    """Two prefill nodes and a decode node publishing to a redis-server, and two routers
    over them: one looks prompts up in Redis, one keeps its own index from the nodes'
    block events. index kind -> the router's URL."""
    redis = RedisServer().start()
    nodes = [start(["node", "--role", role, "--index", redis.url, *ENGINE])
             for role in ("prefill", "prefill", "decode")]
    procs = list(nodes)
    try:
        a, b, d = (node_address(p) for p in nodes)
        urls = {}
        for index in (redis.url, "memory"):
            port = free_port()
            procs.append(start(["router", "--port", str(port), "--prefill", a, "--prefill", b,
                                "--decode", d, "--index", index]))
            urls["memory" if index == "memory" else "redis"] = url = f"http://127.0.0.1:{port}"
            wait_up(url, procs[-1], every_node=True)
        yield urls
    finally:
        stop(procs)
        redis.stop()


def _prefill_metrics(url: str) -> dict[str, dict[str, float]]:
    """prefill node address -> {metric: value}, summed over tiers (prefix cache hits)."""
    out: dict[str, dict[str, float]] = {}
    for name, labels, value in metric_samples(url):
        if labels.get("node", "").startswith("prefill@"):
            node = out.setdefault(labels["node"].removeprefix("prefill@"), {})
            key = name.removeprefix("tandem:")
            node[key] = node.get(key, 0.0) + value
    return out


def _complete(url: str, prompt: list[int]) -> None:
    body = json.dumps({"model": MODEL, "prompt": prompt, "max_tokens": 2,
                       "temperature": 0}).encode()
    req = urllib.request.Request(f"{url}/v1/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        assert r.status == 200


def _settled(url: str, before: dict[str, dict[str, float]]) -> dict[str, dict[str, float]]:
    """The metrics once the router's poll has seen a request's prefill (1 s period)."""
    deadline = time.monotonic() + 10
    while True:
        now = _prefill_metrics(url)
        moved = sum(now[n]["node_prompt_tokens_computed_total"]
                    - before[n]["node_prompt_tokens_computed_total"] for n in now)
        if moved > 0 or time.monotonic() > deadline:
            time.sleep(1.2)  # and the block events / Redis writes that follow it
            return _prefill_metrics(url)
        time.sleep(0.2)


@pytest.mark.parametrize("index", ["redis", "memory"])
def test_a_shared_prefix_goes_to_the_node_that_holds_it(routers: dict[str, str],
                                                        index: str) -> None:
    url = routers[index]
    rng = random.Random(index)  # prefixes of its own: the nodes are shared
    homes = []
    for round_ in range(4):  # ties between the nodes break at random: 4 prefixes, 2 nodes
        prefix = [rng.randrange(100, 40000) for _ in range(PREFIX_TOKENS)]
        before = _prefill_metrics(url)
        _complete(url, prefix + [rng.randrange(100, 40000) for _ in range(20)])
        after = _settled(url, before)
        first = [n for n in after if after[n]["node_prompt_tokens_computed_total"]
                 > before[n]["node_prompt_tokens_computed_total"]]
        assert len(first) == 1, (round_, before, after)
        home = first[0]
        homes.append(home)
        # A second request with the same 512-token prefix and another ending.
        _complete(url, prefix + [rng.randrange(100, 40000) for _ in range(30)])
        again = _settled(url, after)
        computed = {n: again[n]["node_prompt_tokens_computed_total"]
                    - after[n]["node_prompt_tokens_computed_total"] for n in again}
        hits = {n: again[n]["prefix_cache_hits_total"] - after[n]["prefix_cache_hits_total"]
                for n in again}
        assert computed[home] == 30 and hits[home] == PREFIX_TOKENS, (round_, computed, hits)
        assert all(computed[n] == 0 for n in computed if n != home)
    hit_blocks = [v for name, _, v in metric_samples(url)
                  if name == "tandem:router_index_hit_blocks_total"]
    assert hit_blocks and hit_blocks[0] >= 4 * PREFIX_TOKENS // 16
