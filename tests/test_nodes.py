"""A prefill node and a decode node, each a real gRPC server on loopback over its own
engine, moving KV through the tcp connector: the node service's calls end to end."""

from __future__ import annotations

import random
import socket
import threading
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
from tandem.node.timeouts import TIMEOUTS, Timeouts
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


def _node(model_path, role: str, num_blocks: int = 64, max_num_seqs: int = 64,  # noqa: ANN001
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
    prefill, decode = _node(model_path, "prefill"), _node(model_path, "decode")
    yield prefill, decode
    _close(prefill, decode)


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


def test_a_prefilled_request_streams_each_token_once_in_order(nodes, prompts, expected):  # noqa: ANN001
    """The first output (from `start_decode`, no step's) reaches the listener on the loop
    thread like every later one: from the caller's thread it could arrive after the next
    step's, and its chunk would send that step's token again."""
    prefill, decode = nodes
    prompt = prompts[-1]
    request = _request("listened", prompt)
    reserved = decode.stub.Reserve(pb.ReserveRequest(request=request, ttl_s=30), timeout=30)
    done = prefill.stub.Prefill(pb.PrefillRequest(request=request, sink=reserved.sink),
                                timeout=60)
    service = decode.service
    req = service.loop.call(lambda e: e.validate_request(
        "listened", prompt, GREEDY))
    seen: list[tuple[str, int]] = []
    finished = threading.Event()

    def listener(out) -> None:  # noqa: ANN001
        seen.append((threading.current_thread().name, len(out.token_ids)))
        if out.finished:
            finished.set()

    assert req.request_id == "listened"
    service.decode.arrival("listened").result(30)
    service.decode.start("listened", done.first_token, listener).result(30)
    assert finished.wait(60)
    assert seen == [("engine-loop", n) for n in range(1, NEW_TOKENS + 1)]


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


def _plan(prefill: Node | None, **fields: object) -> pb.PrefillPlan:
    address = prefill.service.events.node_id if prefill is not None else ""
    return pb.PrefillPlan(address=address, timeout_s=60, **fields)


def _drive(decode: Node, request: pb.Request, plan: pb.PrefillPlan
           ) -> tuple[list[int], list[pb.GenerateChunk]]:
    """Decode-first: the one call a router makes."""
    chunks = list(decode.stub.Generate(pb.GenerateRequest(request=request, prefill=plan),
                                       timeout=60))
    assert chunks and chunks[-1].finish_reason == "length"
    return [t for c in chunks for t in c.token_ids], chunks


def _dead_address() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"  # nothing listens there once closed


def test_decode_first_drives_the_prefill_node_itself(nodes, prompts, expected):  # noqa: ANN001
    """One Generate call with a prefill plan: the decode node reserves, the prefill node
    computes every prompt token and pushes its KV, and the first chunk carries the
    prefill node's first token alone, marked with where it was computed."""
    prefill, decode = nodes
    for i, (prompt, want) in enumerate(zip(prompts, expected)):
        tokens, chunks = _drive(decode, _request(f"df{i}", prompt), _plan(prefill))
        assert tokens == want, f"prompt {i} ({len(prompt)} tokens)"
        assert list(chunks[0].token_ids) == want[:1]
        assert chunks[0].prefilled_by == prefill.service.events.node_id
        assert not chunks[0].prefill_error and not chunks[1].prefilled_by
    p, d = prefill.stats(), decode.stats()
    assert p.prompt_tokens_computed == sum(LENGTHS) and d.prompt_tokens_computed == 0
    assert p.kv_bytes_sent == d.kv_bytes_received > 0
    assert _wait(lambda: _idle(decode) and _idle(prefill))


def _early(prefill: Node, request: pb.Request) -> None:
    """The router's early start: a Prefill call without a sink, answered at once."""
    assert prefill.stub.Prefill(pb.PrefillRequest(request=request), timeout=10) == (
        pb.PrefillReply())


def test_an_early_start_is_taken_up_by_the_decode_nodes_call(nodes, prompts, expected):  # noqa: ANN001
    """The prefill node computes each prompt before its sink exists; the decode node's
    call attaches the sink, and the prompt is pushed, not computed again."""
    prefill, decode = nodes
    for i, (prompt, want) in enumerate(zip(prompts, expected)):
        before = prefill.stats().prompt_tokens_computed
        request = _request(f"early{i}", prompt)
        _early(prefill, request)
        want_computed = before + len(prompt)
        assert _wait(lambda n=want_computed: prefill.stats().prompt_tokens_computed == n)
        assert not _idle(prefill)  # its blocks are held for the push
        tokens, chunks = _drive(decode, request, _plan(prefill))
        assert tokens == want, f"prompt {i} ({len(prompt)} tokens)"
        assert chunks[0].prefilled_by == prefill.service.events.node_id
    p, d = prefill.stats(), decode.stats()
    assert p.prompt_tokens_computed == sum(LENGTHS) and d.prompt_tokens_computed == 0
    assert p.kv_bytes_sent == d.kv_bytes_received > 0
    assert _wait(lambda: _idle(decode) and _idle(prefill))


def test_an_early_start_is_dropped_unattached_or_aborted_and_checked_when_attached(
        model_path, prompts):  # noqa: ANN001
    """No sink within the hold, or an Abort: its blocks come back. A sink for another
    prompt under its id is refused. A second early start of an id does not compute it
    again."""
    prefill = _node(model_path, "prefill", timeouts=Timeouts(early_hold_s=2.0))
    decode = _node(model_path, "decode")
    try:
        _early(prefill, _request("lapses", prompts[4]))
        assert _wait(lambda: not _idle(prefill))
        assert _wait(lambda: _idle(prefill), timeout=5)
        _early(prefill, _request("lapses", prompts[4]))  # started here before: skipped
        assert prefill.stats().prompt_tokens_computed == LENGTHS[4]
        _early(prefill, _request("aborted", prompts[3]))
        assert _wait(lambda: prefill.stats().prompt_tokens_computed == LENGTHS[4] + LENGTHS[3])
        assert prefill.stub.Abort(pb.AbortRequest(request_id="aborted"), timeout=10).found
        assert _wait(lambda: _idle(prefill), timeout=1.0)  # well inside the hold
        _early(prefill, _request("other", prompts[2]))
        sink = decode.stub.Reserve(pb.ReserveRequest(request=_request("other", prompts[1]),
                                                     ttl_s=30), timeout=10).sink
        with pytest.raises(grpc.RpcError) as raised:
            prefill.stub.Prefill(pb.PrefillRequest(request=_request("other", prompts[1]),
                                                   sink=sink), timeout=10)
        assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "in use for another prompt" in raised.value.details()
        decode.stub.Abort(pb.AbortRequest(request_id="other"), timeout=10)
        assert _wait(lambda: _idle(prefill) and _idle(decode), timeout=5)
    finally:
        _close(prefill, decode)


def test_a_sink_that_comes_after_the_early_start_lapsed_is_served(model_path, prompts,
                                                                 expected):  # noqa: ANN001
    """The hold lapses at once: the decode node's call finds the early start dropped (or
    still leaving the engine) and the prompt is computed again, not refused as in use."""
    prefill = _node(model_path, "prefill", timeouts=Timeouts(early_hold_s=0.001))
    decode = _node(model_path, "decode")
    try:
        for n, i in enumerate((4, 3, 4, 2)):
            request = _request(f"lapsed{n}", prompts[i])
            _early(prefill, request)
            tokens, chunks = _drive(decode, request, _plan(prefill))
            assert tokens == expected[i] and chunks[0].prefilled_by
        assert _wait(lambda: _idle(prefill) and _idle(decode), timeout=5)
    finally:
        _close(prefill, decode)


def test_decode_first_computes_here_below_the_threshold_or_without_a_prefill_node(
        nodes, prompts, expected):  # noqa: ANN001
    prefill, decode = nodes
    for rid, plan in (("few-uncached", _plan(prefill, local_prefill_threshold=1000)),
                      ("no-prefill-node", _plan(None))):
        tokens, chunks = _drive(decode, _request(rid, prompts[4]), plan)
        assert tokens == expected[4]
        assert not chunks[0].prefilled_by and not chunks[0].prefill_error
    assert prefill.stats().prompt_tokens_computed == 0
    assert _wait(lambda: _idle(decode))


def test_decode_first_when_the_prefill_node_is_unreachable(nodes, prompts, expected):  # noqa: ANN001
    """The plan's prefill node does not answer: by default the decode node computes the
    prompt and its first chunk says why; told to fail instead, the call ends ABORTED.
    Either way nothing stays reserved."""
    _, decode = nodes
    dead = pb.PrefillPlan(address=_dead_address(), timeout_s=10)
    tokens, chunks = _drive(decode, _request("fallback", prompts[3]), dead)
    assert tokens == expected[3]
    assert chunks[0].prefill_error_code == "UNAVAILABLE" and not chunks[0].prefilled_by
    dead.fail_on_error = True
    with pytest.raises(grpc.RpcError) as raised:
        _drive(decode, _request("fail", prompts[3]), dead)
    assert raised.value.code() == grpc.StatusCode.ABORTED
    assert "prefill failed" in raised.value.details()
    assert _wait(lambda: _idle(decode))


@pytest.mark.parametrize("how", ["cancel", "abort"])
def test_decode_first_ended_at_any_point_frees_both_nodes(nodes, prompts, how):  # noqa: ANN001
    """The router's call cancelled, or an Abort sent, at moments from before the prefill
    to mid-decode: the call ends, and neither node keeps a request or a block."""
    prefill, decode = nodes
    long = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
    for i, delay in enumerate((0.0, 0.002, 0.01, 0.03, 0.1)):
        rid = f"{how}{i}"
        stream = decode.stub.Generate(
            pb.GenerateRequest(request=_request(rid, prompts[4], long), prefill=_plan(prefill)),
            timeout=60)
        if how == "abort":  # an Abort before the node has the request would find nothing
            assert _wait(lambda: not _idle(decode))
        time.sleep(delay)
        if how == "cancel":
            stream.cancel()
        else:
            decode.stub.Abort(pb.AbortRequest(request_id=rid, reason="test"), timeout=10)
        with pytest.raises(grpc.RpcError):  # cancelled, or ended by the abort
            for chunk in stream:
                assert chunk.finish_reason in ("", "abort")
                if chunk.finish_reason:
                    raise grpc.RpcError  # the engine reported the abort: a clean end
        assert _wait(lambda: _idle(decode) and _idle(prefill)), (how, delay)


class _Outputs:
    """An Outputs stream read on a thread: every batch, and each request's chunks."""

    def __init__(self, node: Node, subscriber: str) -> None:
        self.stream = node.stub.Outputs(pb.OutputsRequest(subscriber=subscriber), timeout=60)
        self.batches: list[pb.OutputBatch] = []
        self.opened = threading.Event()
        self.thread = threading.Thread(target=self._read)
        self.thread.start()
        assert self.opened.wait(10)

    def _read(self) -> None:
        try:
            for batch in self.stream:
                self.batches.append(batch)
                self.opened.set()
        except grpc.RpcError:
            pass  # cancelled by the test

    def chunks(self, rid: str) -> list[pb.GenerateChunk]:
        return [c for b in self.batches for c in b.chunks if c.request_id == rid]


def test_the_outputs_stream_carries_every_request_batched(nodes, prompts, expected):  # noqa: ANN001
    """Generate calls naming a subscriber carry nothing themselves: their chunks come,
    in order and several to a message, through that subscriber's Outputs stream."""
    prefill, decode = nodes
    outputs = _Outputs(decode, "router-a")
    calls = [decode.stub.Generate(pb.GenerateRequest(
        request=_request(f"out{i}", prompt), prefill=_plan(prefill), subscriber="router-a"),
        timeout=60) for i, prompt in enumerate(prompts)]
    assert all(list(call) == [] for call in calls)  # each ends, with no chunk of its own
    assert _wait(lambda: all(any(c.finish_reason for c in outputs.chunks(f"out{i}"))
                             for i in range(len(prompts))))
    for i, (prompt, want) in enumerate(zip(prompts, expected)):
        chunks = outputs.chunks(f"out{i}")
        assert [t for c in chunks for t in c.token_ids] == want
        assert chunks[0].prefilled_by == prefill.service.events.node_id
        assert [c.finish_reason for c in chunks] == [""] * (len(chunks) - 1) + ["length"]
        assert (chunks[-1].prompt_tokens, chunks[-1].completion_tokens) == (len(prompt),
                                                                          NEW_TOKENS)
    assert max(len(b.chunks) for b in outputs.batches) > 1  # steps of several requests
    outputs.stream.cancel()
    outputs.thread.join(10)
    assert _wait(lambda: _idle(decode) and _idle(prefill))


def test_the_outputs_stream_closing_ends_its_requests(nodes, prompts):  # noqa: ANN001
    """No Outputs stream of that name: FAILED_PRECONDITION. The stream closing while
    its requests run: their calls end UNAVAILABLE and every block is freed."""
    prefill, decode = nodes
    with pytest.raises(grpc.RpcError) as raised:
        list(decode.stub.Generate(pb.GenerateRequest(
            request=_request("nobody", prompts[0]), subscriber="nobody"), timeout=10))
    assert raised.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    outputs = _Outputs(decode, "router-b")
    long = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
    calls = [decode.stub.Generate(pb.GenerateRequest(
        request=_request(f"cut{i}", prompts[4], long), prefill=_plan(prefill),
        subscriber="router-b"), timeout=60) for i in range(2)]
    assert _wait(lambda: all(outputs.chunks(f"cut{i}") for i in range(2)))
    outputs.stream.cancel()
    for call in calls:
        with pytest.raises(grpc.RpcError) as raised:
            list(call)
        assert raised.value.code() == grpc.StatusCode.UNAVAILABLE
    outputs.thread.join(10)
    assert _wait(lambda: _idle(decode) and _idle(prefill))


def test_reservation_lifetimes_are_capped(nodes, prompts):  # noqa: ANN001
    """ttl_s far above the cap is cut to MAX_TTL_S; NaN, inf or negative is refused."""
    _, decode = nodes
    reply = decode.stub.Reserve(pb.ReserveRequest(request=_request("long", prompts[1]),
                                                  ttl_s=1e12), timeout=10)
    assert reply.sink.expires_at <= time.time() + TIMEOUTS.max_ttl_s + 5
    for bad in (float("nan"), float("inf"), -1.0):
        with pytest.raises(grpc.RpcError) as raised:
            decode.stub.Reserve(pb.ReserveRequest(request=_request(f"bad{bad}", prompts[1]),
                                                  ttl_s=bad), timeout=10)
        assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    decode.stub.Abort(pb.AbortRequest(request_id="long"), timeout=10)
    assert _wait(lambda: _idle(decode))


def test_bad_calls_get_clear_status_codes(nodes, prompts):  # noqa: ANN001
    prefill, decode = nodes
    cases = [
        (lambda: decode.stub.Reserve(pb.ReserveRequest(request=_request("", prompts[0]))),
         grpc.StatusCode.INVALID_ARGUMENT, "request_id is empty"),
        (lambda: decode.stub.Reserve(pb.ReserveRequest(request=_request("x", [3, 999]))),
         grpc.StatusCode.INVALID_ARGUMENT, "outside the vocabulary"),
        (lambda: decode.stub.Prefill(pb.PrefillRequest(request=_request("y", prompts[0]))),
         grpc.StatusCode.FAILED_PRECONDITION, "in the decode role"),
        (lambda: prefill.stub.Prefill(pb.PrefillRequest(request=_request("z", prompts[0]),
                                                        sink=pb.Sink())),
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


def _close(*nodes: Node) -> None:
    for node in nodes:
        node.channel.close()
        node.server.stop(grace=1).wait()
        node.service.close()


LONG = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)


def _start(decode: Node, rid: str, prompt: list[int]) -> Iterator[pb.GenerateChunk]:
    """A long request computed on `decode` itself, its first chunk read."""
    stream = decode.stub.Generate(pb.GenerateRequest(request=_request(rid, prompt, LONG),
                                                     prefill=_plan(None)), timeout=60)
    next(stream)
    return stream


def test_health_tells_when_the_engine_fails_and_the_router_stops_using_it(
        model_path, prompts, expected, monkeypatch):  # noqa: ANN001
    """A fault injected into the model's forward: the request ends INTERNAL, Health says
    the engine is not alive (and why), the router's poll marks the node down; once the
    stall limit has passed without another failure the node is alive, and serves."""
    import asyncio

    from tandem.router.pool import NodeClient

    decode = _node(model_path, "decode", timeouts=Timeouts(engine_stall_s=1.5))
    try:
        def fault(*_: object, **__: object) -> None:
            raise RuntimeError("injected fault")

        monkeypatch.setattr(decode.service.loop.engine.runner, "run", fault)
        monkeypatch.setattr(decode.service.loop.engine.runner, "launch", fault)
        with pytest.raises(grpc.RpcError) as raised:
            _drive(decode, _request("doomed", prompts[0]), _plan(None))
        assert raised.value.code() == grpc.StatusCode.INTERNAL
        health = decode.stub.Health(pb.HealthRequest(), timeout=10)
        assert not health.engine_alive and health.failed_steps == 1
        assert "injected fault" in health.engine_error

        async def poll() -> bool:
            client = NodeClient(decode.service.events.node_id, pb.DECODE)
            client.open()
            try:
                await client.poll()
                return client.healthy
            finally:
                await client.channel.close()

        assert asyncio.run(poll()) is False
        monkeypatch.undo()
        assert _wait(lambda: decode.stub.Health(pb.HealthRequest(), timeout=10).engine_alive,
                     timeout=5)
        assert asyncio.run(poll()) is True
        assert _drive(decode, _request("after", prompts[1]), _plan(None))[0] == expected[1]
    finally:
        _close(decode)


def test_requests_past_max_requests_are_refused_and_control_calls_still_answer(
        model_path, prompts):  # noqa: ANN001
    decode = _node(model_path, "decode", max_num_seqs=1, max_requests=2)
    try:
        running = _start(decode, "running", prompts[0])
        waiting = decode.stub.Generate(pb.GenerateRequest(
            request=_request("waiting", prompts[1], LONG), prefill=_plan(None)), timeout=60)
        assert _wait(lambda: decode.stats().num_waiting == 1)
        with pytest.raises(grpc.RpcError) as raised:
            _drive(decode, _request("refused", prompts[2]), _plan(None))
        assert raised.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "holds 2 requests" in raised.value.details()
        started = time.monotonic()
        for _ in range(20):  # while both calls run
            decode.stub.Health(pb.HealthRequest(), timeout=1)
            decode.stub.Stats(pb.StatsRequest(), timeout=1)
        assert time.monotonic() - started < 5
        assert decode.stats().num_running == 1
        running.cancel()
        waiting.cancel()
        assert _wait(lambda: _idle(decode))
        _start(decode, "later", prompts[0]).cancel()  # the room came back
        assert _wait(lambda: _idle(decode))
    finally:
        _close(decode)


def test_max_num_seqs_holds_for_prompts_computed_on_the_prefill_node(model_path, prompts,
                                                                    expected):  # noqa: ANN001
    """Decode-first requests join the running batch only while fewer than max_num_seqs
    run (they wait, holding their KV, otherwise), and still match the offline engine."""
    prefill = _node(model_path, "prefill")
    decode = _node(model_path, "decode", max_num_seqs=2)
    seen: list[int] = []
    results: dict[int, list[int]] = {}
    try:
        def one(i: int) -> None:
            results[i] = _drive(decode, _request(f"m{i}", prompts[i]), _plan(prefill))[0]

        threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        while any(t.is_alive() for t in threads):
            seen.append(decode.stats().num_running)
            time.sleep(0.005)
        assert max(seen) == 2
        assert [results[i] for i in range(len(prompts))] == expected
        assert _wait(lambda: _idle(decode) and _idle(prefill))
    finally:
        _close(prefill, decode)


def test_a_ready_reservation_nobody_generates_is_freed_when_its_lease_lapses(nodes, prompts):  # noqa: ANN001
    """A caller reserves and has the prompt pushed, then dies before its Generate: the
    sink is ready, and the lease still frees it."""
    prefill, decode = nodes
    request = _request("orphan", prompts[3])
    reserved = decode.stub.Reserve(pb.ReserveRequest(request=request, ttl_s=2), timeout=10)
    prefill.stub.Prefill(pb.PrefillRequest(request=request, sink=reserved.sink), timeout=30)
    assert decode.stats().num_reserved == 1  # ready, waiting for a Generate that never comes
    assert not _wait(lambda: _idle(decode), timeout=0.5)
    assert _wait(lambda: _idle(decode), timeout=10)
