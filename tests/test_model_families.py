"""Model families from Hugging Face checkpoints: tiny random models built with
transformers' own config and model classes, saved with `save_pretrained`, every weight
perturbed (norms and biases too, so each one matters); Tandem's greedy tokens equal
transformers', alone and batched, CPU fp32, prompts longer than a sliding window among
them. An architecture Tandem lacks is refused by name before any weight is read."""

from __future__ import annotations

import json
import random
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from hf_reference import hf_greedy
from serving_helpers import tandem_up
from transformers import (
    Gemma2Config,
    Gemma2ForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    MistralConfig,
    MistralForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)
from triton_interpreter import HAS_TRITON, run_under_interpreter

from tandem import LLM, SamplingParams
from tandem.engine.config import NAMED_SHAPES, ModelConfig
from tandem.engine.models import MODELS

NEW_TOKENS = 24
COMMON = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              max_position_embeddings=1024, bos_token_id=1, eos_token_id=2)
GEMMA = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
             max_position_embeddings=1024, bos_token_id=2, eos_token_id=1, pad_token_id=0,
             num_attention_heads=4, num_key_value_heads=2, head_dim=16,
             query_pre_attn_scalar=24, sliding_window=8)
FAMILIES = {
    # head_dim 32 with 4 heads of a 64-wide model: Qwen3's head_dim is its own.
    "qwen3": (Qwen3Config(**COMMON, num_attention_heads=4, num_key_value_heads=2,
                          head_dim=32, tie_word_embeddings=True, rope_theta=1000000.0),
              Qwen3ForCausalLM),
    "mistral": (MistralConfig(**COMMON, num_attention_heads=4, num_key_value_heads=1,
                              tie_word_embeddings=False, sliding_window=None),
                MistralForCausalLM),
    # Mistral v0.1's window, every layer: 8 keys, so prompts of 16 to 150 tokens pass it
    # and decoding gives back the 16-token blocks behind it.
    "mistral-window": (MistralConfig(**COMMON, num_attention_heads=4, num_key_value_heads=1,
                                     tie_word_embeddings=False, sliding_window=8),
                       MistralForCausalLM),
    # 8 experts, 2 a token: with 150-token prompts every expert gets tokens.
    "mixtral": (MixtralConfig(**COMMON, num_attention_heads=4, num_key_value_heads=2,
                              num_local_experts=8, num_experts_per_tok=2,
                              tie_word_embeddings=False, sliding_window=None),
                MixtralForCausalLM),
    # Layer 0 dense (mlp_only_layers), layer 1 with experts; weights not renormalised.
    "qwen3-moe": (Qwen3MoeConfig(**COMMON, num_attention_heads=4, num_key_value_heads=2,
                                 head_dim=32, num_experts=8, num_experts_per_tok=3,
                                 moe_intermediate_size=48, norm_topk_prob=False,
                                 decoder_sparse_step=1, mlp_only_layers=[0],
                                 tie_word_embeddings=True),
                  Qwen3MoeForCausalLM),
    # Gemma: its norms, GeGLU, scaled embeddings, soft-capping and sliding windows.
    # Layers 0 and 2 slide over 8 keys: prompts of 33 to 150 tokens pass the window.
    "gemma2": (Gemma2Config(**GEMMA, attn_logit_softcapping=5.0, final_logit_softcapping=3.0),
               Gemma2ForCausalLM),
    # Layer 2 global (every 3rd); global RoPE scaled linearly, the sliding layers' own base.
    "gemma3": (Gemma3TextConfig(**GEMMA, layer_types=["sliding_attention",
                                                      "sliding_attention", "full_attention"],
                                rope_parameters={
                                    "full_attention": {"rope_type": "linear", "factor": 4.0,
                                                       "rope_theta": 100000.0},
                                    "sliding_attention": {"rope_type": "default",
                                                          "rope_theta": 10000.0}}),
               Gemma3ForCausalLM),
}
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)


def _build(name: str, tmp_path_factory):  # noqa: ANN001, ANN202
    """The saved model's directory, prompts, and transformers' greedy tokens for them."""
    config, cls = FAMILIES[name]
    torch.manual_seed(4321)
    model = cls(config).eval()
    with torch.no_grad():  # decisive logits, and norms that are not all ones
        for pname, p in model.named_parameters():
            if pname.endswith(".gate.weight"):  # an MoE router: decisive top k too
                # (a random router's near-tied experts flip between two bf16 paths)
                p.normal_(0.0, 1.0)
            elif p.dim() == 2:
                p.normal_(0.0, 0.15)
            elif pname.endswith("norm.weight"):
                p.normal_(1.0, 0.3)
            else:
                p.normal_(0.0, 0.3)
    path = tmp_path_factory.mktemp(name)
    model.save_pretrained(path)
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 256) for _ in range(n)] for n in (1, 7, 16, 33, 90, 150)]
    return path, prompts, [hf_greedy(model, p, NEW_TOKENS) for p in prompts]


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):  # noqa: ANN001, ANN201
    return _build(request.param, tmp_path_factory)


@pytest.fixture(scope="module", params=["qwen3", "qwen3-moe"])
def served(request, tmp_path_factory):  # noqa: ANN001, ANN201
    return _build(request.param, tmp_path_factory)


def test_greedy_tokens_equal_transformers_alone_and_batched(family) -> None:  # noqa: ANN001
    path, prompts, expected = family
    llm = LLM(str(path), device="cpu", dtype=torch.float32)
    for prompt, want in zip(prompts[:3], expected[:3]):
        assert llm.generate(prompt, GREEDY)[0].token_ids == want
    assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == expected


def test_blocks_behind_a_sliding_window_are_given_back(tmp_path_factory) -> None:  # noqa: ANN001
    """Every layer slides (Mistral v0.1): a decoding request holds only the blocks its
    next query sees, the rest go back to the pool as it decodes, and its tokens are still
    transformers'. The model's context is not cut at the window."""
    path, prompts, expected = _build("mistral-window", tmp_path_factory)
    llm = LLM(str(path), device="cpu", dtype=torch.float32, num_kv_blocks=64)
    engine = llm.engine
    assert engine.max_model_len == 1024
    pool, kv = engine.block_pool, engine.scheduler.kv
    assert kv.window == 8
    req = engine.add_request("long", prompts[-1], GREEDY)  # 150 tokens: 10 blocks
    held = []
    while engine.has_unfinished:
        outputs = engine.step()
        if not req.is_finished:
            held.append(len(req.block_ids) - req.num_released_blocks)
            assert pool.num_free_blocks == 64 - held[-1]
    assert outputs[-1].token_ids == expected[-1]
    # The prompt's 10 blocks while it is computed, then the window's one or two.
    assert held[0] == 10 and max(held[2:]) <= 2, held
    assert pool.num_free_blocks == 64


def test_served_through_tandem_up(served) -> None:  # noqa: ANN001
    """1P1D (a prefill and a decode node, the KV pushed over tcp) serves the checkpoint
    directory: concurrent completions give transformers' tokens."""
    path, prompts, expected = served
    flags = ["--model", str(path), "--skip-tokenizer-init", "--num-kv-blocks", "128"]
    with tandem_up(flags) as (url, _, _):
        def complete(prompt: list[int]) -> list[int]:
            body = {"model": str(path), "prompt": prompt, "max_tokens": NEW_TOKENS,
                    "temperature": 0.0, "ignore_eos": True}
            request = urllib.request.Request(f"{url}/v1/completions", json.dumps(body).encode(),
                                             {"Content-Type": "application/json"})
            with urllib.request.urlopen(request, timeout=120) as response:
                return json.loads(response.read())["choices"][0]["token_ids"]

        with ThreadPoolExecutor(len(prompts)) as pool:
            assert list(pool.map(complete, prompts)) == expected


def test_qwen3_norms_are_loaded_and_used(tmp_path: Path) -> None:
    """The per-head q/k norms are real weights: a Qwen3 checkpoint without them is
    refused, naming them."""
    config, cls = FAMILIES["qwen3"]
    torch.manual_seed(0)
    model = cls(config)
    state = {k: v for k, v in model.state_dict().items() if "q_norm" not in k}
    model.save_pretrained(tmp_path, state_dict=state)
    with pytest.raises(ValueError, match="q_norm"):
        LLM(str(tmp_path), device="cpu", dtype=torch.float32)


def test_an_unsupported_architecture_is_refused_by_name(tmp_path: Path) -> None:
    config, cls = FAMILIES["mistral"]
    cls(config).save_pretrained(tmp_path)
    hf = json.loads((tmp_path / "config.json").read_text())
    hf["architectures"] = ["GPTNeoXForCausalLM"]
    (tmp_path / "config.json").write_text(json.dumps(hf))
    with pytest.raises(ValueError, match="GPTNeoXForCausalLM.*supported: .*Qwen3ForCausalLM"):
        LLM(str(tmp_path), device="cpu", dtype=torch.float32)
    assert {"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
            "MixtralForCausalLM", "Qwen3MoeForCausalLM"} <= set(MODELS)


@pytest.mark.parametrize("name", sorted(NAMED_SHAPES))
def test_named_shapes_round_trip_through_config_json(name: str) -> None:
    """Every named shape (`--load-format dummy`), MoE ones included, is the config.json
    it writes, read back: benchmarks build transformers' model of the same shape from it."""
    shape = NAMED_SHAPES[name]
    assert ModelConfig.from_hf(shape.to_hf(), name=name) == shape
    assert shape.architecture in MODELS



def gemma_on_triton(name: str, path: str) -> None:
    """Under TRITON_INTERPRET=1: the Triton attention kernels' sliding window and
    soft-capping give transformers' greedy tokens, prompts past the window, one batch."""
    config, cls = FAMILIES[name]
    torch.manual_seed(4321)
    model = cls(config).eval()
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.15)
            elif pname.endswith("norm.weight"):
                p.normal_(1.0, 0.3)
    model.save_pretrained(path)
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 256) for _ in range(n)] for n in (20, 37)]
    want = [hf_greedy(model, p, 8) for p in prompts]
    llm = LLM(path, device="cpu", dtype=torch.float32, attention_backend="triton")
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    assert [o.token_ids for o in llm.generate(prompts, params)] == want


@pytest.mark.skipif(not HAS_TRITON, reason="needs Triton")
@pytest.mark.parametrize("name", ["gemma2", "gemma3"])
def test_gemma_on_the_triton_kernels_under_the_interpreter(name: str, tmp_path: Path) -> None:
    run_under_interpreter(f"from test_model_families import gemma_on_triton; "
                          f"gemma_on_triton({name!r}, {str(tmp_path)!r})", timeout=600)
