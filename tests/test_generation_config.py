"""A checkpoint directory's generation_config.json gives the sampling fields a request
leaves unset (temperature, top_p, top_k, min_p, repetition_penalty), as vLLM does: in the
router's requests, and in `LLM.generate` without params; a field the request sets wins."""

from __future__ import annotations

import json
import random
import urllib.request
from pathlib import Path

import pytest
import torch
from serving_helpers import tandem_up
from transformers import LlamaConfig, LlamaForCausalLM

from tandem import LLM, SamplingParams
from tandem.engine.loader import load_generation_defaults, resolve_model
from tandem.router.protocol import CompletionRequest

# top_k 1: sampling is greedy, so the tokens show which penalty applied.
GENERATION = {"repetition_penalty": 3.0, "top_k": 1, "do_sample": True, "max_new_tokens": 7}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:  # noqa: ANN001
    path = tmp_path_factory.mktemp("gen")
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=512, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(3)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.15)
    model.save_pretrained(path)
    gen = json.loads((path / "generation_config.json").read_text())
    (path / "generation_config.json").write_text(json.dumps({**gen, **GENERATION}))
    return path


def _prompt() -> list[int]:
    rng = random.Random(0)
    return [rng.randrange(3, 256) for _ in range(12)]


def test_only_the_sampling_fields_are_read(model_dir: Path) -> None:
    assert load_generation_defaults(resolve_model(str(model_dir), "auto")) == {
        "repetition_penalty": 3.0, "top_k": 1}


def test_a_field_the_request_sets_wins() -> None:
    body = CompletionRequest(model="m", prompt=[5, 6], temperature=0.0)
    params = body.sampling_params(None, 16, {"temperature": 0.7, "top_k": 20,
                                             "repetition_penalty": 1.3})
    assert (params.temperature, params.top_k, params.repetition_penalty) == (0.0, 20, 1.3)
    plain = body.sampling_params(None, 16)
    assert (plain.top_k, plain.repetition_penalty) == (SamplingParams().top_k, 1.0)


def test_llm_generate_without_params_uses_them(model_dir: Path) -> None:
    llm = LLM(str(model_dir), device="cpu", dtype=torch.float32)
    prompt = _prompt()
    default = llm.generate(prompt)[0].token_ids
    explicit = llm.generate(prompt, SamplingParams(top_k=1, repetition_penalty=3.0))[0]
    unpenalised = llm.generate(prompt, SamplingParams(top_k=1))[0]
    assert default == explicit.token_ids
    assert default != unpenalised.token_ids  # so the penalty did come from the file


def test_the_router_fills_unset_fields_from_them(model_dir: Path) -> None:
    prompt = _prompt()
    with tandem_up(["--model", str(model_dir), "--skip-tokenizer-init",
                    "--num-kv-blocks", "64"]) as (url, _, _):
        def complete(**fields: float) -> list[int]:
            body = {"model": str(model_dir), "prompt": prompt, "max_tokens": 16, **fields}
            request = urllib.request.Request(f"{url}/v1/completions", json.dumps(body).encode(),
                                             {"Content-Type": "application/json"})
            with urllib.request.urlopen(request, timeout=120) as response:
                return json.loads(response.read())["choices"][0]["token_ids"]

        unset = complete()
        assert unset == complete(top_k=1, repetition_penalty=3.0)
        assert unset != complete(top_k=1, repetition_penalty=1.0)
