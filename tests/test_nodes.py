"""A prefill node and a decode node, each a real gRPC server on loopback over its own
engine, moving KV through the tcp connector: the node service's calls end to end (the
decode-first calls: `test_nodes_decode_first.py`)."""

# ruff: noqa: F811 - the tests take the imported fixtures as arguments, by name
from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import grpc
import pytest
from node_helpers import (  # noqa: F401 - fixtures are found by name in the module
    GREEDY,
    LENGTHS,
    NEW_TOKENS,
    Node,
    close_nodes,
    disaggregated,
    drive,
    expected,
    generate,
    is_idle,
    make_node,
    model_path,
    nodes,
    prefill_plan,
    prompts,
    request_pb,
    wait_for,
)

from tandem import SamplingParams
from tandem.node.submit import CALL_ENDED, call_end
from tandem.node.timeouts import TIMEOUTS, Timeouts
from tandem.protos import node_pb2 as pb
from tandem.router.pool import NodeClient


def test_disaggregated_greedy_output_equals_the_offline_engine(nodes, prompts, expected):  # noqa: ANN001
    prefill, decode = nodes
    layout = decode.service.layout
    sent = 0
    for i, (prompt, want) in enumerate(zip(prompts, expected)):
        tokens, reserved, done = disaggregated(prefill, decode, f"r{i}", prompt)
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
    assert wait_for(lambda: is_idle(decode) and is_idle(prefill))


def test_a_shared_prefix_is_not_sent_twice(nodes, prompts, expected):  # noqa: ANN001
    """The second request's first blocks are in the decode node's prefix cache: its sink
    starts after them, and only the rest of the prompt moves."""
    prefill, decode = nodes
    prompt = prompts[-1]  # 100 tokens: 6 full blocks and a partial one
    disaggregated(prefill, decode, "first", prompt)
    tokens, reserved, done = disaggregated(prefill, decode, "second", prompt)
    assert tokens == expected[-1]
    assert reserved.cached_tokens == 96 and reserved.sink.first_block == 6
    assert len(reserved.sink.block_ids) == 1


def test_a_prefilled_request_streams_each_token_once_in_order(nodes, prompts, expected):  # noqa: ANN001
    """The first output (from `start_decode`, no step's) reaches the listener on the loop
    thread like every later one: from the caller's thread it could arrive after the next
    step's, and its chunk would send that step's token again."""
    prefill, decode = nodes
    prompt = prompts[-1]
    request = request_pb("listened", prompt)
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
    request = request_pb("local-reserved", prompts[3])
    decode.stub.Reserve(pb.ReserveRequest(request=request, ttl_s=30), timeout=30)
    assert generate(decode, request)[0] == expected[3]
    assert generate(decode, request_pb("local", prompts[2]))[0] == expected[2]
    assert decode.stats().prompt_tokens_computed == len(prompts[3]) + len(prompts[2])
    assert prefill.stats().prompt_tokens_computed == 0
    assert wait_for(lambda: is_idle(decode))


def test_an_unused_reservation_is_freed_after_its_ttl(nodes, prompts):  # noqa: ANN001
    _, decode = nodes
    request = request_pb("never-pushed", prompts[4])
    decode.stub.Reserve(pb.ReserveRequest(request=request, ttl_s=0.3), timeout=30)
    assert decode.stats().num_reserved == 1
    assert wait_for(lambda: is_idle(decode))
    assert decode.stats().transfers_failed == 1


def test_a_client_that_goes_away_frees_every_block(nodes, prompts):  # noqa: ANN001
    prefill, decode = nodes
    long = SamplingParams(temperature=0.0, max_tokens=500, ignore_eos=True)
    request = request_pb("gone", prompts[4], long)
    reserved = decode.stub.Reserve(pb.ReserveRequest(request=request, ttl_s=30), timeout=30)
    done = prefill.stub.Prefill(pb.PrefillRequest(request=request, sink=reserved.sink),
                                timeout=60)
    stream = decode.stub.Generate(pb.GenerateRequest(request=request,
                                                     first_token=done.first_token), timeout=60)
    next(stream)
    stream.cancel()
    assert wait_for(lambda: is_idle(decode) and is_idle(prefill))


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
        request=request_pb(f"out{i}", prompt), prefill=prefill_plan(prefill),
        subscriber="router-a"),
        timeout=60) for i, prompt in enumerate(prompts)]
    assert all(list(call) == [] for call in calls)  # each ends, with no chunk of its own
    assert wait_for(lambda: all(any(c.finish_reason for c in outputs.chunks(f"out{i}"))
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
    assert wait_for(lambda: is_idle(decode) and is_idle(prefill))


def test_the_outputs_stream_closing_ends_its_requests(nodes, prompts):  # noqa: ANN001
    """No Outputs stream of that name: FAILED_PRECONDITION. The stream closing while
    its requests run: their calls end UNAVAILABLE and every block is freed."""
    prefill, decode = nodes
    with pytest.raises(grpc.RpcError) as raised:
        list(decode.stub.Generate(pb.GenerateRequest(
            request=request_pb("nobody", prompts[0]), subscriber="nobody"), timeout=10))
    assert raised.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    outputs = _Outputs(decode, "router-b")
    long = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
    calls = [decode.stub.Generate(pb.GenerateRequest(
        request=request_pb(f"cut{i}", prompts[4], long), prefill=prefill_plan(prefill),
        subscriber="router-b"), timeout=60) for i in range(2)]
    assert wait_for(lambda: all(outputs.chunks(f"cut{i}") for i in range(2)))
    outputs.stream.cancel()
    for call in calls:
        with pytest.raises(grpc.RpcError) as raised:
            list(call)
        assert raised.value.code() == grpc.StatusCode.UNAVAILABLE
    outputs.thread.join(10)
    assert wait_for(lambda: is_idle(decode) and is_idle(prefill))


def test_reservation_lifetimes_are_capped(nodes, prompts):  # noqa: ANN001
    """ttl_s far above the cap is cut to MAX_TTL_S; NaN, inf or negative is refused."""
    _, decode = nodes
    reply = decode.stub.Reserve(pb.ReserveRequest(request=request_pb("long", prompts[1]),
                                                  ttl_s=1e12), timeout=10)
    assert reply.sink.expires_at <= time.time() + TIMEOUTS.max_ttl_s + 5
    for bad in (float("nan"), float("inf"), -1.0):
        with pytest.raises(grpc.RpcError) as raised:
            decode.stub.Reserve(pb.ReserveRequest(request=request_pb(f"bad{bad}", prompts[1]),
                                                  ttl_s=bad), timeout=10)
        assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    decode.stub.Abort(pb.AbortRequest(request_id="long"), timeout=10)
    assert wait_for(lambda: is_idle(decode))


def test_bad_calls_get_clear_status_codes(nodes, prompts):  # noqa: ANN001
    prefill, decode = nodes
    cases = [
        (lambda: decode.stub.Reserve(pb.ReserveRequest(request=request_pb("", prompts[0]))),
         grpc.StatusCode.INVALID_ARGUMENT, "request_id is empty"),
        (lambda: decode.stub.Reserve(pb.ReserveRequest(request=request_pb("x", [3, 999]))),
         grpc.StatusCode.INVALID_ARGUMENT, "outside the vocabulary"),
        (lambda: decode.stub.Prefill(pb.PrefillRequest(request=request_pb("y", prompts[0]))),
         grpc.StatusCode.FAILED_PRECONDITION, "in the decode role"),
        (lambda: prefill.stub.Prefill(pb.PrefillRequest(request=request_pb("z", prompts[0]),
                                                        sink=pb.Sink())),
         grpc.StatusCode.INVALID_ARGUMENT, "the sink has no blocks"),
        (lambda: list(decode.stub.Generate(pb.GenerateRequest(
            request=request_pb("w", prompts[0]), first_token=5))),
         grpc.StatusCode.INVALID_ARGUMENT, "no reservation here"),
        (lambda: decode.stub.Reserve(pb.ReserveRequest(request=request_pb("big", [3] * 2000))),
         grpc.StatusCode.INVALID_ARGUMENT, "context length"),
    ]
    for call, code, text in cases:
        with pytest.raises(grpc.RpcError) as raised:
            call()
        assert raised.value.code() == code and text in raised.value.details(), text
    assert is_idle(decode) and is_idle(prefill)


def test_concurrent_disaggregated_requests(nodes, prompts, expected):  # noqa: ANN001
    prefill, decode = nodes
    results: dict[int, list[int]] = {}
    errors: list[BaseException] = []

    def one(i: int) -> None:
        try:
            k = i % len(prompts)
            results[i] = disaggregated(prefill, decode, f"c{i}", prompts[k])[0]
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    assert all(results[i] == expected[i % len(prompts)] for i in range(8))
    assert wait_for(lambda: is_idle(decode) and is_idle(prefill))


def test_nodes_swap_roles_once_drained(nodes, prompts, expected):  # noqa: ANN001
    first, second = nodes  # prefill, decode
    for node, role in ((second, pb.PREFILL), (first, pb.DECODE)):
        reply = node.stub.SetRole(pb.SetRoleRequest(role=role, drain_timeout_s=5), timeout=10)
        assert reply.role == role and reply.drained
        assert node.stub.Health(pb.HealthRequest(), timeout=10).role == role
    with pytest.raises(grpc.RpcError) as raised:
        second.stub.Reserve(pb.ReserveRequest(request=request_pb("r", prompts[0])), timeout=10)
    assert raised.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    # The old decode node now prefills into the old prefill node, weights untouched.
    assert disaggregated(second, first, "swapped", prompts[1])[0] == expected[1]


LONG = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)


def _start(decode: Node, rid: str, prompt: list[int]) -> Iterator[pb.GenerateChunk]:
    """A long request computed on `decode` itself, its first chunk read."""
    stream = decode.stub.Generate(pb.GenerateRequest(request=request_pb(rid, prompt, LONG),
                                                     prefill=prefill_plan(None)), timeout=60)
    next(stream)
    return stream


def test_health_tells_when_the_engine_fails_and_the_router_stops_using_it(
        model_path, prompts, expected, monkeypatch):  # noqa: ANN001
    """A fault injected into the model's forward: the request ends INTERNAL, Health says
    the engine is not alive (and why), the router's poll marks the node down; once the
    stall limit has passed without another failure the node is alive, and serves."""
    import asyncio

    from tandem.router.pool import NodeClient

    decode = make_node(model_path, "decode", timeouts=Timeouts(engine_stall_s=1.5))
    try:
        def fault(*_: object, **__: object) -> None:
            raise RuntimeError("injected fault")

        monkeypatch.setattr(decode.service.loop.engine.runner, "run", fault)
        monkeypatch.setattr(decode.service.loop.engine.runner, "launch", fault)
        with pytest.raises(grpc.RpcError) as raised:
            drive(decode, request_pb("doomed", prompts[0]), prefill_plan(None))
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
        assert wait_for(lambda: decode.stub.Health(pb.HealthRequest(), timeout=10).engine_alive,
                     timeout=5)
        assert asyncio.run(poll()) is True
        assert drive(decode, request_pb("after", prompts[1]), prefill_plan(None))[0] == expected[1]
    finally:
        close_nodes(decode)


def test_requests_past_max_requests_are_refused_and_control_calls_still_answer(
        model_path, prompts):  # noqa: ANN001
    decode = make_node(model_path, "decode", max_num_seqs=1, max_requests=2)
    try:
        running = _start(decode, "running", prompts[0])
        waiting = decode.stub.Generate(pb.GenerateRequest(
            request=request_pb("waiting", prompts[1], LONG), prefill=prefill_plan(None)),
            timeout=60)
        assert wait_for(lambda: decode.stats().num_waiting == 1)
        with pytest.raises(grpc.RpcError) as raised:
            drive(decode, request_pb("refused", prompts[2]), prefill_plan(None))
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
        assert wait_for(lambda: is_idle(decode))
        _start(decode, "later", prompts[0]).cancel()  # the room came back
        assert wait_for(lambda: is_idle(decode))
    finally:
        close_nodes(decode)


def test_max_num_seqs_holds_for_prompts_computed_on_the_prefill_node(model_path, prompts,
                                                                    expected):  # noqa: ANN001
    """Decode-first requests join the running batch only while fewer than max_num_seqs
    run (they wait, holding their KV, otherwise), and still match the offline engine."""
    prefill = make_node(model_path, "prefill")
    decode = make_node(model_path, "decode", max_num_seqs=2)
    seen: list[int] = []
    results: dict[int, list[int]] = {}
    try:
        def one(i: int) -> None:
            results[i] = drive(decode, request_pb(f"m{i}", prompts[i]), prefill_plan(prefill))[0]

        threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        while any(t.is_alive() for t in threads):
            seen.append(decode.stats().num_running)
            time.sleep(0.005)
        assert max(seen) == 2
        assert [results[i] for i in range(len(prompts))] == expected
        assert wait_for(lambda: is_idle(decode) and is_idle(prefill))
    finally:
        close_nodes(prefill, decode)


def test_a_ready_reservation_nobody_generates_is_freed_when_its_lease_lapses(nodes, prompts):  # noqa: ANN001
    """A caller reserves and has the prompt pushed, then dies before its Generate: the
    sink is ready, and the lease still frees it."""
    prefill, decode = nodes
    request = request_pb("orphan", prompts[3])
    reserved = decode.stub.Reserve(pb.ReserveRequest(request=request, ttl_s=2), timeout=10)
    prefill.stub.Prefill(pb.PrefillRequest(request=request, sink=reserved.sink), timeout=30)
    assert decode.stats().num_reserved == 1  # ready, waiting for a Generate that never comes
    assert not wait_for(lambda: is_idle(decode), timeout=0.5)
    assert wait_for(lambda: is_idle(decode), timeout=10)



def test_a_router_started_generate_ends_as_its_call_does(model_path, prompts, expected
                                                         ):  # noqa: ANN001
    """The router starts a Generate whose chunks come by its Outputs stream on a
    synchronous channel (`NodeClient.start_generate`): its end is `CALL_ENDED` once the
    chunks went out, and a refusal is the AioRpcError an asyncio call raises, code and
    details as the node said them."""
    decode = make_node(model_path, "decode", max_num_seqs=1, max_requests=2)
    client = NodeClient(decode.service.events.node_id)
    outputs = decode.stub.Outputs(pb.OutputsRequest(subscriber="r1"), timeout=60)
    next(outputs)  # open

    def started(rid: str, prompt: list[int]) -> tuple[grpc.Future, threading.Event]:
        msg = pb.GenerateRequest(request=request_pb(rid, prompt), prefill=prefill_plan(None),
                                 subscriber="r1")
        call, ended = client.start_generate(msg, timeout=60), threading.Event()
        call.add_done_callback(lambda _: ended.set())  # on a gRPC thread
        return call, ended

    try:
        client.open_starter()
        call, ended = started("fine", prompts[0])
        tokens: list[int] = []
        while len(tokens) < NEW_TOKENS:
            for chunk in next(outputs).chunks:
                assert chunk.request_id == "fine"
                tokens += chunk.token_ids
        assert tokens == expected[0]
        assert ended.wait(30) and call_end(call) is CALL_ENDED

        running = _start(decode, "running", prompts[0])  # max_num_seqs=1: the next waits
        waiting = decode.stub.Generate(pb.GenerateRequest(
            request=request_pb("waiting", prompts[1], LONG), prefill=prefill_plan(None)),
            timeout=60)
        assert wait_for(lambda: decode.stats().num_waiting == 1)
        refused, ended = started("refused", prompts[2])
        assert ended.wait(30)
        end = call_end(refused)
        assert isinstance(end, grpc.aio.AioRpcError)
        assert end.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "holds 2 requests" in end.details()
        running.cancel()
        waiting.cancel()
    finally:
        outputs.cancel()
        client.close_starter()
        close_nodes(decode)
