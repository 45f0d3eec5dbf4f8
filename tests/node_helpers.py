"""A prefill node and a decode node for the tests of a node's calls: each a real gRPC
server on loopback over its own engine (a tiny Llama that transformers wrote), and the
calls a router makes to them."""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import grpc
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from tandem import LLM, SamplingParams
from tandem.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from tandem.engine.llm_engine import LLMEngine
from tandem.node import convert
from tandem.node.grpc_server import serve
from tandem.node.server import NodeService
from tandem.protos import node_pb2 as pb
from tandem.protos import node_pb2_grpc as pb_grpc

NEW_TOKENS = 24
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
LENGTHS = [5, 16, 17, 40, 100]


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):  # noqa: ANN001, ANN201
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=1024, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(1234)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():  # decisive next tokens: no near-ties between the two paths
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.15)
    path = tmp_path_factory.mktemp("tiny-llama")
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    rng = random.Random(3)
    return [[rng.randrange(3, 256) for _ in range(n)] for n in LENGTHS]


@pytest.fixture(scope="module")
def expected(model_path, prompts) -> list[list[int]]:  # noqa: ANN001
    llm = LLM(str(model_path), num_kv_blocks=128)
    return [out.token_ids for out in llm.generate(prompts, GREEDY)]


@dataclass
class Node:
    service: NodeService
    server: grpc.Server
    stub: pb_grpc.NodeStub
    channel: grpc.Channel

    def stats(self) -> pb.StatsReply:
        return self.stub.Stats(pb.StatsRequest(), timeout=10)


def make_node(model_path, role: str, num_blocks: int = 64, max_num_seqs: int = 64,  # noqa: ANN001
          **options: Any) -> Node:
    engine = LLMEngine(EngineConfig(
        model=str(model_path), cache=CacheConfig(num_blocks=num_blocks),
        scheduler=SchedulerConfig(max_num_batched_tokens=64,  # long prompts: chunked
                                  max_num_seqs=max_num_seqs)))
    service = NodeService(engine, role, **options)
    server, port = serve(service)
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    return Node(service, server, pb_grpc.NodeStub(channel), channel)


@pytest.fixture
def nodes(model_path) -> Iterator[tuple[Node, Node]]:  # noqa: ANN001
    prefill, decode = make_node(model_path, "prefill"), make_node(model_path, "decode")
    yield prefill, decode
    close_nodes(prefill, decode)


def request_pb(rid: str, prompt: list[int], params: SamplingParams = GREEDY) -> pb.Request:
    return pb.Request(request_id=rid, prompt_token_ids=prompt,
                      sampling=convert.sampling_to_pb(params))


def generate(decode: Node, request: pb.Request, first_token: int | None = None
              ) -> tuple[list[int], pb.GenerateChunk]:
    msg = pb.GenerateRequest(request=request)
    if first_token is not None:
        msg.first_token = first_token
    tokens, last = [], None
    for chunk in decode.stub.Generate(msg, timeout=60):
        tokens += chunk.token_ids
        last = chunk
    assert last is not None and last.finish_reason
    return tokens, last


def disaggregated(prefill: Node, decode: Node, rid: str, prompt: list[int]
                   ) -> tuple[list[int], pb.ReserveReply, pb.PrefillReply]:
    request = request_pb(rid, prompt)
    reserved = decode.stub.Reserve(pb.ReserveRequest(request=request, ttl_s=30), timeout=30)
    done = prefill.stub.Prefill(pb.PrefillRequest(request=request, sink=reserved.sink),
                                timeout=60)
    tokens, last = generate(decode, request, done.first_token)
    assert last.finish_reason == "length" and last.completion_tokens == NEW_TOKENS
    assert last.prompt_tokens == len(prompt)
    return tokens, reserved, done


def is_idle(node: Node) -> bool:
    s = node.stats()
    return (s.num_running, s.num_waiting, s.num_reserved) == (0, 0, 0) and (
        s.kv_blocks_free == s.kv_blocks_total)


def wait_for(cond, timeout: float = 10.0) -> bool:  # noqa: ANN001
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.05)
    return cond()


def close_nodes(*nodes: Node) -> None:
    for node in nodes:
        node.channel.close()
        node.server.stop(grace=1).wait()
        node.service.close()


def prefill_plan(prefill: Node | None, **fields: object) -> pb.PrefillPlan:
    address = prefill.service.events.node_id if prefill is not None else ""
    return pb.PrefillPlan(address=address, timeout_s=60, **fields)


def drive(decode: Node, request: pb.Request, plan: pb.PrefillPlan
          ) -> tuple[list[int], list[pb.GenerateChunk]]:
    """Decode-first: the one call a router makes."""
    chunks = list(decode.stub.Generate(pb.GenerateRequest(request=request, prefill=plan),
                                       timeout=60))
    assert chunks and chunks[-1].finish_reason == "length"
    return [t for c in chunks for t in c.token_ids], chunks
