"""Token-exact greedy decoding against Hugging Face on tiny random Llama configs, in
every scheduling mode: alone, concurrent, chunked prefill, prefix hit, preemption."""

from __future__ import annotations

import random

import pytest
import torch
from hf_reference import hf_greedy
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from tandem import LLM, SamplingParams

NEW_TOKENS = 64
COMMON = dict(
    vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    max_position_embeddings=1024, bos_token_id=1, eos_token_id=2,
)
CONFIGS = {
    "mha-untied": LlamaConfig(**COMMON, num_attention_heads=4, num_key_value_heads=4,
                              tie_word_embeddings=False),
    "gqa-tied-llama3-rope": LlamaConfig(
        **COMMON, num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
        rope_theta=500000.0,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
    ),
    "gqa-qkv-bias": Qwen2Config(**COMMON, num_attention_heads=4, num_key_value_heads=1,
                                tie_word_embeddings=False),
}


def _build(name: str, path) -> LlamaForCausalLM:  # noqa: ANN001
    config = CONFIGS[name]
    torch.manual_seed(1234)
    cls = Qwen2ForCausalLM if isinstance(config, Qwen2Config) else LlamaForCausalLM
    model = cls(config).eval()
    # Larger weights than the default init make the next token decisive (no near-ties),
    # so any mismatch is a real bug rather than float noise.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.15)
    model.save_pretrained(path)
    return model


@pytest.fixture(scope="module", params=list(CONFIGS))
def tiny(request, tmp_path_factory):  # noqa: ANN001, ANN201
    path = tmp_path_factory.mktemp(request.param)
    model = _build(request.param, path)
    rng = random.Random(7)
    lengths = [1, 3, 15, 16, 17, 40, 64, 100, 129, 200, 257, 300, 31, 48, 5, 90]
    prompts = [[rng.randrange(3, 256) for _ in range(n)] for n in lengths]
    expected = [hf_greedy(model, p, NEW_TOKENS) for p in prompts]
    return path, prompts, expected


GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)


def _generate(path, prompts, **engine_args) -> list[list[int]]:  # noqa: ANN001
    llm = LLM(str(path), **engine_args)
    return [o.token_ids for o in llm.generate(prompts, GREEDY)]


def test_alone(tiny):  # noqa: ANN001
    path, prompts, expected = tiny
    llm = LLM(str(path))
    for p, e in zip(prompts[:6], expected[:6]):
        assert llm.generate(p, GREEDY)[0].token_ids == e


def test_concurrent_mixed_lengths(tiny):  # noqa: ANN001
    path, prompts, expected = tiny
    assert len(prompts) == 16
    assert _generate(path, prompts) == expected


def test_chunked_prefill(tiny):  # noqa: ANN001
    path, prompts, expected = tiny
    # A 37-token budget is smaller than most prompts: they are prefilled in chunks,
    # interleaved with other requests' decodes.
    assert _generate(path, prompts, max_num_batched_tokens=37) == expected


def test_preemption_and_resumption(tiny):  # noqa: ANN001
    path, prompts, expected = tiny
    llm = LLM(str(path), num_kv_blocks=40, max_model_len=640)
    outs = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == expected
    assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.block_pool.num_free_blocks == 40


def test_prefix_cache_hit(tiny):  # noqa: ANN001
    path, _, _ = tiny
    rng = random.Random(11)
    prefix = [rng.randrange(3, 256) for _ in range(200)]
    first = prefix + [rng.randrange(3, 256) for _ in range(30)]
    second = prefix + [rng.randrange(3, 256) for _ in range(25)]
    model = LlamaForCausalLM if "qkv" not in str(path) else Qwen2ForCausalLM
    hf = model.from_pretrained(path).eval()
    llm = LLM(str(path))
    a = llm.generate(first, GREEDY)[0]
    b = llm.generate(second, GREEDY)[0]
    assert a.num_cached_tokens == 0
    # 200 shared tokens = 12 full 16-token blocks (192 tokens) reused; 33 computed.
    assert b.num_cached_tokens == 192
    assert len(second) - b.num_cached_tokens == 33
    assert a.token_ids == hf_greedy(hf, first, NEW_TOKENS)
    assert b.token_ids == hf_greedy(hf, second, NEW_TOKENS)
