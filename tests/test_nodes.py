"""A prefill node and a decode node, each a real gRPC server on loopback over its own
engine, moving KV through the tcp connector: the node service's calls end to end."""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import grpc
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from tandem import LLM, SamplingParams
from tandem.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from tandem.engine.llm_engine import LLMEngine
from tandem.node import convert
from tandem.node.server import NodeService, serve
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


def _node(model_path, role: str, num_blocks: int = 64) -> Node:  # noqa: ANN001
    engine = LLMEngine(EngineConfig(
        model=str(model_path), cache=CacheConfig(num_blocks=num_blocks),
        scheduler=SchedulerConfig(max_num_batched_tokens=64)))  # long prompts: chunked
    service = NodeService(engine, role)
    server, port = serve(service)
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    return Node(service, server, pb_grpc.NodeStub(channel), channel)


@pytest.fixture
def nodes(model_path) -> Iterator[tuple[Node, Node]]:  # noqa: ANN001
    prefill, decode = _node(model_path, "prefill"), _node(model_path, "decode")
    yield prefill, decode
    for node in (prefill, decode):
        node.channel.close()
        node.server.stop(grace=1).wait()
        node.service.close()


def _request(rid: str, prompt: list[int], params: SamplingParams = GREEDY) -> pb.Request:
    return pb.Request(request_id=rid, prompt_token_ids=prompt,
                      sampling=convert.sampling_to_pb(params))


def _generate(decode: Node, request: pb.Request, first_token: int | None = None
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


def _disaggregated(prefill: Node, decode: Node, rid: str, prompt: list[int]
                   ) -> tuple[list[int], pb.ReserveReply, pb.PrefillReply]:
    request = _request(rid, prompt)
    reserved = decode.stub.Reserve(pb.ReserveRequest(request=request, ttl_s=30), timeout=30)
    done = prefill.stub.Prefill(pb.PrefillRequest(request=request, sink=reserved.sink),
                                timeout=60)
    tokens, last = _generate(decode, request, done.first_token)
    assert last.finish_reason == "length" and last.completion_tokens == NEW_TOKENS
    assert last.prompt_tokens == len(prompt)
    return tokens, reserved, done


def _idle(node: Node) -> bool:
    s = node.stats()
    return (s.num_running, s.num_waiting, s.num_reserved) == (0, 0, 0) and (
        s.kv_blocks_free == s.kv_blocks_total)


def _wait(cond, timeout: float = 10.0) -> bool:  # noqa: ANN001
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.05)
    return cond()


def test_disaggregated_greedy_output_equals_the_offline_engine(nodes, prompts, expected):  # noqa: ANN001
    prefill, decode = nodes
    layout = decode.service.layout
    sent = 0
    for i, (prompt, want) in enumerate(zip(prompts, expected)):
        tokens, reserved, done = _disaggregated(prefill, decode, f"r{i}", prompt)
        assert tokens == want, f"prompt {i} ({len(prompt)} tokens)"
        assert reserved.cached_tokens == 0 and reserved.sink.first_block == 0
        blocks = -(-len(prompt) // layout.block_size)
        assert list(reserved.sink.block_ids) and len(reserved.sink.block_ids) == blocks
        assert done.kv_bytes == blocks * layout.block_bytes * layout.num_layers
        sent += done.kv_bytes
    p, d = prefill.stats(), decode.stats()
    # Every prompt token was computed on the prefill node, none on the decode node, and
    # the KV bytes moved are what the layout says those prompts' blocks hold.
    assert p.prompt_tokens_computed == sum(LENGTHS)
    assert d.prompt_tokens_computed == 0
    assert p.kv_bytes_sent == d.kv_bytes_received == sent
    assert p.transfers_failed == d.transfers_failed == 0
    assert _wait(lambda: _idle(decode) and _idle(prefill))


def test_a_shared_prefix_is_not_sent_twice(nodes, prompts, expected):  # noqa: ANN001
    """The second request's first blocks are in the decode node's prefix cache: its sink
    starts after them, and only the rest of the prompt moves."""
    prefill, decode = nodes
    prompt = prompts[-1]  # 100 tokens: 6 full blocks and a partial one
    _disaggregated(prefill, decode, "first", prompt)
    tokens, reserved, done = _disaggregated(prefill, decode, "second", prompt)
    assert tokens == expected[-1]
    assert reserved.cached_tokens == 96 and reserved.sink.first_block == 6
    assert len(reserved.sink.block_ids) == 1


def test_the_decode_node_can_prefill_itself(nodes, prompts, expected):  # noqa: ANN001
    prefill, decode = nodes
    # With a reservation (the prefill pool skipped or failed), and without one.
    request = _request("local-reserved", prompts[3])
    decode.stub.Reserve(pb.ReserveRequest(request=request, ttl_s=30), timeout=30)
    assert _generate(decode, request)[0] == expected[3]
    assert _generate(decode, _request("local", prompts[2]))[0] == expected[2]
    assert decode.stats().prompt_tokens_computed == len(prompts[3]) + len(prompts[2])
    assert prefill.stats().prompt_tokens_computed == 0
    assert _wait(lambda: _idle(decode))


def test_an_unused_reservation_is_freed_after_its_ttl(nodes, prompts):  # noqa: ANN001
    _, decode = nodes
    request = _request("never-pushed", prompts[4])
    decode.stub.Reserve(pb.ReserveRequest(request=request, ttl_s=0.3), timeout=30)
    assert decode.stats().num_reserved == 1
    assert _wait(lambda: _idle(decode))
    assert decode.stats().transfers_failed == 1


def test_a_client_that_goes_away_frees_every_block(nodes, prompts):  # noqa: ANN001
    prefill, decode = nodes
    long = SamplingParams(temperature=0.0, max_tokens=500, ignore_eos=True)
    request = _request("gone", prompts[4], long)
    reserved = decode.stub.Reserve(pb.ReserveRequest(request=request, ttl_s=30), timeout=30)
    done = prefill.stub.Prefill(pb.PrefillRequest(request=request, sink=reserved.sink),
                                timeout=60)
    stream = decode.stub.Generate(pb.GenerateRequest(request=request,
                                                     first_token=done.first_token), timeout=60)
    next(stream)
    stream.cancel()
    assert _wait(lambda: _idle(decode) and _idle(prefill))


def test_bad_calls_get_clear_status_codes(nodes, prompts):  # noqa: ANN001
    prefill, decode = nodes
    cases = [
        (lambda: decode.stub.Reserve(pb.ReserveRequest(request=_request("", prompts[0]))),
         grpc.StatusCode.INVALID_ARGUMENT, "request_id is empty"),
        (lambda: decode.stub.Reserve(pb.ReserveRequest(request=_request("x", [3, 999]))),
         grpc.StatusCode.INVALID_ARGUMENT, "outside the vocabulary"),
        (lambda: decode.stub.Prefill(pb.PrefillRequest(request=_request("y", prompts[0]))),
         grpc.StatusCode.FAILED_PRECONDITION, "in the decode role"),
        (lambda: prefill.stub.Prefill(pb.PrefillRequest(request=_request("z", prompts[0]))),
         grpc.StatusCode.INVALID_ARGUMENT, "the sink has no blocks"),
        (lambda: list(decode.stub.Generate(pb.GenerateRequest(
            request=_request("w", prompts[0]), first_token=5))),
         grpc.StatusCode.INVALID_ARGUMENT, "no reservation here"),
        (lambda: decode.stub.Reserve(pb.ReserveRequest(request=_request("big", [3] * 2000))),
         grpc.StatusCode.INVALID_ARGUMENT, "context length"),
    ]
    for call, code, text in cases:
        with pytest.raises(grpc.RpcError) as raised:
            call()
        assert raised.value.code() == code and text in raised.value.details(), text
    assert _idle(decode) and _idle(prefill)


def test_concurrent_disaggregated_requests(nodes, prompts, expected):  # noqa: ANN001
    prefill, decode = nodes
    results: dict[int, list[int]] = {}
    errors: list[BaseException] = []

    def one(i: int) -> None:
        try:
            k = i % len(prompts)
            results[i] = _disaggregated(prefill, decode, f"c{i}", prompts[k])[0]
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    assert all(results[i] == expected[i % len(prompts)] for i in range(8))
    assert _wait(lambda: _idle(decode) and _idle(prefill))


def test_nodes_swap_roles_once_drained(nodes, prompts, expected):  # noqa: ANN001
    first, second = nodes  # prefill, decode
    for node, role in ((second, pb.PREFILL), (first, pb.DECODE)):
        reply = node.stub.SetRole(pb.SetRoleRequest(role=role, drain_timeout_s=5), timeout=10)
        assert reply.role == role and reply.drained
        assert node.stub.Health(pb.HealthRequest(), timeout=10).role == role
    with pytest.raises(grpc.RpcError) as raised:
        second.stub.Reserve(pb.ReserveRequest(request=_request("r", prompts[0])), timeout=10)
    assert raised.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    # The old decode node now prefills into the old prefill node, weights untouched.
    assert _disaggregated(second, first, "swapped", prompts[1])[0] == expected[1]
