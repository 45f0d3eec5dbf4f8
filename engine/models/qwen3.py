"""Qwen3 (dense): Llama's decoder with an RMSNorm over each head of q and of k, before
RoPE (`q_norm`, `k_norm`, one weight of head_dim each), no bias on q, k and v, and a
head_dim of its own (not hidden_size / heads)."""

from __future__ import annotations

from typing import Any

import torch

from tandem.engine.attention import AttentionBackend
from tandem.engine.config import ModelConfig
from tandem.engine.models.llama import Attention, LlamaForCausalLM, RMSNorm
from tandem.engine.ops import Ops


class Qwen3Attention(Attention):
    def __init__(self, config: ModelConfig, attention: AttentionBackend, ops: Ops) -> None:
        super().__init__(config, attention, ops)
        self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps, ops)
        self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps, ops)

    def forward(
        self,
        x: torch.Tensor,  # [T, D]
        positions: torch.Tensor,  # [T]
        cos_sin: torch.Tensor,  # [P, hd] fp32
        kv_cache: torch.Tensor,
        state: Any,
    ) -> torch.Tensor:
        t, hd = x.shape[0], self.head_dim
        qkv = self.ops.linear(x, self.qkv_proj)
        q, k, v = qkv.split([self.num_heads * hd, self.num_kv_heads * hd,
                             self.num_kv_heads * hd], dim=-1)
        # Each head's row normalised on its own: [T * H, hd] rows.
        q = self.q_norm(q.reshape(-1, hd)).view(t, -1, hd)
        k = self.k_norm(k.reshape(-1, hd)).view(t, -1, hd)
        v = v.view(t, -1, hd)
        self.ops.apply_rope_(q, k, positions, cos_sin)
        o = self.attention.forward(q, k, v, kv_cache, state, self.scale)
        return self.ops.linear(o.reshape(t, -1), self.o_proj)


class Qwen3ForCausalLM(LlamaForCausalLM):
    attention_class = Qwen3Attention

    @classmethod
    def weight_names(cls, cfg: ModelConfig) -> list[str]:
        names = super().weight_names(cfg)
        for i in range(cfg.num_layers):
            names += [f"model.layers.{i}.self_attn.{n}_norm.weight" for n in "qk"]
        return names
