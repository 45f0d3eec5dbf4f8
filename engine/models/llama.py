"""Llama-family decoder over a paged KV cache (Llama 2/3, SmolLM2, Mistral; Qwen2 via
qkv bias). Parameter names match Hugging Face so checkpoints load as they are. A family
that differs in a part (Qwen3's attention) subclasses that part and names it in its model
class (`attention_class`)."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from tandem.engine import fp8
from tandem.engine.attention import AttentionBackend
from tandem.engine.config import ModelConfig, RopeScaling
from tandem.engine.fp8 import Fp8Linear
from tandem.engine.ops import TORCH_OPS, Ops
from tandem.kernels import rope


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, ops: Ops) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps, self.ops = eps, ops

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Normalise in fp32 whatever the model dtype, as the reference does; with a
        residual, add it first and return (normed, x + residual)."""
        return self.ops.rms_norm(x, self.weight, self.eps, residual)


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is None:
        return inv_freq
    # Llama 3: keep high frequencies, divide low ones by `factor`, blend in between.
    old_len = scaling.original_max_position_embeddings
    low_wavelen = old_len / scaling.low_freq_factor
    high_wavelen = old_len / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (old_len / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


def rope_cos_sin(config: ModelConfig) -> torch.Tensor:
    """[max_positions, head_dim] fp32: cos(p * inv_freq) then sin(p * inv_freq), the
    values the reference computes per step, computed once on the current device."""
    inv = rope_inv_freq(config.head_dim, config.rope_theta, config.rope_scaling)
    if config.rope_linear_factor:  # positions divided by the factor: so are the angles
        inv = inv / config.rope_linear_factor
    return rope.rope_cache(inv.to(torch.get_default_device()), config.max_position_embeddings)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, attention: AttentionBackend, ops: Ops) -> None:
        super().__init__()
        d, hd = config.hidden_size, config.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = (
            config.num_heads, config.num_kv_heads, hd,
        )
        # q, k and v in one GEMM; checkpoints' q_proj/k_proj/v_proj are concatenated at load.
        out = (config.num_heads + 2 * config.num_kv_heads) * hd
        self.qkv_proj = nn.Linear(d, out, bias=config.qkv_bias)
        self.o_proj = nn.Linear(config.num_heads * hd, d, bias=False)
        self.scale = hd**-0.5
        self.window: int | None = None  # keys fewer than this many back only (a family's)
        self.softcap: float | None = None  # scores through softcap * tanh(s / softcap)
        # An FP8 KV cache holds k / k_scale and v / v_scale (a loader may set them).
        self.k_scale, self.v_scale = 1.0, 1.0
        self.attention, self.ops = attention, ops

    def norm_qk(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q [T, Hq, hd] and k [T, Hkv, hd] before RoPE: as they are (a family with
        per-head norms overrides this)."""
        return q, k

    def position_qk(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
                    cos_sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q and k as attention reads them: `norm_qk`, then RoPE."""
        q, k = self.norm_qk(q, k)
        self.ops.apply_rope_(q, k, positions, cos_sin)
        return q, k

    def forward(
        self,
        x: torch.Tensor,  # [T, D]
        positions: torch.Tensor,  # [T]
        cos_sin: torch.Tensor,  # [P, hd] fp32
        kv_cache: torch.Tensor,
        state: Any,  # the attention backend's per-step state
    ) -> torch.Tensor:
        t, hd = x.shape[0], self.head_dim
        qkv = self.ops.linear(x, self.qkv_proj)  # [T, (Hq + 2 Hkv) * hd]
        # split_with_sizes, not Tensor.split, whose Python wrapper costs 1.7 us more (3.8
        # against 2.1) of the ~39 us of Python a CPU decode step spends on a layer.
        q, k, v = qkv.split_with_sizes([self.num_heads * hd, self.num_kv_heads * hd,
                                        self.num_kv_heads * hd], dim=-1)
        q, k = self.position_qk(q.view(t, -1, hd), k.view(t, -1, hd), positions, cos_sin)
        v = v.view(t, -1, hd)
        o = self.attention.forward(q, k, v, kv_cache, state, self.scale, self.window,
                                   self.softcap, self.k_scale, self.v_scale)  # [T, Hq, hd]
        return self.ops.linear(o.reshape(t, -1), self.o_proj)


class MLP(nn.Module):
    silu_gate = True  # activation is silu(gate) * up: an FP8 down_proj quantizes it in one

    def __init__(self, config: ModelConfig, ops: Ops) -> None:
        super().__init__()
        d, f = config.hidden_size, config.intermediate_size
        # gate and up in one GEMM; concatenated at load like qkv.
        self.gate_up_proj = nn.Linear(d, 2 * f, bias=False)
        self.down_proj = nn.Linear(f, d, bias=False)
        self.ops = ops

    def activation(self, gate_up: torch.Tensor) -> torch.Tensor:  # [T, 2F] -> [T, F]
        return self.ops.silu_mul(gate_up)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.ops.linear(x, self.gate_up_proj)
        if self.silu_gate and type(self.down_proj) is Fp8Linear:
            return self.down_proj.of_silu_mul(gate_up, self.ops.silu_mul)
        return self.ops.linear(self.activation(gate_up), self.down_proj)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, attention: AttentionBackend, ops: Ops,
                 attention_class: type[Attention], mlp: nn.Module) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops)
        self.self_attn = attention_class(config, attention, ops)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops)
        self.mlp = mlp

    def forward(self, x, residual, positions, cos_sin, kv_cache, state):  # noqa: ANN001, ANN201
        # The residual stream is carried beside x so each norm adds it in the same kernel:
        # returns (mlp output, residual), whose sum is the layer's output.
        if residual is None:
            x, residual = self.input_layernorm(x), x
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(x, positions, cos_sin, kv_cache, state)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class LlamaBody(nn.Module):
    def __init__(self, config: ModelConfig, attention: AttentionBackend, ops: Ops,
                 attention_class: type[Attention],
                 mlp_for: Callable[[int], nn.Module]) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(config, attention, ops, attention_class, mlp_for(i))
            for i in range(config.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops)


class LlamaForCausalLM(nn.Module):
    attention_class: type[Attention] = Attention
    # (FP8 [V, D], scales [V]): single rows' logits weight, set by fp8.quantize_logits
    logits_fp8: tuple[torch.Tensor, torch.Tensor] | None = None

    def __init__(
        self, config: ModelConfig, attention: AttentionBackend, ops: Ops = TORCH_OPS
    ) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaBody(config, attention, ops, self.attention_class,
                               lambda i: self.make_mlp(config, i, ops))
        self.ops = ops
        for i in config.sliding_layers:
            self.model.layers[i].self_attn.window = config.sliding_window
        # A plain attribute, not a buffer: `.to(dtype)` must leave it in fp32.
        self.cos_sin = rope_cos_sin(config)
        if not config.tie_word_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        kv_caches: list[torch.Tensor],  # per layer [2, num_blocks, block_size, Hkv, D]
        state: Any,  # the attention backend's per-step state
        on_layer: Callable[[int], None] | None = None,
    ) -> torch.Tensor:  # hidden states [T, D]
        """`on_layer(i)` runs once layer i's KV is written (enqueued, on CUDA): a KV push
        sends it while the later layers compute."""
        x, residual = self.model.embed_tokens(input_ids), None
        for i, (layer, kv_cache) in enumerate(zip(self.model.layers, kv_caches)):
            x, residual = layer(x, residual, positions, self.cos_sin, kv_cache, state)
            if on_layer is not None:
                on_layer(i)
        return self.model.norm(x, residual)[0]

    @property
    def logits_weight(self) -> torch.Tensor:  # [V, D]
        return (self.model.embed_tokens.weight if self.config.tie_word_embeddings
                else self.lm_head.weight)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, D] -> [N, V]
        if self.logits_fp8 is not None:
            out = fp8.logits(hidden, self.logits_fp8)
            if out is not None:
                return out
        return self.ops.logits(hidden, self.logits_weight)

    @classmethod
    def make_mlp(cls, config: ModelConfig, layer: int, ops: Ops) -> nn.Module:
        """Layer `layer`'s feed-forward block (a family with experts overrides this)."""
        return MLP(config, ops)

    @property
    def data_dependent(self) -> bool:
        """Whether a step's work depends on its values (a CUDA graph cannot hold it)."""
        return False

    @classmethod
    def weight_names(cls, cfg: ModelConfig) -> list[str]:
        """The Hugging Face tensor names a checkpoint of `cfg` holds."""
        names = ["model.embed_tokens.weight", "model.norm.weight"]
        if not cfg.tie_word_embeddings:
            names.append("lm_head.weight")
        for i in range(cfg.num_layers):
            p = f"model.layers.{i}."
            names += [p + "input_layernorm.weight", p + "post_attention_layernorm.weight"]
            names += [f"{p}self_attn.{x}_proj.weight" for x in "qkvo"]
            names += [f"{p}mlp.{x}_proj.weight" for x in ("gate", "up", "down")]
            if cfg.qkv_bias:
                names += [f"{p}self_attn.{x}_proj.bias" for x in "qkv"]
        return names

    def load_weights(self, weights: dict[str, torch.Tensor]) -> None:
        """Hugging Face names; q/k/v and gate/up are concatenated into the fused GEMMs."""
        weights = dict(weights)
        if self.config.tie_word_embeddings:
            weights.pop("lm_head.weight", None)
        for i, layer in enumerate(self.model.layers):
            attn, mlp = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
            for name in ("k_scale", "v_scale"):  # an FP8 checkpoint's, for an FP8 KV cache
                if attn + name in weights:
                    setattr(layer.self_attn, name, float(weights.pop(attn + name)))
            for suffix in ("weight", "bias", "weight_scale"):  # the scale: FP8's (fp8.py)
                _concat(weights, f"{attn}qkv_proj.{suffix}",
                        [f"{attn}{p}_proj.{suffix}" for p in "qkv"])
            for suffix in ("weight", "weight_scale"):
                _concat(weights, f"{mlp}gate_up_proj.{suffix}",
                        [f"{mlp}gate_proj.{suffix}", f"{mlp}up_proj.{suffix}"])
        missing, unexpected = self.load_state_dict(weights, strict=False)
        if missing or unexpected:
            raise ValueError(
                f"checkpoint does not fit {self.config.name}: missing {missing[:5]}, "
                f"unexpected {unexpected[:5]}"
            )

    @torch.no_grad()
    def init_dummy_weights(self, seed: int) -> None:
        """Random weights of the right shape (benchmarks), scaled to keep activations sane."""
        gen = torch.Generator(device=self.model.embed_tokens.weight.device).manual_seed(seed)
        for name, p in self.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                std = 0.02 if p.dim() < 2 else 1.0 / math.sqrt(p.shape[-1])
                p.normal_(0.0, std, generator=gen)


def _concat(weights: dict[str, torch.Tensor], fused: str, parts: list[str]) -> None:
    # A checkpoint missing a part keeps what it has: load_state_dict then names it.
    if all(p in weights for p in parts):
        weights[fused] = torch.cat([weights.pop(p) for p in parts])
