"""The model runner's persistent state: table rows follow requests (released at the end,
grown when more requests hold one than max_num_seqs); steps laid out as the CUDA graphs'
buckets compute what plain steps do; and the CPU's packed small-batch GEMMs compute what
torch's GEMM does."""

from __future__ import annotations

import random
import re

import pytest
import torch

from tandem import LLM, SamplingParams
from tandem.engine.cpu_linear import linear, mkl_rows
from tandem.engine.cuda_graphs import capture_graphs, prefill_sizes
from tandem.engine.step_layout import SECTION_ALIGN, StepLayout

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def _prompts(n: int) -> list[list[int]]:
    rng = random.Random(1)
    return [[rng.randrange(10, 500) for _ in range(rng.randint(5, 40))] for _ in range(n)]


def test_reserved_requests_wait_for_max_num_seqs_and_rows_are_released() -> None:
    prompts = _prompts(5)
    expected = [o.token_ids for o in LLM("tiny", load_format="dummy").generate(prompts, GREEDY)]
    engine = LLM("tiny", load_format="dummy", max_num_seqs=1).engine
    runner = engine.runner
    assert runner.table.shape[0] == 2  # the null row and one request's
    # A decode node's reserved requests hold their blocks but run max_num_seqs at a time.
    for i, p in enumerate(prompts):
        engine.reserve(engine.validate_request(f"r{i}", p, GREEDY))
        assert engine.start_prefill(f"r{i}")
    done: dict[str, list[int]] = {}
    while engine.has_unfinished:
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.token_ids
        assert len(engine.scheduler.running) <= 1
    assert [done[f"r{i}"] for i in range(5)] == expected
    assert runner.table.shape[0] == 2
    assert not runner._rows and runner._free_rows == [1]
    # The null block is outside the pool: the KV cache has one block more.
    assert runner.kv_caches[0].shape[1] == engine.block_pool.num_blocks + 1


def test_rows_grow_when_more_requests_hold_one_than_max_num_seqs() -> None:
    """Preempted requests keep their rows while reserved ones run: the table doubles and
    keeps the rows it had."""
    engine = LLM("tiny", load_format="dummy", max_num_seqs=1).engine
    runner = engine.runner
    reqs = [engine.validate_request(f"r{i}", p, GREEDY) for i, p in enumerate(_prompts(3))]
    for r in reqs:
        assert engine.scheduler.kv.allocate(r, r.num_tokens)
    updates: list[tuple[int, int]] = []
    rows = [runner._row(r, updates) for r in reqs]
    assert sorted(rows) == [1, 2, 3] and runner.table.shape[0] == 4
    for r in reqs:
        runner.release(r.request_id)
    assert sorted(runner._free_rows) == [1, 2, 3]


def test_prefill_graph_sizes() -> None:
    assert prefill_sizes(64) == [16, 32, 64]
    assert prefill_sizes(700) == [16, 32, 64, 128, 256, 384, 512, 640, 700]
    assert prefill_sizes(8192)[-3:] == [1792, 1920, 2048]
    assert prefill_sizes(1) == []


def test_steps_laid_out_as_the_graphs_buckets_give_the_plain_steps_tokens() -> None:
    """On the CPU the graphs' forwards run eagerly: the very work a CUDA graph replays,
    padded to its bucket. Prompts one at a time, of lengths across the buckets, two of
    them chunked past max_num_batched_tokens (a chunk after a computed prefix), then all
    of them as one batch (decode graphs): the tokens of plain steps, every prompt step
    through a prefill bucket."""
    rng = random.Random(2)
    prompts = [[rng.randrange(10, 500) for _ in range(n)]
               for n in (2, 15, 16, 17, 40, 63, 64, 100, 130)]
    kwargs = {"load_format": "dummy", "max_num_batched_tokens": 64, "max_num_seqs": 8}
    plain = LLM("tiny", **kwargs)
    expected = [plain.generate(p, GREEDY)[0].token_ids for p in prompts]
    expected_batch = [o.token_ids for o in plain.generate(prompts, GREEDY)]
    llm = LLM("tiny", **kwargs)
    runner = llm.engine.runner
    capture_graphs(runner, max_batch=8, max_tokens=64, show_progress=False)
    replayed: list[int] = []
    replay = runner.prefill_graphs.replay
    runner.prefill_graphs.replay = lambda bucket: replayed.append(bucket) or replay(bucket)
    assert [llm.generate(p, GREEDY)[0].token_ids for p in prompts] == expected
    assert replayed == [16, 16, 16, 32, 64, 64, 64, 64, 64, 64, 64, 16]
    assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == expected_batch


def test_mixed_steps_laid_out_as_their_graphs_give_the_plain_steps_tokens() -> None:
    """A batch of prompts past the token budget: each step admits prompts (some chunked)
    beside the decodes of those before, laid out as a mixed graph's bucket (the tokens
    and sequences past the step's padding, the rest empty), and every step is a graph's:
    the tokens of plain steps. Then more prompts than max_num_seqs, so prompts join a
    full decode batch as others finish."""
    rng = random.Random(3)
    prompts = [[rng.randrange(10, 500) for _ in range(rng.randrange(2, 90))]
               for _ in range(14)]
    kwargs = {"load_format": "dummy", "max_num_batched_tokens": 64, "max_num_seqs": 6}
    params = [SamplingParams(temperature=0.0, max_tokens=rng.randrange(1, 12),
                             ignore_eos=True) for _ in prompts]
    plain = LLM("tiny", **kwargs)
    expected = [o.token_ids for o in plain.generate(prompts, params)]
    llm = LLM("tiny", **kwargs)
    runner = llm.engine.runner
    capture_graphs(runner, max_batch=6, max_tokens=64, show_progress=False, mixed=True)
    assert runner.mixed_graphs.seqs == 7
    replayed: list[int] = []
    replay = runner.mixed_graphs.replay
    runner.mixed_graphs.replay = lambda bucket: replayed.append(bucket) or replay(bucket)
    assert [o.token_ids for o in llm.generate(prompts, params)] == expected
    assert len(replayed) >= 8 and set(replayed) <= {16, 32, 64}
    assert runner.steps["eager"] == 0


@pytest.mark.parametrize("rows", [1, 3, 8, 300])
def test_cpu_linear_matches_torch(rows: int) -> None:
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 96, generator=g)
    weight = torch.randn(200, 96, generator=g)
    bias = torch.randn(200, generator=g)
    for b in (None, bias):
        got = linear(x, weight, b)
        torch.testing.assert_close(got, torch.nn.functional.linear(x, weight, b),
                                   rtol=1e-5, atol=1e-5)
        assert linear(x, weight, b).equal(got)  # the packed weight, reused


def test_one_row_goes_to_mkl_exactly_when_mkl_has_every_thread() -> None:
    """`mkl_rows` is 1 when MKL runs on as many threads as torch (torch's own report),
    else 0; rows up to it give torch's GEMM's very bits, rows above the packed weight's
    (equal to within rounding)."""
    found = re.search(r"mkl_get_max_threads\(\) : (\d+)", torch.__config__.parallel_info())
    assert found, "torch no longer reports MKL's threads"
    assert mkl_rows() == int(int(found.group(1)) >= torch.get_num_threads())
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(192, 64, generator=g)
    for rows in range(1, 6):
        x = torch.randn(rows, 64, generator=g)
        want, got = torch.nn.functional.linear(x, weight), linear(x, weight)
        if rows <= mkl_rows():
            assert got.equal(want)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("tokens,seqs,logits,updates,carries",
                         [(1, 1, 1, 0, 0), (17, 3, 2, 5, 1), (2048, 16, 16, 130, 0)])
def test_step_sections_start_64_byte_aligned(tokens: int, seqs: int, logits: int,
                                             updates: int, carries: int) -> None:
    """Triton compiles a kernel per alignment of its pointers: every section of a step's
    inputs starts on 16 int32s, whatever the step's sizes, and they do not overlap."""
    layout = StepLayout(tokens, seqs, logits, updates, carries)
    spans = list(layout.offsets.values())
    assert all(a % SECTION_ALIGN == 0 for a, _ in spans)
    assert all(b <= c for (_, b), (c, _) in zip(spans, spans[1:]))
    assert layout.size == spans[-1][1]
    # A graph's inputs sit where they were at capture, whatever a step adds after them.
    bare = StepLayout(tokens, seqs, logits, 0).offsets
    assert {k: layout.offsets[k] for k in ("ids", "seq_lens", "logits_rows")} == {
        k: bare[k] for k in ("ids", "seq_lens", "logits_rows")}
