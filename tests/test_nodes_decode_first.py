"""Decode-first: one Generate call with a prefill plan, the decode node driving the
prefill node itself; and early starts, the prefill node computing a prompt before the
decode node's call brings the sink."""

# ruff: noqa: F811 - the tests take the imported fixtures as arguments, by name
from __future__ import annotations

import socket
import threading
import time

import grpc
import pytest
from node_helpers import (  # noqa: F401 - fixtures are found by name in the module
    LENGTHS,
    Node,
    close_nodes,
    drive,
    expected,
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
from tandem.node.timeouts import Timeouts
from tandem.protos import node_pb2 as pb


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
        tokens, chunks = drive(decode, request_pb(f"df{i}", prompt), prefill_plan(prefill))
        assert tokens == want, f"prompt {i} ({len(prompt)} tokens)"
        assert list(chunks[0].token_ids) == want[:1]
        assert chunks[0].prefilled_by == prefill.service.events.node_id
        assert not chunks[0].prefill_error and not chunks[1].prefilled_by
    p, d = prefill.stats(), decode.stats()
    assert p.prompt_tokens_computed == sum(LENGTHS) and d.prompt_tokens_computed == 0
    assert p.kv_bytes_sent == d.kv_bytes_received > 0
    assert wait_for(lambda: is_idle(decode) and is_idle(prefill))


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
        request = request_pb(f"early{i}", prompt)
        _early(prefill, request)
        want_computed = before + len(prompt)
        assert wait_for(lambda n=want_computed: prefill.stats().prompt_tokens_computed == n)
        assert not is_idle(prefill)  # its blocks are held for the push
        tokens, chunks = drive(decode, request, prefill_plan(prefill))
        assert tokens == want, f"prompt {i} ({len(prompt)} tokens)"
        assert chunks[0].prefilled_by == prefill.service.events.node_id
    p, d = prefill.stats(), decode.stats()
    assert p.prompt_tokens_computed == sum(LENGTHS) and d.prompt_tokens_computed == 0
    assert p.kv_bytes_sent == d.kv_bytes_received > 0
    assert wait_for(lambda: is_idle(decode) and is_idle(prefill))


def test_an_early_start_is_dropped_unattached_or_aborted_and_checked_when_attached(
        model_path, prompts):  # noqa: ANN001
    """No sink within the hold, or an Abort: its blocks come back. A sink for another
    prompt under its id is refused. A second early start of an id does not compute it
    again."""
    prefill = make_node(model_path, "prefill", timeouts=Timeouts(early_hold_s=2.0))
    decode = make_node(model_path, "decode")
    try:
        _early(prefill, request_pb("lapses", prompts[4]))
        assert wait_for(lambda: not is_idle(prefill))
        assert wait_for(lambda: is_idle(prefill), timeout=5)
        _early(prefill, request_pb("lapses", prompts[4]))  # started here before: skipped
        assert prefill.stats().prompt_tokens_computed == LENGTHS[4]
        _early(prefill, request_pb("aborted", prompts[3]))
        assert wait_for(lambda: prefill.stats().prompt_tokens_computed == LENGTHS[4] + LENGTHS[3])
        assert prefill.stub.Abort(pb.AbortRequest(request_id="aborted"), timeout=10).found
        assert wait_for(lambda: is_idle(prefill), timeout=1.0)  # well inside the hold
        _early(prefill, request_pb("other", prompts[2]))
        sink = decode.stub.Reserve(pb.ReserveRequest(request=request_pb("other", prompts[1]),
                                                     ttl_s=30), timeout=10).sink
        with pytest.raises(grpc.RpcError) as raised:
            prefill.stub.Prefill(pb.PrefillRequest(request=request_pb("other", prompts[1]),
                                                   sink=sink), timeout=10)
        assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "in use for another prompt" in raised.value.details()
        decode.stub.Abort(pb.AbortRequest(request_id="other"), timeout=10)
        assert wait_for(lambda: is_idle(prefill) and is_idle(decode), timeout=5)
    finally:
        close_nodes(prefill, decode)


def test_a_sink_that_comes_after_the_early_start_lapsed_is_served(model_path, prompts,
                                                                 expected):  # noqa: ANN001
    """The hold lapses at once: the decode node's call finds the early start dropped (or
    still leaving the engine) and the prompt is computed again, not refused as in use."""
    prefill = make_node(model_path, "prefill", timeouts=Timeouts(early_hold_s=0.001))
    decode = make_node(model_path, "decode")
    try:
        for n, i in enumerate((4, 3, 4, 2)):
            request = request_pb(f"lapsed{n}", prompts[i])
            _early(prefill, request)
            tokens, chunks = drive(decode, request, prefill_plan(prefill))
            assert tokens == expected[i] and chunks[0].prefilled_by
        assert wait_for(lambda: is_idle(prefill) and is_idle(decode), timeout=5)
    finally:
        close_nodes(prefill, decode)


def test_decode_first_computes_here_below_the_threshold_or_without_a_prefill_node(
        nodes, prompts, expected):  # noqa: ANN001
    prefill, decode = nodes
    for rid, plan in (("few-uncached", prefill_plan(prefill, local_prefill_threshold=1000)),
                      ("no-prefill-node", prefill_plan(None))):
        tokens, chunks = drive(decode, request_pb(rid, prompts[4]), plan)
        assert tokens == expected[4]
        assert not chunks[0].prefilled_by and not chunks[0].prefill_error
    assert prefill.stats().prompt_tokens_computed == 0
    assert wait_for(lambda: is_idle(decode))


def test_decode_first_when_the_prefill_node_is_unreachable(nodes, prompts, expected):  # noqa: ANN001
    """The plan's prefill node does not answer: by default the decode node computes the
    prompt and its first chunk says why; told to fail instead, the call ends ABORTED.
    Either way nothing stays reserved."""
    _, decode = nodes
    dead = pb.PrefillPlan(address=_dead_address(), timeout_s=10)
    tokens, chunks = drive(decode, request_pb("fallback", prompts[3]), dead)
    assert tokens == expected[3]
    assert chunks[0].prefill_error_code == "UNAVAILABLE" and not chunks[0].prefilled_by
    dead.fail_on_error = True
    with pytest.raises(grpc.RpcError) as raised:
        drive(decode, request_pb("fail", prompts[3]), dead)
    assert raised.value.code() == grpc.StatusCode.ABORTED
    assert "prefill failed" in raised.value.details()
    assert wait_for(lambda: is_idle(decode))


def test_a_call_ended_while_its_sink_is_dropped_frees_its_blocks(
        nodes, prompts, monkeypatch):  # noqa: ANN001
    """The prefill node does not answer: the decode node fails the prompt's sink to
    compute it itself, and the call ends (its client left) while that drop still waits
    on the sink: the reserved blocks come back all the same."""
    _, decode = nodes
    agent = decode.service.decode.agent
    dropping = threading.Event()
    abort = agent.abort

    def slow_abort(request_id: str, reason: str = "abort requested") -> bool:
        dropping.set()
        time.sleep(1.0)  # a write into the sink's blocks still in flight
        return abort(request_id, reason)

    monkeypatch.setattr(agent, "abort", slow_abort)
    dead = pb.PrefillPlan(address=_dead_address(), timeout_s=10)
    stream = decode.stub.Generate(pb.GenerateRequest(request=request_pb("left", prompts[4]),
                                                     prefill=dead), timeout=60)
    threading.Thread(target=lambda: dropping.wait(30) and stream.cancel(), daemon=True).start()
    with pytest.raises(grpc.RpcError) as raised:
        list(stream)
    assert raised.value.code() == grpc.StatusCode.CANCELLED
    assert dropping.is_set()
    assert wait_for(lambda: is_idle(decode), timeout=5), decode.stats()


@pytest.mark.parametrize("how", ["cancel", "abort"])
def test_decode_first_ended_at_any_point_frees_both_nodes(nodes, prompts, how):  # noqa: ANN001
    """The router's call cancelled, or an Abort sent, at moments from before the prefill
    to mid-decode: the call ends, and neither node keeps a request or a block."""
    prefill, decode = nodes
    long = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
    for i, delay in enumerate((0.0, 0.002, 0.01, 0.03, 0.1)):
        rid = f"{how}{i}"
        stream = decode.stub.Generate(
            pb.GenerateRequest(request=request_pb(rid, prompts[4], long),
                               prefill=prefill_plan(prefill)),
            timeout=60)
        if how == "abort":  # an Abort before the node has the request would find nothing
            assert wait_for(lambda: not is_idle(decode))
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
        assert wait_for(lambda: is_idle(decode) and is_idle(prefill)), (how, delay)

