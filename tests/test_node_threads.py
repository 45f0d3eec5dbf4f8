"""A node's calls cost memory, not threads (issue 24): a real `tandem node` (a tiny model;
its process and its gRPC front's) holds 5,000 concurrent Generate streams with under 100
threads, every one completes, and `grpc.health.v1` answers for Kubernetes' probes
(readiness off while it drains, liveness on)."""

from __future__ import annotations

import asyncio
import random
import threading
import time
from pathlib import Path

import grpc
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from serving_helpers import node_address, start, stop
from transformers import LlamaConfig, LlamaForCausalLM

from tandem import SamplingParams
from tandem.node import convert
from tandem.protos import node_pb2 as pb
from tandem.protos import node_pb2_grpc as pb_grpc

STREAMS = 5000
PARAMS = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


def _tiny(path: Path) -> Path:
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=512, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(path)
    return path


def _threads(pid: int) -> int:
    """The threads of process `pid` and of its children (a node's gRPC front)."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        for child in (task / "children").read_text().split():
            total += _threads(int(child))
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Threads:"):
            return total + int(line.split()[1])
    raise AssertionError("no Threads line")


async def _generate(stub: pb_grpc.NodeStub, i: int, rng: random.Random) -> int:
    request = pb.Request(request_id=f"r{i}", prompt_token_ids=[rng.randrange(3, 256)
                                                                for _ in range(6)],
                         sampling=convert.sampling_to_pb(PARAMS))
    tokens = 0
    async for chunk in stub.Generate(pb.GenerateRequest(request=request), timeout=600):
        tokens += len(chunk.token_ids)
    return tokens


async def _burst(address: str) -> list[int]:
    rng = random.Random(1)
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.NodeStub(channel)
        return await asyncio.gather(*(_generate(stub, i, rng) for i in range(STREAMS)))


def test_5000_concurrent_streams_cost_no_thread_each(tmp_path):  # noqa: ANN001
    model = _tiny(tmp_path / "tiny")
    node = start(["node", "--role", "decode", "--model", str(model), "--num-kv-blocks", "256",
                  "--max-num-seqs", "64", "--max-model-len", "256"])
    try:
        address = node_address(node)
        peak = [0]
        done = threading.Event()

        def sample() -> None:
            while not done.wait(0.2):
                peak[0] = max(peak[0], _threads(node.pid))

        sampler = threading.Thread(target=sample)
        sampler.start()
        try:
            tokens = asyncio.run(_burst(address))
        finally:
            done.set()
            sampler.join()
        assert tokens == [4] * STREAMS
        assert 0 < peak[0] < 100, f"the node ran {peak[0]} threads"
        with grpc.insecure_channel(address) as channel:
            stats = pb_grpc.NodeStub(channel).Stats(pb.StatsRequest(), timeout=10)
            assert (stats.num_running, stats.num_waiting) == (0, 0)
    finally:
        stop([node])


def test_grpc_health_serves_for_kubernetes_probes(tmp_path):  # noqa: ANN001
    model = _tiny(tmp_path / "tiny")
    node = start(["node", "--role", "decode", "--model", str(model), "--num-kv-blocks", "64",
                  "--cluster-secret", "probe-secret"])
    try:
        address = node_address(node)
        with grpc.insecure_channel(address) as channel:  # no cluster secret: probes have none
            health = health_pb2_grpc.HealthStub(channel)

            def status(service: str) -> int:
                return health.Check(health_pb2.HealthCheckRequest(service=service),
                                    timeout=5).status

            serving = health_pb2.HealthCheckResponse.SERVING
            deadline = time.monotonic() + 10
            while status("tandem.Node") != serving and time.monotonic() < deadline:
                time.sleep(0.2)
            assert status("") == status("tandem.Node") == serving
            try:  # the node service itself still needs the secret
                pb_grpc.NodeStub(channel).Drain(pb.DrainRequest(drain=True), timeout=5)
                raise AssertionError("a call without the cluster secret was obeyed")
            except grpc.RpcError as exc:
                assert exc.code() == grpc.StatusCode.UNAUTHENTICATED
    finally:
        stop([node])
