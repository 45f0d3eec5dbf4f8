"""Qwen3 (dense): Llama's decoder with an RMSNorm over each head of q and of k, before
RoPE (`q_norm`, `k_norm`, one weight of head_dim each), no bias on q, k and v, and a
head_dim of its own (not hidden_size / heads)."""

from __future__ import annotations

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

    def norm_qk(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # Each head's row normalised on its own: [T * H, hd] rows.
        hd = self.head_dim
        return (self.q_norm(q.reshape(-1, hd)).view(q.shape),
                self.k_norm(k.reshape(-1, hd)).view(k.shape))


    def position_qk(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
                    cos_sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        fused = self.ops.qk_norm_rope_
        if fused is None:
            return super().position_qk(q, k, positions, cos_sin)
        # In place in the fused qkv: the two norms and the rotation in one kernel.
        fused(q, k, self.q_norm.weight, self.k_norm.weight, self.q_norm.eps, positions, cos_sin)
        return q, k


class Qwen3ForCausalLM(LlamaForCausalLM):
    attention_class = Qwen3Attention

    @classmethod
    def weight_names(cls, cfg: ModelConfig) -> list[str]:
        names = super().weight_names(cfg)
        for i in range(cfg.num_layers):
            names += [f"model.layers.{i}.self_attn.{n}_norm.weight" for n in "qk"]
        return names
