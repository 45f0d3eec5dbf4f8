"""SmolLM2-135M-Instruct (the real GGUF weights): greedy output token-identical to
Hugging Face transformers on 20 prompts, in every scheduling mode of the engine.

The reference is transformers' greedy pick after each prefix of the engine's output for
all 20 prompts at once (one forward a prompt, `hf_greedy_picks`): equal to that output
exactly when it is transformers' greedy continuation (`test_all_20_batched`). Alone,
one request at a time, six prompts of every length class run (1 token to 1,725): a
request alone takes 64 decode steps of its own, the 20 took 100 of the suite's seconds."""

from __future__ import annotations

import pytest
import torch
from hf_reference import hf_greedy_picks
from prompts import CHAT, LONG_CHAT, LONG_RAW, RAW
from transformers import AutoModelForCausalLM

from tandem import LLM, SamplingParams

NEW_TOKENS = 64
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM("smollm2-135m-instruct")


@pytest.fixture(scope="module")
def prompts(llm: LLM) -> list[list[int]]:
    tok = llm.get_tokenizer()
    chat = [tok.apply_chat_template([{"role": "user", "content": c}]) for c in CHAT + [LONG_CHAT]]
    raw = [tok.encode(r) for r in RAW + [LONG_RAW]]
    ids = chat + raw
    lengths = sorted(len(p) for p in ids)
    assert len(ids) == 20 and lengths[0] == 1 and lengths[-1] > 1000, lengths
    return ids


@pytest.fixture(scope="module")
def hf(smollm2_path):  # noqa: ANN001, ANN201
    # transformers dequantises the GGUF itself: an independent path to the same weights.
    return AutoModelForCausalLM.from_pretrained(
        smollm2_path.parent, gguf_file=smollm2_path.name, dtype=torch.float32
    ).eval()


ALONE = (9, 19, 10, 0, 14, 18)  # long chat and raw, 1 token, short chat, raw of 14 and 3


@pytest.fixture(scope="module")
def batched(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    return _ids(llm.generate(prompts, GREEDY))


@pytest.fixture(scope="module")
def expected(hf, prompts: list[list[int]], batched: list[list[int]]) -> list[list[int]]:  # noqa: ANN001
    """Transformers' greedy pick after each prefix of the engine's batched output."""
    return [hf_greedy_picks(hf, p, out) for p, out in zip(prompts, batched)]


def _ids(outputs) -> list[list[int]]:  # noqa: ANN001
    return [o.token_ids for o in outputs]


def _assert_equal(got: list[list[int]], want: list[list[int]], which: list[int]) -> None:
    for i, g, w in zip(which, got, want, strict=True):
        first = next((j for j, (a, b) in enumerate(zip(g, w)) if a != b), None)
        assert first is None, f"prompt {i}: token {first} is {g[first]}, transformers' {w[first]}"


def test_all_20_batched(batched, expected) -> None:  # noqa: ANN001
    _assert_equal(batched, expected, list(range(20)))


def test_prompts_alone(prompts, expected) -> None:  # noqa: ANN001
    assert sorted({len(prompts[i]) for i in ALONE}) == [1, 3, 14, 37, 1685, 1725]
    llm = LLM("smollm2-135m-instruct")  # a cache of its own: the batched run's is full
    alone = [llm.generate(prompts[i], GREEDY)[0].token_ids for i in ALONE]
    _assert_equal(alone, [expected[i] for i in ALONE], list(ALONE))


def test_16_concurrent_mixed_lengths(prompts, expected) -> None:  # noqa: ANN001
    # Prefix caching off so every prompt is computed, batched together.
    llm = LLM("smollm2-135m-instruct", enable_prefix_caching=False)
    picked = list(range(4, 20))
    outs = llm.generate([prompts[i] for i in picked], GREEDY)
    assert _ids(outs) == [expected[i] for i in picked]


def test_chunked_prefill(prompts, expected) -> None:  # noqa: ANN001
    llm = LLM("smollm2-135m-instruct", max_num_batched_tokens=200, enable_prefix_caching=False)
    assert _ids(llm.generate(prompts, GREEDY)) == expected


def test_preemption_and_resumption(prompts, expected) -> None:  # noqa: ANN001
    # 150 blocks (2,400 tokens) cannot hold all 20 requests at once.
    llm = LLM("smollm2-135m-instruct", num_kv_blocks=150, max_model_len=2400)
    assert _ids(llm.generate(prompts, GREEDY)) == expected
    assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.block_pool.num_free_blocks == 150


def test_prefix_cache_hit(hf, prompts) -> None:  # noqa: ANN001
    llm = LLM("smollm2-135m-instruct")
    tok = llm.get_tokenizer()
    prefix = prompts[9][:200]  # the long chat prompt's first 200 tokens
    first = prefix + tok.encode(" Question one: who is this for?")
    second = prefix + tok.encode(" Question two: what is the main topic?")
    a, b = llm.generate([first], GREEDY)[0], llm.generate([second], GREEDY)[0]
    assert a.num_cached_tokens == 0
    # 200 shared tokens hold 12 full 16-token blocks: 192 tokens reused, the rest computed.
    assert b.num_cached_tokens == 192
    computed = len(second) - b.num_cached_tokens
    assert computed == len(second) - 192 and computed < 40, computed
    assert hf_greedy_picks(hf, first, a.token_ids) == a.token_ids
    assert hf_greedy_picks(hf, second, b.token_ids) == b.token_ids
