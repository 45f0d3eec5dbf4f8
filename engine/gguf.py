"""Read a llama.cpp GGUF file: `ModelConfig` from its metadata, HF-named fp32 weights, and
the blocks of its Q4_1 and Q8_0 matrices as stored (for `--cpu-weights gguf`)."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGUFReader
from gguf.quants import dequantize
from safetensors.torch import save_file
from tqdm import tqdm

from tandem.engine.config import ModelConfig

# llama.cpp tensor name (inside `blk.N.`) -> Hugging Face Llama name (inside `model.layers.N.`).
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_BLOCK_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
# The formats engine/cpu_quant.py multiplies from as stored; a converted GGUF keeps its
# matrices of these types in BLOCKS_FILE, beside the fp32 weights.
BLOCK_TYPES = ("Q4_1", "Q8_0")
BLOCKS_FILE = "gguf_blocks.safetensors"


def hf_name(gguf_name: str) -> str:
    """`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`."""
    if m := _BLOCK_RE.fullmatch(gguf_name):
        layer, part, kind = m.groups()
        if part in _BLOCK_NAMES:
            return f"model.layers.{layer}.{_BLOCK_NAMES[part]}.{kind}"
    else:
        stem, _, kind = gguf_name.rpartition(".")
        if stem in _TOP_NAMES:
            return f"{_TOP_NAMES[stem]}.{kind}"
    raise ValueError(f"GGUF tensor {gguf_name!r} has no Llama equivalent")


def unpermute_rope(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation (convert_hf_to_gguf.py `LlamaModel.permute`).

    HF stores each head's rotary dims as two halves [x0..x{d/2-1}, y0..y{d/2-1}] (rotate_half);
    llama.cpp wants them interleaved [x0, y0, x1, y1, ...]. The converter did
    `w.reshape(n_head, 2, d/2, ...).swapaxes(1, 2)`; the inverse reads rows as
    (n_head, d/2, 2) and swaps back. Works for weights [out, in] and biases [out].
    """
    half = w.shape[0] // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _field(reader: GGUFReader, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def gguf_model_config(reader: GGUFReader, name: str) -> ModelConfig:
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise ValueError(f"GGUF architecture {arch!r} is not supported (only 'llama')")
    names = {t.name for t in reader.tensors}
    if "rope_freqs.weight" in names:
        # Llama-3.1 style rope scaling is baked into a tensor; we only read it from config.json.
        raise ValueError("GGUF with rope_freqs (llama3 rope scaling) is not supported")

    def key(k: str, default: Any = None) -> Any:
        value = _field(reader, f"llama.{k}", default)
        if value is None:
            raise ValueError(f"GGUF metadata lacks llama.{k}")
        return value

    num_heads = int(key("attention.head_count"))
    hidden = int(key("embedding_length"))
    eos = [_field(reader, f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot")]
    bos = _field(reader, "tokenizer.ggml.bos_token_id")
    return ModelConfig(
        vocab_size=len(reader.fields["tokenizer.ggml.tokens"].data),
        hidden_size=hidden,
        intermediate_size=int(key("feed_forward_length")),
        num_layers=int(key("block_count")),
        num_heads=num_heads,
        num_kv_heads=int(key("attention.head_count_kv", num_heads)),
        head_dim=int(key("attention.key_length", hidden // num_heads)),
        max_position_embeddings=int(key("context_length")),
        rms_norm_eps=float(key("attention.layer_norm_rms_epsilon")),
        rope_theta=float(key("rope.freq_base", 10000.0)),
        tie_word_embeddings="output.weight" not in names,
        qkv_bias="blk.0.attn_q.bias" in names,
        bos_token_id=None if bos is None else int(bos),
        eos_token_ids=tuple(dict.fromkeys(int(e) for e in eos if e is not None)),
        name=name,
    )


def _hf_rows(w: np.ndarray, gguf_name: str, cfg: ModelConfig) -> np.ndarray:
    """A tensor's rows (weights or their blocks, [out, ...]) in Hugging Face's order."""
    if ".attn_q." in gguf_name:
        return unpermute_rope(w, cfg.num_heads)
    if ".attn_k." in gguf_name:
        return unpermute_rope(w, cfg.num_kv_heads)
    return w


def gguf_weights(reader: GGUFReader, cfg: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (HF name, fp32 tensor [out, in]) for every tensor, dequantised, with a progress bar."""
    for t in tqdm(reader.tensors, desc="Dequantising GGUF", unit="tensor"):
        w = dequantize(t.data, t.tensor_type)  # numpy, rows first: already HF's [out, in]
        w = _hf_rows(w, t.name, cfg)
        yield hf_name(t.name), torch.from_numpy(np.array(w, dtype=np.float32))


def gguf_blocks(reader: GGUFReader, cfg: ModelConfig
                ) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The blocks of the matrices whose type is in BLOCK_TYPES, as stored (uint8 [out, row
    bytes], a row's blocks in order along `in`; q/k rows in HF order, as `gguf_weights`
    puts the weights), and every matrix's type (ggml's name), by HF name."""
    blocks, types = {}, {}
    for t in reader.tensors:
        if len(t.shape) == 2:
            name = hf_name(t.name)
            types[name] = t.tensor_type.name
            if types[name] in BLOCK_TYPES:
                # a copy: t.data is the file's bytes, mapped read-only
                blocks[name] = torch.from_numpy(np.array(_hf_rows(t.data, t.name, cfg)))
    return blocks, types


def convert_gguf(path: Path, out_dir: Path, name: str) -> None:
    """Write `path` as a Hugging Face Llama directory: config.json, model.safetensors, tokenizer;
    and BLOCKS_FILE, its matrices' types (the metadata) and blocks (`gguf_blocks`)."""
    from transformers import AutoTokenizer

    reader = GGUFReader(path)
    cfg = gguf_model_config(reader, name)
    tensors = dict(gguf_weights(reader, cfg))
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    blocks, types = gguf_blocks(reader, cfg)
    save_file(blocks, str(out_dir / BLOCKS_FILE), metadata=types)
    (out_dir / "config.json").write_text(json.dumps(cfg.to_hf(), indent=2))
    # transformers rebuilds the tokenizer from the GGUF vocab (seconds); saved, it loads in ~0.1 s.
    tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    tok.save_pretrained(out_dir)
