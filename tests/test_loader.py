from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

import tandem
from tandem.engine.config import NAMED_SHAPES
from tandem.engine.gguf import hf_name, unpermute_rope
from tandem.engine.loader import (
    ModelSource,
    default_cache_dir,
    expected_weight_names,
    hf_model_dir,
    load_model_config,
    load_tokenizer,
    load_weights,
    resolve_model,
)


@pytest.fixture(scope="module")
def smollm2_weights(smollm2_source: ModelSource) -> dict[str, torch.Tensor]:
    return load_weights(smollm2_source, torch.float32)


def _llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    # Verbatim from llama.cpp convert_hf_to_gguf.py `LlamaModel.permute`.
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


@pytest.mark.parametrize("shape, n_head", [((576, 576), 9), ((192, 576), 3), ((128,), 2)])
def test_unpermute_rope_inverts_llama_cpp_permute(shape: tuple[int, ...], n_head: int) -> None:
    w = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    assert np.array_equal(unpermute_rope(_llama_cpp_permute(w, n_head), n_head), w)
    assert not np.array_equal(_llama_cpp_permute(w, n_head), w)


def test_hf_names() -> None:
    assert hf_name("token_embd.weight") == "model.embed_tokens.weight"
    assert hf_name("blk.12.attn_k.bias") == "model.layers.12.self_attn.k_proj.bias"
    assert hf_name("blk.0.ffn_norm.weight") == "model.layers.0.post_attention_layernorm.weight"
    assert hf_name("output.weight") == "lm_head.weight"
    assert hf_name("output_norm.weight") == "model.norm.weight"
    with pytest.raises(ValueError, match="rope_freqs"):
        hf_name("rope_freqs.weight")


def test_resolve_registry_name_case_insensitive(smollm2_source: ModelSource) -> None:
    assert smollm2_source.kind == "gguf"
    assert smollm2_source.name == "smollm2-135m-instruct"
    assert smollm2_source.path is not None
    assert smollm2_source.path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert resolve_model("SmolLM2-135M-Instruct") == smollm2_source
    assert resolve_model(str(smollm2_source.path)).kind == "gguf"


def test_resolve_errors(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown load_format 'safetensors'"):
        resolve_model("tiny", load_format="safetensors")
    with pytest.raises(ValueError, match=r"'no-such-model'.*smollm2-135m-instruct"):
        resolve_model("no-such-model")
    with pytest.raises(ValueError, match="missing.gguf"):
        resolve_model(str(tmp_path / "missing.gguf"))
    with pytest.raises(ValueError, match="config.json"):
        resolve_model(str(tmp_path))  # a directory without config.json
    with pytest.raises(ValueError, match=r"named shape.*llama-3-8b"):
        resolve_model("smollm2-135m-instruct", load_format="dummy")
    with pytest.raises(ValueError, match="cannot resolve"):
        resolve_model("smollm2-135m-instruct", load_format="hf")


def test_dummy_source() -> None:
    src = resolve_model("Tiny", load_format="dummy")
    assert src == ModelSource("dummy", None, "tiny")
    assert load_model_config(src) == NAMED_SHAPES["tiny"]
    assert load_tokenizer(src) is None
    with pytest.raises(ValueError, match="dummy"):
        load_weights(src, torch.float32)


def test_gguf_config(smollm2_source: ModelSource) -> None:
    cfg = load_model_config(smollm2_source)
    shape = NAMED_SHAPES["smollm2-135m"]
    # The GGUF metadata gives the same architecture as the named shape, plus the token ids
    # and llama.cpp's float32 epsilon.
    assert cfg.name == "smollm2-135m-instruct"
    assert (cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size, cfg.num_layers) == (
        shape.vocab_size,
        shape.hidden_size,
        shape.intermediate_size,
        shape.num_layers,
    )
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (9, 3, 64)
    assert cfg.max_position_embeddings == 8192
    assert cfg.rope_theta == 100000.0
    assert cfg.rms_norm_eps == float(np.float32(1e-5))
    assert cfg.tie_word_embeddings and not cfg.qkv_bias
    assert (cfg.bos_token_id, cfg.eos_token_ids) == (1, (2,))


def test_weight_names_and_shapes(smollm2_source: ModelSource, smollm2_weights) -> None:
    cfg = load_model_config(smollm2_source)
    assert sorted(smollm2_weights) == sorted(expected_weight_names(cfg))
    assert "lm_head.weight" not in smollm2_weights  # tied
    assert smollm2_weights["model.embed_tokens.weight"].shape == (49152, 576)
    assert smollm2_weights["model.layers.0.self_attn.q_proj.weight"].shape == (576, 576)
    assert smollm2_weights["model.layers.0.self_attn.k_proj.weight"].shape == (192, 576)
    assert smollm2_weights["model.layers.29.mlp.down_proj.weight"].shape == (576, 1536)
    assert all(t.dtype == torch.float32 for t in smollm2_weights.values())


@pytest.mark.slow
def test_gguf_weights_equal_transformers(smollm2_path: Path, smollm2_weights) -> None:
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(
        smollm2_path.parent, gguf_file=smollm2_path.name, dtype=torch.float32
    ).state_dict()
    # transformers' state dict also lists the tied lm_head.
    assert torch.equal(ref.pop("lm_head.weight"), smollm2_weights["model.embed_tokens.weight"])
    assert sorted(ref) == sorted(smollm2_weights)
    mismatched = [k for k, v in ref.items() if not torch.equal(v, smollm2_weights[k])]
    assert mismatched == []


def test_cached_conversion_is_an_hf_directory(smollm2_source: ModelSource, smollm2_weights):
    hf_dir = hf_model_dir(smollm2_source)
    assert hf_dir.parent == default_cache_dir() / "gguf"
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {
        p.name for p in hf_dir.iterdir()
    }
    # Loaded as a plain HF directory, the cache gives the same model.
    src = resolve_model(str(hf_dir))
    assert src == ModelSource("hf", hf_dir, hf_dir.name)
    assert load_model_config(src) == replace(load_model_config(smollm2_source), name=hf_dir.name)
    weights = load_weights(src, torch.bfloat16)
    assert sorted(weights) == sorted(smollm2_weights)
    for name, w in weights.items():
        assert w.dtype == torch.bfloat16
        assert torch.equal(w, smollm2_weights[name].to(torch.bfloat16))
    tok = load_tokenizer(src)
    assert tok is not None and tok.eos_token_ids == (2,)


def test_hf_directory_unprefixed_names_and_strictness(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    cfg = NAMED_SHAPES["tiny"]
    (tmp_path / "config.json").write_text(json.dumps(cfg.to_hf()))
    names = expected_weight_names(cfg)
    tensors = {n.removeprefix("model."): torch.full((2,), float(i)) for i, n in enumerate(names)}
    tensors["layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(2)  # ignored
    save_file(tensors, str(tmp_path / "model.safetensors"))
    weights = load_weights(resolve_model(str(tmp_path)), torch.float16)
    assert sorted(weights) == sorted(names)
    assert [weights[n][0].item() for n in names] == list(range(len(names)))
    assert all(w.dtype == torch.float16 for w in weights.values())

    tensors["layers.0.mlp.experts.0.weight"] = torch.ones(2)
    del tensors["norm.weight"]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"missing \['model.norm.weight'\].*experts"):
        load_weights(resolve_model(str(tmp_path)), torch.float16)


def test_failed_conversion_leaves_no_cache(tmp_path: Path) -> None:
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + b"\x00" * 64)
    src = resolve_model(str(bad))
    assert src == ModelSource("gguf", bad.resolve(), "broken")
    cache = tmp_path / "cache"
    with pytest.raises(ValueError, match="version"):
        load_model_config(src, cache)
    assert list((cache / "gguf").iterdir()) == []


def test_hf_directory_sharded_with_index(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    cfg = NAMED_SHAPES["tiny"]
    (tmp_path / "config.json").write_text(json.dumps(cfg.to_hf()))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 9]}))
    names = expected_weight_names(cfg)
    shards = {
        "model-00001-of-00002.safetensors": names[:5],
        "model-00002-of-00002.safetensors": names[5:],
    }
    for file, part in shards.items():
        save_file({n: torch.zeros(3) for n in part}, str(tmp_path / file))
    weight_map = {n: file for file, part in shards.items() for n in part}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    # Mistral-style repos also ship this; transformers (and we) ignore it.
    save_file({"tok_embeddings.weight": torch.zeros(3)}, str(tmp_path / "consolidated.safetensors"))
    src = resolve_model(str(tmp_path))
    assert sorted(load_weights(src, torch.float32)) == sorted(names)
    assert load_tokenizer(src) is None  # no tokenizer files: token-id prompts only
    assert load_model_config(src).eos_token_ids == (7, 9)  # generation_config's eos count too


def test_a_process_started_from_the_checkouts_root_sees_no_subpackage_as_top_level() -> None:
    """`python -m tandem...` from the checkout's root puts it on the path, where `kernels`
    (ours) would shadow Hugging Face's, which transformers imports; importing tandem takes
    the root off the path again."""
    root = Path(tandem.__file__).resolve().parent
    probe = ("import importlib.util, tandem; spec = importlib.util.find_spec('kernels'); "
             "print(spec.origin if spec else '')")
    out = subprocess.run([sys.executable, "-c", probe], cwd=root, capture_output=True,
                         text=True, timeout=60, check=True).stdout.strip()
    assert not out or Path(out).resolve() != root / "kernels" / "__init__.py", out
