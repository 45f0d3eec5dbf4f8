from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import pytest
import torch

from tandem.engine.request import Request
from tandem.engine.sampler import Sampler, _apply_penalties
from tandem.engine.sampling_params import SamplingParams


def _req(prompt: Sequence[int] = (1, 2, 3), output: Sequence[int] = (), **params: Any) -> Request:
    return Request("r", list(prompt), SamplingParams(**params), output_token_ids=list(output))


# --- greedy -----------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_greedy_is_argmax(dtype: torch.dtype) -> None:
    logits = torch.randn(8, 100, generator=torch.Generator().manual_seed(0)).to(dtype)
    before = logits.clone()
    # Rows 0-3 greedy (temperature 0, or top_k=1 at any temperature); 4-7 sampled.
    params = [dict(temperature=0.0)] * 3 + [dict(temperature=1.3, top_k=1)] + [{}] * 4
    out = Sampler()(logits, [_req(**p) for p in params])
    assert out.token_ids[:4] == logits[:4].float().argmax(dim=-1).tolist()
    assert all(0 <= t < 100 for t in out.token_ids)
    assert out.logprobs == [None] * 8
    assert torch.equal(logits, before)  # the caller's tensor is never modified


def test_greedy_ties_pick_lowest_id() -> None:
    logits = torch.tensor([[0.0, 3.0, 1.0, 3.0]] * 2)
    out = Sampler()(logits, [_req(temperature=0.0), _req(temperature=0.5, top_k=1)])
    assert out.token_ids == [1, 1]


# --- seeded sampling ----------------------------------------------------------------------

V = 64
STEPS = 50
# Flat-ish logits so a sampled sequence is diverse and a wrong stream shows up at once.
STEP_LOGITS = torch.randn(STEPS, V, generator=torch.Generator().manual_seed(7))


def _decode(target: Request, others: list[Request], index: int) -> list[int]:
    """Runs STEPS steps with `target` at batch row `index`; returns its tokens."""
    sampler = Sampler()
    batch = others[:index] + [target] + others[index:]
    for step in range(STEPS):
        logits = torch.randn(len(batch), V) * 3  # filler for the others, from the global RNG
        logits[index] = STEP_LOGITS[step]
        out = sampler(logits, batch)
        for req, tok in zip(batch, out.token_ids, strict=True):
            req.output_token_ids.append(tok)
    return target.output_token_ids


def _others() -> list[Request]:
    return [
        _req(temperature=1.0),
        _req(temperature=0.8, top_k=10, seed=99),
        _req(temperature=0.0, repetition_penalty=1.3),
        _req(temperature=1.2, min_p=0.1, logprobs=3),
    ]


def test_seeded_sampling_is_reproducible_across_batches() -> None:
    params = dict(temperature=0.9, top_p=0.95, seed=1234)
    torch.manual_seed(0)
    alone = _decode(_req(**params), [], 0)
    torch.manual_seed(1)
    mixed = _decode(_req(**params), _others(), 2)
    torch.manual_seed(2)
    reordered = _decode(_req(**params), _others()[::-1], 1)
    assert len(set(alone)) > 10  # really sampled, not stuck on one token
    assert alone == mixed == reordered


def test_seeded_request_keeps_its_generator() -> None:
    seeded, unseeded = _req(seed=5), _req()
    Sampler()(torch.zeros(2, 10), [seeded, unseeded])
    assert isinstance(seeded.generator, torch.Generator)
    assert unseeded.generator is None
    # Later steps continue the stored stream rather than restarting from the seed.
    state = seeded.generator.get_state()
    Sampler()(torch.zeros(1, 10), [seeded])
    assert not torch.equal(seeded.generator.get_state(), state)


def test_different_seeds_differ() -> None:
    a = _decode(_req(temperature=1.0, seed=1), [], 0)
    b = _decode(_req(temperature=1.0, seed=2), [], 0)
    assert a != b


# --- penalties ----------------------------------------------------------------------------


def test_penalties_exact() -> None:
    logits = torch.tensor([[2.0, -1.0, 0.5, -0.5, 3.0, 0.0, 1.0]] * 2)
    penalized = _req(
        prompt=[0, 1],
        output=[2, 2, 3, 6, 6, 6],
        repetition_penalty=2.0,
        frequency_penalty=0.5,
        presence_penalty=0.25,
    )
    plain = _req(prompt=[0, 1], output=[2, 2, 3])
    _apply_penalties(logits, [penalized, plain])
    expected = [
        2.0 / 2,  # prompt only, positive: divided by the repetition penalty
        -1.0 * 2,  # prompt only, negative: multiplied
        0.5 / 2 - 0.5 * 2 - 0.25,  # output twice
        -0.5 * 2 - 0.5 * 1 - 0.25,  # output once
        3.0,  # unseen
        0.0,  # unseen
        1.0 / 2 - 0.5 * 3 - 0.25,  # output three times
    ]
    assert logits[0].tolist() == pytest.approx(expected, abs=1e-6)
    assert logits[1].tolist() == [2.0, -1.0, 0.5, -0.5, 3.0, 0.0, 1.0]


def test_penalty_counts_follow_the_output_step_by_step() -> None:
    """Counts are kept on the request and only the new tokens are added each step: after
    every step they give what a request built fresh with the same output gives."""
    params = dict(repetition_penalty=1.5, frequency_penalty=0.3, presence_penalty=0.1)
    running = _req(prompt=[0, 5], **params)
    base = torch.tensor([[2.0, -1.0, 0.5, -0.5, 3.0, 0.0, 1.0]])
    for new in ([2], [2, 3], [], [6, 6, 2]):
        running.output_token_ids.extend(new)
        kept, fresh = base.clone(), base.clone()
        _apply_penalties(kept, [running])
        _apply_penalties(fresh, [_req(prompt=[0, 5], output=running.output_token_ids,
                                      **params)])
        assert torch.equal(kept, fresh), running.output_token_ids
    assert running.penalty_counts.num_counted == 6
    assert running.penalty_counts.output.tolist() == [0, 0, 3, 1, 0, 0, 2]


def test_frequency_and_presence_ignore_the_prompt() -> None:
    logits = torch.tensor([[1.0, 0.9, 0.0]] * 2)
    reqs = [
        _req(prompt=[0, 0, 0], output=[], frequency_penalty=2.0, presence_penalty=2.0),
        _req(prompt=[0], output=[0], presence_penalty=0.2),
    ]
    _apply_penalties(logits, reqs)
    assert logits[0].tolist() == pytest.approx([1.0, 0.9, 0.0])
    assert logits[1].tolist() == pytest.approx([0.8, 0.9, 0.0])


def test_penalty_changes_greedy_choice() -> None:
    logits = torch.tensor([[1.0, 0.9, 0.0]])
    assert Sampler()(logits, [_req(temperature=0.0)]).token_ids == [0]
    req = _req(output=[0], temperature=0.0, presence_penalty=0.2)
    assert Sampler()(logits, [req]).token_ids == [1]


# --- logprobs -----------------------------------------------------------------------------


def test_logprobs_come_from_raw_logits() -> None:
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(3)) * 2
    reqs = [
        # Penalties, temperature and filters must not change the reported logprobs.
        _req(output=[5, 6], logprobs=5, temperature=0.5, repetition_penalty=1.5, top_k=20),
        _req(logprobs=None),
        _req(logprobs=0, seed=11),
        _req(logprobs=3, temperature=0.0),
    ]
    out = Sampler()(logits, reqs)
    ref = torch.log_softmax(logits.double(), dim=-1)
    assert out.logprobs[1] is None
    for i, n in [(0, 5), (2, 0), (3, 3)]:
        entry = out.logprobs[i]
        assert entry is not None
        top = ref[i].topk(n).indices.tolist()
        sampled = out.token_ids[i]
        assert list(entry)[:n] == top  # top-n first, best first
        assert set(entry) == set(top) | {sampled}
        for tok, lp in entry.items():
            assert lp == pytest.approx(ref[i, tok].item(), abs=1e-5)
    assert out.token_ids[3] == logits[3].argmax().item()


# --- distribution of the filters ----------------------------------------------------------

LOGITS = [2.0, 1.6, 1.3, 1.0, 0.6, 0.2, -0.3, -0.9, -1.6, -2.5]
N = 20_000


def _expected(
    temperature: float = 1.0, top_k: int | None = None, top_p: float = 1.0, min_p: float = 0.0
) -> list[float]:
    """Float64 reference: softmax(logits / T) → min_p → top_k → top_p, renormalized."""
    x = [v / temperature for v in LOGITS]
    z = sum(math.exp(v) for v in x)
    p = [math.exp(v) / z for v in x]
    # Keep cut points away from the thresholds, so float32 rounding can't move them.
    assert all(abs(pi - min_p * max(p)) > 1e-4 for pi in p)
    keep = [pi >= min_p * max(p) for pi in p]
    order = sorted(range(len(p)), key=lambda i: -p[i])
    for rank, i in enumerate(order):
        keep[i] = keep[i] and (top_k is None or rank < top_k)
    mass, before = sum(p[i] for i in order if keep[i]), 0.0
    for i in [i for i in order if keep[i]]:
        assert abs(before - top_p) > 1e-4
        keep[i] = top_p == 1.0 or before < top_p
        before += p[i] / mass
    kept = sum(p[i] for i in range(len(p)) if keep[i])
    return [p[i] / kept if keep[i] else 0.0 for i in range(len(p))]


def _matches(tokens: list[int], expected: list[float]) -> bool:
    # Tolerance: every token's empirical frequency is within 4.5 standard errors
    # sqrt(p(1-p)/N) of its expected probability (a false failure is ~1e-5 per token);
    # a filtered-out token (p = 0) must never be drawn.
    counts = [tokens.count(t) for t in range(len(expected))]
    for count, p in zip(counts, expected, strict=True):
        if p == 0.0:
            if count:
                return False
        elif abs(count / N - p) >= 4.5 * math.sqrt(p * (1 - p) / N):
            return False
    return True


CONFIGS = [
    dict(temperature=1.0),
    dict(temperature=0.6),
    dict(temperature=1.0, top_k=3),
    dict(temperature=1.0, top_p=0.7),
    dict(temperature=1.0, min_p=0.15),
    # top_p applies to the top-k set renormalized: it drops token 6, which it would keep
    # if measured against the full distribution.
    dict(temperature=1.5, top_k=7, top_p=0.93, min_p=0.1),
]


@pytest.mark.parametrize("config", CONFIGS, ids=str)
def test_empirical_distribution(config: dict[str, Any]) -> None:
    expected = _expected(**config)
    if config != dict(temperature=1.0):
        # The check can fail: it would reject the unfiltered softmax.
        assert not _matches(_sample_unfiltered(), expected)
    with torch.random.fork_rng():
        torch.manual_seed(0)  # unseeded rows use the global RNG; seed it for a fixed draw
        logits = torch.tensor([LOGITS]).expand(N, -1)
        params = SamplingParams(**config)  # shared: building 20000 copies dominates the test
        reqs = [Request(f"r{i}", [1], params) for i in range(N)]
        tokens = Sampler()(logits, reqs).token_ids
    assert _matches(tokens, expected)


def _sample_unfiltered() -> list[int]:
    probs = torch.tensor(_expected(), dtype=torch.float64)
    return torch.multinomial(
        probs, N, replacement=True, generator=torch.Generator().manual_seed(1)
    ).tolist()


def test_empirical_distribution_per_request_generators() -> None:
    # Same check through the seeded path: one generator per row, seeds 0..N-1.
    config = CONFIGS[-1]
    logits = torch.tensor([LOGITS]).expand(N, -1)
    tokens = Sampler()(logits, [_req(**config, seed=s) for s in range(N)]).token_ids
    assert _matches(tokens, _expected(**config))


def test_tiny_top_p_keeps_the_top_token() -> None:
    flat = torch.tensor([[0.10, 0.12, 0.11, 0.09]]).expand(1000, -1)
    peaked = torch.tensor([[0.0, 0.0, 5.0, 0.0]]).expand(1000, -1)
    for logits in (flat, peaked):
        reqs = [_req(temperature=2.0, top_p=1e-6) for _ in range(1000)]
        top = logits[0].argmax().item()
        assert Sampler()(logits, reqs).token_ids == [top] * 1000


# --- min_tokens ---------------------------------------------------------------------------

EOS = 0
STOP = 1
# EOS best, then the stop token, then token 2.
MIN_TOKENS_LOGITS = torch.tensor([[9.0, 8.0, 7.0, 1.0]])


@pytest.mark.parametrize(
    ("num_out", "ignore_eos", "expected"),
    [(1, False, 2), (2, False, EOS), (1, True, EOS), (0, True, EOS)],
)
def test_min_tokens_masks_eos_and_stop_ids(num_out: int, ignore_eos: bool, expected: int) -> None:
    req = _req(
        output=[3] * num_out,
        temperature=0.0,
        min_tokens=2,
        stop_token_ids=[STOP],
        ignore_eos=ignore_eos,
    )
    assert Sampler(eos_token_ids=(EOS,))(MIN_TOKENS_LOGITS, [req]).token_ids == [expected]


def test_min_tokens_masks_stop_id_even_with_ignore_eos() -> None:
    logits = torch.tensor([[8.0, 9.0, 7.0, 1.0]])
    req = _req(temperature=0.0, min_tokens=1, stop_token_ids=[STOP], ignore_eos=True)
    assert Sampler(eos_token_ids=(EOS,))(logits, [req]).token_ids == [EOS]


def test_min_tokens_never_samples_masked_ids() -> None:
    logits = MIN_TOKENS_LOGITS.expand(2000, -1)
    reqs = [_req(temperature=1.0, min_tokens=1, stop_token_ids=[STOP]) for _ in range(2000)]
    tokens = Sampler(eos_token_ids=(EOS,))(logits, reqs).token_ids
    assert EOS not in tokens and STOP not in tokens
    assert tokens.count(2) > 1900  # e^7 vs e^1: token 2 dominates what is left
