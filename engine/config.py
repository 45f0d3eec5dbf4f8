"""Frozen configuration handed down from the boundary (CLI / offline API) to each part."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import torch


@dataclass(frozen=True)
class RopeScaling:
    """Llama-3 style frequency-dependent rope scaling ("rope_type": "llama3")."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


# config.json's model_type -> its architecture, for configs that name none.
_ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                  "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                  "mixtral": "MixtralForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
                  "gemma2": "Gemma2ForCausalLM", "gemma3_text": "Gemma3ForCausalLM"}


@dataclass(frozen=True)
class ModelConfig:
    """Architecture of a decoder: `architecture` names its family (engine/models), the
    rest its shape. Qwen2 is Llama with `qkv_bias=True`."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    name: str = "llama"
    architecture: str = "LlamaForCausalLM"  # config.json's `architectures[0]`
    # Mixture of experts; 0 experts: every layer is dense.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0  # each expert's
    norm_topk_prob: bool = True  # renormalise the top-k routing weights to sum to 1
    decoder_sparse_step: int = 1  # every n-th layer has experts (Qwen3-MoE)
    mlp_only_layers: tuple[int, ...] = ()  # layers that stay dense (Qwen3-MoE)
    # Layers that see only the last `sliding_window` keys: every other one of Gemma's,
    # every one of Mistral v0.1's (where every layer slides, the blocks behind the window
    # are given back: KVCacheManager.release_behind).
    sliding_window: int = 0
    sliding_layers: tuple[int, ...] = ()
    # Gemma: soft-capping, its own attention scale and RoPE bases.
    attn_softcap: float = 0.0  # 0: none
    final_softcap: float = 0.0
    query_pre_attn_scalar: float = 0.0  # the attention scale is its -1/2 power; 0: head_dim's
    local_rope_theta: float = 0.0  # the sliding layers' RoPE base; 0: rope_theta
    rope_linear_factor: float = 0.0  # positions divided by it (linear RoPE scaling); 0: none
    # The checkpoint's own quantization (`quantization_config.quant_method`): "fp8" or "".
    quantization: str = ""
    fp8_block: tuple[int, int] | None = None  # an FP8 checkpoint's weight_block_size

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of "
                f"num_kv_heads ({self.num_kv_heads})"
            )

    def has_experts(self, layer: int) -> bool:
        return (self.num_experts > 0 and layer not in self.mlp_only_layers
                and (layer + 1) % self.decoder_sparse_step == 0)

    @classmethod
    def from_hf(cls, hf: dict[str, Any], name: str = "llama") -> ModelConfig:
        """Build from a Hugging Face `config.json` dict (Llama, Mistral, Qwen2, Qwen3)."""
        num_heads = hf["num_attention_heads"]
        rope = hf.get("rope_scaling") or hf.get("rope_parameters") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        scaling = None
        if rope_type == "llama3":
            scaling = RopeScaling(
                factor=float(rope["factor"]),
                low_freq_factor=float(rope["low_freq_factor"]),
                high_freq_factor=float(rope["high_freq_factor"]),
                original_max_position_embeddings=int(rope["original_max_position_embeddings"]),
            )
        elif rope_type not in ("default", None):
            raise ValueError(f"unsupported rope scaling type {rope_type!r}")
        theta = hf.get("rope_theta", rope.get("rope_theta", 10000.0))
        eos = hf.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        model_type = hf.get("model_type", "llama")
        architecture = (hf.get("architectures") or [_ARCHITECTURES.get(model_type, model_type)])[0]
        if model_type != "qwen2" and hf.get("attention_bias"):
            raise ValueError("attention_bias (a bias on o_proj too) is not supported")
        max_positions = hf.get("max_position_embeddings", 4096)
        gemma = model_type in ("gemma2", "gemma3_text")
        window, sliding = _sliding(hf, model_type) if not gemma else (0, ())
        experts = hf.get("num_local_experts") or hf.get("num_experts") or 0
        quant = hf.get("quantization_config") or {}
        method = quant.get("quant_method", "")
        if method not in ("", "fp8"):
            raise ValueError(f"checkpoint quantization {method!r} is not supported; "
                             "supported: fp8 (quant_method 'fp8')")
        block = quant.get("weight_block_size")
        config = cls(
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=hf.get("num_key_value_heads") or num_heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // num_heads,
            max_position_embeddings=max_positions,
            rms_norm_eps=hf.get("rms_norm_eps", 1e-5),
            rope_theta=float(theta),
            rope_scaling=scaling,
            tie_word_embeddings=hf.get("tie_word_embeddings", False),
            qkv_bias=model_type == "qwen2",
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=eos_ids,
            name=name,
            architecture=architecture,
            num_experts=experts,
            num_experts_per_tok=hf.get("num_experts_per_tok", 0) if experts else 0,
            # Mixtral's experts are intermediate_size wide and always renormalised.
            moe_intermediate_size=(hf.get("moe_intermediate_size") or hf["intermediate_size"]
                                   if experts else 0),
            norm_topk_prob=hf.get("norm_topk_prob", model_type == "mixtral") if experts else True,
            decoder_sparse_step=hf.get("decoder_sparse_step") or 1,
            mlp_only_layers=tuple(hf.get("mlp_only_layers") or ()),
            quantization=method,
            fp8_block=(int(block[0]), int(block[1])) if block else None,
            sliding_window=window,
            sliding_layers=sliding,
        )
        return _gemma(config, hf, model_type) if gemma else config

    def to_hf(self) -> dict[str, Any]:
        """The inverse of `from_hf`: a `config.json` dict transformers' LlamaForCausalLM reads."""
        # Qwen2 is Llama with a bias on q, k and v.
        arch = ("Qwen2ForCausalLM" if self.qkv_bias and self.architecture == "LlamaForCausalLM"
                else self.architecture)
        hf: dict[str, Any] = {
            "architectures": [arch],
            "model_type": {a: t for t, a in _ARCHITECTURES.items()}.get(arch, "llama"),
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "tie_word_embeddings": self.tie_word_embeddings,
            "hidden_act": "silu",
        }
        if self.num_experts and arch == "MixtralForCausalLM":
            hf.update(num_local_experts=self.num_experts,
                      intermediate_size=self.moe_intermediate_size,
                      num_experts_per_tok=self.num_experts_per_tok)
        elif self.num_experts:
            hf.update(num_experts=self.num_experts, num_experts_per_tok=self.num_experts_per_tok,
                      moe_intermediate_size=self.moe_intermediate_size,
                      norm_topk_prob=self.norm_topk_prob,
                      decoder_sparse_step=self.decoder_sparse_step,
                      mlp_only_layers=list(self.mlp_only_layers))
        if self.sliding_window and arch not in ("Gemma2ForCausalLM", "Gemma3ForCausalLM"):
            hf.update(sliding_window=self.sliding_window, use_sliding_window=True,
                      layer_types=["sliding_attention" if i in self.sliding_layers else
                                   "full_attention" for i in range(self.num_layers)])
        if arch in ("Gemma2ForCausalLM", "Gemma3ForCausalLM"):
            full: dict[str, Any] = {"rope_type": "default", "rope_theta": self.rope_theta}
            if self.rope_linear_factor:
                full = {**full, "rope_type": "linear", "factor": self.rope_linear_factor}
            hf.update(
                hidden_activation="gelu_pytorch_tanh", sliding_window=self.sliding_window,
                layer_types=["sliding_attention" if i in self.sliding_layers else
                             "full_attention" for i in range(self.num_layers)],
                query_pre_attn_scalar=_number(self.query_pre_attn_scalar) or None,
                attn_logit_softcapping=self.attn_softcap or None,
                final_logit_softcapping=self.final_softcap or None,
                rope_parameters=full if arch == "Gemma2ForCausalLM" else {
                    "full_attention": full,
                    "sliding_attention": {"rope_type": "default",
                                          "rope_theta": self.local_rope_theta or self.rope_theta}})
        if self.rope_scaling is not None:
            hf["rope_scaling"] = {"rope_type": "llama3", **self.rope_scaling.__dict__}
        if self.bos_token_id is not None:
            hf["bos_token_id"] = self.bos_token_id
        if self.eos_token_ids:
            hf["eos_token_id"] = list(self.eos_token_ids)
        return hf



def _number(x: float) -> float | int:
    """An integral float as an int (transformers' configs check the type)."""
    return int(x) if float(x).is_integer() else x


def _sliding(hf: dict[str, Any], model_type: str) -> tuple[int, tuple[int, ...]]:
    """(window, the layers that see only the last `window` keys) of a Llama-family
    config.json: `layer_types` where it is written, else every layer (Mistral v0.1,
    Mixtral), or Qwen2's from `max_window_layers` on; (0, ()) without a window."""
    window = hf.get("sliding_window")
    if not window or not hf.get("use_sliding_window", True):
        return 0, ()
    n = hf["num_hidden_layers"]
    first = hf.get("max_window_layers", 0) if model_type == "qwen2" else 0
    types = hf.get("layer_types") or ["sliding_attention" if i >= first else "full_attention"
                                      for i in range(n)]
    return int(window), tuple(i for i, t in enumerate(types) if t == "sliding_attention")


def _gemma(config: ModelConfig, hf: dict[str, Any], model_type: str) -> ModelConfig:
    """Gemma 2 / Gemma 3 text's fields of `config.json` (either transformers' current
    `rope_parameters` per layer type or the older rope_theta / rope_local_base_freq)."""
    n = config.num_layers
    pattern = 2 if model_type == "gemma2" else hf.get("sliding_window_pattern", 6)
    types = hf.get("layer_types") or ["sliding_attention" if (i + 1) % pattern else
                                      "full_attention" for i in range(n)]
    window = int(hf.get("sliding_window") or 0)
    fields: dict[str, Any] = {
        "sliding_window": window,
        "sliding_layers": tuple(i for i, t in enumerate(types)
                                if t == "sliding_attention") if window else (),
        "attn_softcap": float(hf.get("attn_logit_softcapping") or 0.0),
        "final_softcap": float(hf.get("final_logit_softcapping") or 0.0),
        "query_pre_attn_scalar": float(hf.get("query_pre_attn_scalar") or 0.0),
        "rope_scaling": None,
    }
    params = hf.get("rope_parameters") or {}
    full = params.get("full_attention") or params or {
        "rope_theta": hf.get("rope_theta", 10000.0), **(hf.get("rope_scaling") or {})}
    fields["rope_theta"] = float(full.get("rope_theta", hf.get("rope_theta", 10000.0)))
    kind = full.get("rope_type", full.get("type", "default"))
    if kind == "linear":
        fields["rope_linear_factor"] = float(full["factor"])
    elif kind not in ("default", None):
        raise ValueError(f"unsupported rope scaling type {kind!r}")
    if model_type == "gemma3_text":
        local = params.get("sliding_attention") or {
            "rope_theta": hf.get("rope_local_base_freq", 10000.0)}
        fields["local_rope_theta"] = float(local["rope_theta"])
    return replace(config, **fields)

# Shapes for `load_format="dummy"` (random weights), like vLLM's `--load-format dummy`.
NAMED_SHAPES: dict[str, ModelConfig] = {
    "llama-3-8b": ModelConfig(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32,
        num_heads=32, num_kv_heads=8, head_dim=128, max_position_embeddings=8192,
        rope_theta=500000.0, eos_token_ids=(128001, 128009), name="llama-3-8b",
    ),
    "llama-3.2-1b": ModelConfig(
        vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_layers=16,
        num_heads=32, num_kv_heads=8, head_dim=64, max_position_embeddings=131072,
        rope_theta=500000.0, tie_word_embeddings=True, eos_token_ids=(128001,),
        rope_scaling=RopeScaling(32.0, 1.0, 4.0, 8192), name="llama-3.2-1b",
    ),
    "smollm2-135m": ModelConfig(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
        num_heads=9, num_kv_heads=3, head_dim=64, max_position_embeddings=8192,
        rope_theta=100000.0, tie_word_embeddings=True, eos_token_ids=(2,),
        name="smollm2-135m",
    ),
    "tiny": ModelConfig(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2,
        num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=2048,
        eos_token_ids=(), name="tiny",
    ),
    "qwen3-8b": ModelConfig(
        vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_layers=36,
        num_heads=32, num_kv_heads=8, head_dim=128, max_position_embeddings=40960,
        rms_norm_eps=1e-6, rope_theta=1000000.0, eos_token_ids=(151645,),
        name="qwen3-8b", architecture="Qwen3ForCausalLM",
    ),
    "qwen3-30b-a3b": ModelConfig(
        vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_layers=48,
        num_heads=32, num_kv_heads=4, head_dim=128, max_position_embeddings=40960,
        rms_norm_eps=1e-6, rope_theta=1000000.0, eos_token_ids=(151645,),
        name="qwen3-30b-a3b", architecture="Qwen3MoeForCausalLM", num_experts=128,
        num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=True,
    ),
    "mixtral-8x7b": ModelConfig(
        vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_layers=32,
        num_heads=32, num_kv_heads=8, head_dim=128, max_position_embeddings=32768,
        rope_theta=1000000.0, eos_token_ids=(2,), name="mixtral-8x7b",
        architecture="MixtralForCausalLM", num_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=14336, norm_topk_prob=True,
    ),
    "gemma-3-12b": ModelConfig(
        vocab_size=262208, hidden_size=3840, intermediate_size=15360, num_layers=48,
        num_heads=16, num_kv_heads=8, head_dim=256, max_position_embeddings=131072,
        rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=True,
        eos_token_ids=(1, 106), name="gemma-3-12b", architecture="Gemma3ForCausalLM",
        sliding_window=1024, sliding_layers=tuple(i for i in range(48) if (i + 1) % 6),
        query_pre_attn_scalar=256.0, local_rope_theta=10000.0, rope_linear_factor=8.0,
    ),
}

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; choose one of {sorted(DTYPES)}")
    return DTYPES[name]


# kv_cache_dtype -> the cache's dtype; None: the model's.
KV_CACHE_DTYPES: dict[str, torch.dtype | None] = {
    "auto": None,
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
}


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    # Number of KV blocks. None: size from `kv_cache_memory_fraction` (cuda) or
    # `kv_cache_bytes` (cpu).
    num_blocks: int | None = None
    kv_cache_bytes: int = 1 << 30
    kv_cache_memory_fraction: float = 0.85
    enable_prefix_caching: bool = True
    # Host memory for blocks evicted from the device cache (engine/host_tier.py); 0: none.
    host_kv_bytes: int = 0
    # "auto": the model's dtype; "fp8" (or "fp8_e4m3"): float8_e4m3fn, with a per-layer
    # scale for K and one for V (the model's Attention.k_scale / v_scale): twice the
    # blocks of a 16-bit cache in the same bytes.
    kv_cache_dtype: str = "auto"

    def __post_init__(self) -> None:
        if self.host_kv_bytes < 0:
            raise ValueError(f"the host tier's size must be >= 0, got {self.host_kv_bytes}")
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {self.num_blocks}")
        if not 0 < self.kv_cache_memory_fraction <= 1:
            raise ValueError(
                f"the GPU memory fraction must be in (0, 1], got {self.kv_cache_memory_fraction}"
            )
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"unknown kv_cache_dtype {self.kv_cache_dtype!r}; "
                             f"choose one of {list(KV_CACHE_DTYPES)}")

    def kv_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        """The dtype the KV cache is stored in, for a model computing in `model_dtype`."""
        return KV_CACHE_DTYPES[self.kv_cache_dtype] or model_dtype


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    # Token budget per step; prompts longer than what is left are chunked.
    max_num_batched_tokens: int = 2048
    max_model_len: int = 4096

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}"
            )


QUANTIZATIONS = (None, "fp8")
CPU_WEIGHTS = ("auto", "fp32", "fp16", "bf16", "gguf")


@dataclass(frozen=True)
class EngineConfig:
    model: str
    load_format: str = "auto"  # auto | gguf | hf | dummy
    dtype: torch.dtype = torch.float32
    device: str = "cpu"
    seed: int = 0
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    # "torch" (the reference, any device) or "triton" (CUDA); None: triton on CUDA when
    # Triton is installed, else torch.
    attention_backend: str | None = None
    # No CUDA graphs: every step runs eagerly (debugging, or to save their memory).
    enforce_eager: bool = False
    # CUDA graphs for the steps of several sequences that are not decode-only too
    # (cuda_graphs.MixedGraphs). SmolLM2's shape on an H200, 256 prompts of 128 -> 256 at
    # once: the offline engine 94-98k output tok/s with them, 55-79k without.
    mixed_cuda_graphs: bool = True
    # Launch each step before reading the previous one's tokens, so host work overlaps
    # the GPU's; None: on for CUDA, off on the CPU (where nothing runs alongside).
    async_scheduling: bool | None = None
    # No tokenizer even if the model has one: prompts and outputs as token ids only.
    skip_tokenizer_init: bool = False
    # "fp8": the decoder layers' linear layers quantized to FP8 at load (engine/fp8.py);
    # None: as the checkpoint stores them (an FP8 checkpoint loads as FP8 either way).
    quantization: str | None = None
    # An fp32 model's decoder linear layers on the CPU: "fp32" as loaded (token-exact
    # against transformers), "fp16" packed for fbgemm with the logits, "bf16" packed for
    # oneDNN (engine/cpu_linear.py), "gguf" with the logits from a GGUF checkpoint's own
    # Q4_1/Q8_0 blocks (engine/cpu_quant.py), "auto" the fastest this CPU runs
    # (weights_mode).
    cpu_weights: str = "fp32"

    def __post_init__(self) -> None:
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"unknown quantization {self.quantization!r}; choose one of "
                             f"{[q for q in QUANTIZATIONS if q]}")
        if self.cpu_weights not in CPU_WEIGHTS:
            raise ValueError(f"unknown cpu_weights {self.cpu_weights!r}; choose one of "
                             f"{list(CPU_WEIGHTS)}")

    def with_scheduler(self, **changes: Any) -> EngineConfig:
        return replace(self, scheduler=replace(self.scheduler, **changes))
