"""The prefill pool's overflow goes to the decode node (`--prefill-overflow-ms`): real
`tandem node` processes (1P1D, the tiny model) and a `tandem router`. A burst whose
prompts would queue on the prefill node is split: some computed there, the rest by the
decode node itself; every answer equals the offline engine's, and the router counts
what overflowed. Without the flag nothing does."""

from __future__ import annotations

import random
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from serving_helpers import cluster, completion_token_ids, metric_samples

from tandem import LLM, SamplingParams

pytestmark = pytest.mark.slow

SECRET = "overflow-test-secret"
TINY = ["--model", "tiny", "--load-format", "dummy", "--skip-tokenizer-init",
        "--num-kv-blocks", "512", "--max-model-len", "1024"]


def _counts(url: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for name, labels, value in metric_samples(url):
        if name == "tandem:router_requests_total":
            out[labels["pool"]] = value
        elif name == "tandem:router_prefill_overflows_total":
            out["overflows"] = value
    return out


@pytest.mark.parametrize("overflow_ms", [None, "1"], ids=["off", "1ms"])
def test_a_burst_overflows_the_prefill_queue_onto_the_decode_node(overflow_ms: str | None
                                                                  ) -> None:
    rng = random.Random(7)
    prompts = [[rng.randrange(3, 250) for _ in range(300)] for _ in range(12)]
    offline = LLM("tiny", load_format="dummy")
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    want = [out.token_ids for out in offline.generate(prompts, greedy)]
    router = ["--model", "tiny", "--load-format", "dummy", "--skip-tokenizer-init"]
    if overflow_ms is not None:
        router += ["--prefill-overflow-ms", overflow_ms]
    with cluster(1, 1, SECRET, TINY, router_flags=router) as c:
        warm = [rng.randrange(3, 250) for _ in range(300)]
        completion_token_ids(c.url, warm, 6)  # the prefill node computes a prompt: a rate
        time.sleep(2.5)  # the router polls its nodes' Stats every second
        with ThreadPoolExecutor(len(prompts)) as pool:
            got = list(pool.map(lambda p: completion_token_ids(c.url, p, 6), prompts))
        assert got == want
        counts = _counts(c.url)
    assert counts.get("prefill", 0) + counts.get("decode-local", 0) == len(prompts) + 1
    if overflow_ms is None:
        assert counts.get("overflows", 0) == 0 and counts.get("decode-local", 0) == 0
    else:
        # The first prompt finds the prefill node's queue empty; later ones find it
        # holding prompts, and go to the decode node while its own queue is shorter.
        assert 0 < counts["overflows"] == counts["decode-local"] < len(prompts)
