"""Async scheduling (a step launched before the previous step's tokens are read) gives
the same outputs as the synchronous loop, on the real SmolLM2 weights on the CPU: stops
by EOS, stop string, stop token and length, seeded sampling, steps that must run
synchronously (penalties, logprobs) mixed in, chunked prefill, preemption, aborts."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from prompts import CHAT, RAW

from tandem.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from tandem.engine.llm_engine import LLMEngine
from tandem.engine.outputs import RequestOutput
from tandem.engine.request import PENDING_TOKEN
from tandem.engine.sampling_params import SamplingParams


def make_engine(async_scheduling: bool, num_blocks: int | None = None,
                budget: int = 2048, skip_tokenizer_init: bool = False) -> LLMEngine:
    return LLMEngine(EngineConfig(
        model="smollm2-135m-instruct", skip_tokenizer_init=skip_tokenizer_init,
        cache=CacheConfig(num_blocks=num_blocks),
        scheduler=SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=budget,
                                  max_model_len=512),
        async_scheduling=async_scheduling,
    ))


def greedy(**kw) -> SamplingParams:  # noqa: ANN003
    return SamplingParams(temperature=0.0, **kw)


# (prompt, params, the engine step at which it arrives). Unseeded sampling draws from
# the process's generator, which two engines share, so only greedy and seeded here.
WORKLOAD = [
    (RAW[1], greedy(max_tokens=20), 0),
    (RAW[4], greedy(max_tokens=1), 0),
    (CHAT[0], greedy(max_tokens=40), 0),  # ends with EOS
    (RAW[2], greedy(max_tokens=30, stop=["\n\n", "return"]), 0),
    (RAW[5], greedy(max_tokens=24, min_tokens=4, stop_token_ids=[13]), 2),
    (RAW[7], SamplingParams(max_tokens=18, temperature=0.8, top_p=0.9, seed=7), 3),
    (CHAT[1], greedy(max_tokens=12, repetition_penalty=1.3), 6),  # synchronous
    (RAW[0], greedy(max_tokens=10, logprobs=2), 9),  # synchronous
    (CHAT[5] * 3, greedy(max_tokens=16, ignore_eos=True), 12),
]


@dataclass
class Run:
    finals: dict[str, RequestOutput] = field(default_factory=dict)
    streamed: dict[str, str] = field(default_factory=dict)  # the deltas, joined
    steps: int = 0
    launched_ahead: int = 0  # steps after which one was left in flight


def run(engine: LLMEngine, workload=WORKLOAD) -> Run:  # noqa: ANN001
    result = Run()
    pending = list(enumerate(workload))
    while pending or engine.has_unfinished:
        for i, (prompt, params, at) in list(pending):
            if at <= result.steps:
                engine.add_request(f"r{i}", prompt, params)
                pending.remove((i, (prompt, params, at)))
        for out in engine.step():
            assert PENDING_TOKEN not in out.token_ids
            result.streamed[out.request_id] = result.streamed.get(out.request_id, "") + out.delta
            if out.finished:
                assert out.request_id not in result.finals, "finished twice"
                result.finals[out.request_id] = out
        result.steps += 1
        result.launched_ahead += engine._launched is not None
        assert result.steps < 1000, "the engine does not finish"
    return result


def assert_same(a: Run, b: Run) -> None:
    assert a.finals.keys() == b.finals.keys()
    for rid, x in a.finals.items():
        y = b.finals[rid]
        assert (x.token_ids, x.text, x.finish_reason, x.stop_reason) == (
            y.token_ids, y.text, y.finish_reason, y.stop_reason), rid
        assert (x.logprobs is None) == (y.logprobs is None), rid
        for lx, ly in zip(x.logprobs or [], y.logprobs or [], strict=True):
            assert lx.keys() == ly.keys() and lx == pytest.approx(ly, abs=1e-4), rid
        for run_ in (a, b):  # a stop string's start is held back, never streamed
            assert run_.streamed[rid] == run_.finals[rid].text, rid


def assert_nothing_held(engine: LLMEngine) -> None:
    assert not engine.has_unfinished
    assert engine.block_pool.num_free_blocks == engine.block_pool.num_blocks
    assert not engine.runner._rows, "every runner row is released"


@pytest.fixture(scope="module")
def sync_engine() -> LLMEngine:
    return make_engine(async_scheduling=False)


@pytest.fixture(scope="module")
def async_engine() -> LLMEngine:
    return make_engine(async_scheduling=True)


def test_async_outputs_equal_the_synchronous_loop(
    sync_engine: LLMEngine, async_engine: LLMEngine
) -> None:
    expected = run(sync_engine)
    got = run(async_engine)
    assert_same(expected, got)
    assert expected.launched_ahead == 0 and got.launched_ahead > got.steps // 2
    reasons = {out.finish_reason for out in got.finals.values()}
    assert reasons == {"stop", "length"}, "the workload stops both ways"
    assert got.finals["r3"].stop_reason in ("\n\n", "return")
    assert got.finals["r1"].token_ids and len(got.finals["r1"].token_ids) == 1
    assert_nothing_held(async_engine)
    # The engine counts what it generated once per token, pending ones included.
    generated = sum(len(out.token_ids) for out in got.finals.values())
    assert async_engine.num_generation_tokens == sync_engine.num_generation_tokens
    assert generated <= async_engine.num_generation_tokens


def test_async_token_only_outputs_equal_the_synchronous_loop(
    sync_engine: LLMEngine
) -> None:
    # No tokenizer: tokens land without text, most of them by the engine's short path
    # (stops by token only); every stop it must still see: EOS, a stop token, max_tokens
    # (1 and more), the context's end (the last), and the general path beside it
    # (min_tokens).
    ids = [sync_engine.make_request("x", p, greedy()).prompt_token_ids
           for p in (CHAT[0], RAW[1], RAW[5], RAW[4], CHAT[5] * 3, RAW[2])]
    workload = [(ids[0], greedy(max_tokens=40), 0),  # ends with EOS
                (ids[1], greedy(max_tokens=20), 0),
                (ids[2], greedy(max_tokens=24, stop_token_ids=[1672]), 1),
                (ids[2], greedy(max_tokens=24, min_tokens=2, stop_token_ids=[1672]), 2),
                (ids[3], greedy(max_tokens=1), 0),
                (ids[4], greedy(max_tokens=16, ignore_eos=True), 5),
                ((ids[5] * 100)[:500], greedy(max_tokens=None, ignore_eos=True), 3)]
    sync, asyn = (make_engine(a, skip_tokenizer_init=True) for a in (False, True))
    runs = [_token_run(engine, workload) for engine in (sync, asyn)]
    assert runs[0] == runs[1]
    finals = runs[1]
    assert {rid: f[2] for rid, f in finals.items()} == {
        "r0": "stop", "r1": "length", "r2": "stop", "r3": "stop", "r4": "length",
        "r5": "length", "r6": "length"}, "the workload stops every way"
    assert len(finals["r4"][1]) == 1
    assert len(workload[6][0]) + len(finals["r6"][1]) == 512, "the context is full"
    # Token 1672 is the 4th of this prompt's greedy output (min_tokens masks none before).
    assert (len(finals["r2"][1]), len(finals["r3"][1])) == (4, 4)
    assert finals["r2"][3] == finals["r3"][3] == 1672
    assert asyn.num_generation_tokens == sync.num_generation_tokens
    assert_nothing_held(asyn)


def _token_run(engine: LLMEngine, workload) -> dict:  # noqa: ANN001
    """Each request's output counts step by step, its tokens as streamed, finish and stop
    reasons."""
    seen: dict[str, tuple[list[int], list[int], str | None, object]] = {}
    pending, steps = list(enumerate(workload)), 0
    while pending or engine.has_unfinished:
        for i, (prompt, params, at) in list(pending):
            if at <= steps:
                engine.add_request(f"r{i}", prompt, params)
                pending.remove((i, (prompt, params, at)))
        for out in engine.step():
            counts, streamed, _, _ = seen.setdefault(out.request_id, ([], [], None, None))
            assert PENDING_TOKEN not in out.token_ids and out.text == ""
            streamed += out.tokens_since(len(streamed))
            counts.append(out.num_tokens)
            assert streamed == out.token_ids
            if out.finished:
                seen[out.request_id] = (counts, streamed, out.finish_reason, out.stop_reason)
        steps += 1
        assert steps < 1000, "the engine does not finish"
    return seen


def test_async_with_chunked_prefill_and_preemption() -> None:
    # 8 blocks of 16 tokens for four requests that grow to ~40 tokens each: the
    # scheduler preempts, and a 24-token budget chunks every prompt.
    workload = [(p, greedy(max_tokens=28, ignore_eos=True), 0) for p in RAW[1:5]]
    sync, asyn = (make_engine(a, num_blocks=8, budget=24) for a in (False, True))
    expected = run(sync, workload)
    got = run(asyn, workload)
    assert_same(expected, got)
    assert asyn.scheduler.num_preemptions > 0
    assert_nothing_held(asyn)


def test_abort_with_a_step_in_flight(async_engine: LLMEngine) -> None:
    engine = async_engine
    engine.add_request("a", RAW[1], greedy(max_tokens=50, ignore_eos=True))
    engine.add_request("b", RAW[3], greedy(max_tokens=6, ignore_eos=True))
    for _ in range(4):
        engine.step()
    req = engine._requests["a"]
    assert req.output_token_ids[-1] == PENDING_TOKEN, "a step is in flight"
    out = engine.abort("a")
    assert out is not None and out.finish_reason == "abort"
    assert PENDING_TOKEN not in out.token_ids and len(out.token_ids) >= 2
    finals = {}
    while engine.has_unfinished:
        for o in engine.step():
            assert o.request_id != "a", "nothing more of an aborted request"
            if o.finished:
                finals[o.request_id] = o
    assert len(finals["b"].token_ids) == 6
    assert_nothing_held(engine)
