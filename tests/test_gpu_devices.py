"""Nodes on any GPU (two or more CUDA devices): an engine on the second device captures
its CUDA graphs and steps from another thread (every new thread starts on device 0), and
`tandem up` places 1P1D across two GPUs (ipc and nccl) and two colocated nodes, each
giving the offline engine's tokens."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import torch
from serving_helpers import completion_token_ids, metric_samples, tandem_up

from tandem import LLM, SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                       reason="needs two CUDA devices"),
]

TINY = ["--model", "tiny", "--load-format", "dummy", "--skip-tokenizer-init",
        "--dtype", "bfloat16", "--gpu-memory-fraction", "0.2"]
PROMPTS = [[5, 17, 99, 3, 250, 41, 7], list(range(100, 400))]
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


@pytest.fixture(scope="module")
def expected() -> list[list[int]]:
    llm = LLM("tiny", load_format="dummy", device="cuda:0", dtype="bfloat16",
              kv_cache_memory_fraction=0.2)
    tokens = [out.token_ids for out in llm.generate(PROMPTS, GREEDY)]
    del llm
    torch.cuda.empty_cache()
    return tokens


def test_an_engine_on_the_second_device_steps_from_a_new_thread(expected) -> None:  # noqa: ANN001
    llm = LLM("tiny", load_format="dummy", device="cuda:1", dtype="bfloat16",
              kv_cache_memory_fraction=0.2)
    assert llm.engine.cuda_graphs  # captured on cuda:1 (this thread was on cuda:0)
    got: list[Any] = []
    worker = threading.Thread(target=lambda: got.append(llm.generate(PROMPTS, GREEDY)))
    worker.start()
    worker.join(120)
    assert [out.token_ids for out in got[0]] == expected
    assert torch.cuda.memory_allocated(1) > 0


@pytest.mark.parametrize("flags", [
    ["--prefill-devices", "cuda:0", "--decode-devices", "cuda:1", "--connector", "ipc"],
    ["--prefill-devices", "cuda:1", "--decode-devices", "cuda:0", "--connector", "nccl"],
    ["--colocated", "2", "--decode-devices", "cuda:0,cuda:1"],
], ids=["1P1D-ipc", "1P1D-nccl-reversed", "colocated-2"])
def test_tandem_up_serves_with_nodes_on_either_gpu(flags: list[str], expected) -> None:  # noqa: ANN001
    with tandem_up([*TINY, "--device", "cuda", *flags]) as (url, _, _):
        for _ in range(3):  # colocated: the router spreads them over both nodes
            assert [completion_token_ids(url, p, 16) for p in PROMPTS] == expected
        local = sum(v for name, labels, v in metric_samples(url)
                    if name == "tandem:router_requests_total"
                    and labels.get("pool") == "decode-local")
        # 1P1D: every prompt was computed on the other GPU and its KV crossed over.
        assert local == (3 * len(PROMPTS) if "--colocated" in flags else 0)
        deadline = time.monotonic() + 10  # the router polls its nodes' stats every second
        while not sum(v for name, labels, v in metric_samples(url)
                      if name == "tandem:engine_steps_total" and labels["kind"] == "decode_graph"):
            assert time.monotonic() < deadline, "no decode step replayed a CUDA graph"
            time.sleep(0.5)
