"""Gemma 2 and Gemma 3 (text): a decoder whose layers differ from Llama's in every part.

- RMSNorm scales by (1 + weight), in fp32; four per layer: before and after attention,
  before and after the MLP, each sub-block's output normed before it joins the residual.
- The embeddings are scaled by sqrt(hidden_size) (in the model's dtype).
- The MLP is GeGLU: gelu(gate, tanh approximation) * up.
- Attention scales by query_pre_attn_scalar ** -0.5; the `sliding_layers` see only the
  last `sliding_window` keys. Gemma 2 soft-caps the attention scores (50) and the logits
  (30); Gemma 3 norms each head of q and k (as Qwen3, Gemma's RMSNorm), and gives its
  sliding layers their own RoPE base (`local_rope_theta`) while the global ones may
  scale theirs linearly (`rope_linear_factor`).

The sliding window and the soft-capping are the attention backend's (the torch
reference has them; the Triton kernels do not yet, so these models run on the `torch`
backend).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tandem.engine.attention import AttentionBackend
from tandem.engine.config import ModelConfig
from tandem.engine.models.llama import MLP, Attention, LlamaForCausalLM, rope_cos_sin
from tandem.engine.ops import Ops


class GemmaRMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * (1.0 + self.weight.float())).to(x.dtype)


class GemmaAttention(Attention):
    def __init__(self, config: ModelConfig, attention: AttentionBackend, ops: Ops,
                 layer: int, qk_norm: bool) -> None:
        super().__init__(config, attention, ops)
        self.scale = (config.query_pre_attn_scalar or config.head_dim) ** -0.5
        self.window = config.sliding_window if layer in config.sliding_layers else None
        self.softcap = config.attn_softcap or None
        self.q_norm = GemmaRMSNorm(config.head_dim, config.rms_norm_eps) if qk_norm else None
        self.k_norm = GemmaRMSNorm(config.head_dim, config.rms_norm_eps) if qk_norm else None

    def norm_qk(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.q_norm is None:
            return q, k
        return self.q_norm(q), self.k_norm(k)  # over each head's last dim


class GemmaMLP(MLP):
    """GeGLU: gelu (its tanh approximation) of the gate, times up."""

    silu_gate = False

    def activation(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up


class GemmaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, attention: AttentionBackend, ops: Ops,
                 layer: int, qk_norm: bool) -> None:
        super().__init__()
        d, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(d, eps)
        self.self_attn = GemmaAttention(config, attention, ops, layer, qk_norm)
        self.post_attention_layernorm = GemmaRMSNorm(d, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(d, eps)
        self.mlp = GemmaMLP(config, ops)
        self.post_feedforward_layernorm = GemmaRMSNorm(d, eps)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor,
                kv_cache: torch.Tensor, state: Any) -> torch.Tensor:
        h = self.self_attn(self.input_layernorm(x), positions, cos_sin, kv_cache, state)
        x = x + self.post_attention_layernorm(h)
        h = self.mlp(self.pre_feedforward_layernorm(x))
        return x + self.post_feedforward_layernorm(h)


class GemmaBody(nn.Module):
    def __init__(self, config: ModelConfig, attention: AttentionBackend, ops: Ops,
                 qk_norm: bool) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(GemmaDecoderLayer(config, attention, ops, i, qk_norm)
                                    for i in range(config.num_layers))
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)


class Gemma2ForCausalLM(LlamaForCausalLM):
    qk_norm = False

    def __init__(self, config: ModelConfig, attention: AttentionBackend, ops: Ops) -> None:
        nn.Module.__init__(self)  # Llama's parts are not built: Gemma's replace them all
        self.config, self.ops = config, ops
        self.model = GemmaBody(config, attention, ops, self.qk_norm)
        self.cos_sin = rope_cos_sin(config)
        # Gemma 3's sliding layers turn at their own base, unscaled.
        self.local_cos_sin = (
            rope_cos_sin(replace(config, rope_theta=config.local_rope_theta,
                                 rope_linear_factor=0.0))
            if config.local_rope_theta else self.cos_sin)
        if not config.tie_word_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[torch.Tensor], state: Any,
                on_layer: Callable[[int], None] | None = None) -> torch.Tensor:
        x = self.model.embed_tokens(input_ids)
        x = x * torch.tensor(self.config.hidden_size**0.5, dtype=x.dtype)
        sliding = self.config.sliding_layers
        for i, (layer, kv_cache) in enumerate(zip(self.model.layers, kv_caches)):
            cos_sin = self.local_cos_sin if i in sliding else self.cos_sin
            x = layer(x, positions, cos_sin, kv_cache, state)
            if on_layer is not None:
                on_layer(i)
        return self.model.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden)
        cap = self.config.final_softcap
        return torch.tanh(logits / cap) * cap if cap else logits

    @classmethod
    def weight_names(cls, cfg: ModelConfig) -> list[str]:
        names = super().weight_names(cfg)
        for i in range(cfg.num_layers):
            p = f"model.layers.{i}."
            names += [p + "pre_feedforward_layernorm.weight",
                      p + "post_feedforward_layernorm.weight"]
            if cls.qk_norm:
                names += [f"{p}self_attn.{n}_norm.weight" for n in "qk"]
        return names

    @torch.no_grad()
    def init_dummy_weights(self, seed: int) -> None:
        super().init_dummy_weights(seed)
        for name, p in self.named_parameters():
            if name.endswith("norm.weight"):
                p.zero_()  # Gemma's norms scale by 1 + weight


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    qk_norm = True
