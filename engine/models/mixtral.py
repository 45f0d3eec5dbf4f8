"""Mixtral: Llama's decoder with a sparse mixture of experts in place of every MLP
(`block_sparse_moe`: a router and `num_local_experts` SwiGLU experts w1 (gate), w3 (up),
w2 (down); each token's top `num_experts_per_tok`, their weights renormalised)."""

from __future__ import annotations

import torch
from torch import nn

from tandem.engine.config import ModelConfig
from tandem.engine.models.llama import LlamaForCausalLM
from tandem.engine.models.moe import SparseMoE, data_dependent, stack_experts
from tandem.engine.ops import Ops


class MixtralForCausalLM(LlamaForCausalLM):
    @classmethod
    def make_mlp(cls, config: ModelConfig, layer: int, ops: Ops) -> nn.Module:
        return SparseMoE(config.hidden_size, config.moe_intermediate_size, config.num_experts,
                         config.num_experts_per_tok, renormalize=True, ops=ops)

    @property
    def data_dependent(self) -> bool:
        return data_dependent(self)

    @classmethod
    def weight_names(cls, cfg: ModelConfig) -> list[str]:
        names = [n for n in super().weight_names(cfg) if ".mlp." not in n]
        for i in range(cfg.num_layers):
            moe = f"model.layers.{i}.block_sparse_moe."
            names.append(moe + "gate.weight")
            names += [f"{moe}experts.{e}.w{w}.weight"
                      for e in range(cfg.num_experts) for w in (1, 2, 3)]
        return names

    def load_weights(self, weights: dict[str, torch.Tensor]) -> None:
        weights = dict(weights)
        for i in range(self.config.num_layers):
            moe, mlp = f"model.layers.{i}.block_sparse_moe.", f"model.layers.{i}.mlp."
            if moe + "gate.weight" in weights:
                weights[mlp + "gate.weight"] = weights.pop(moe + "gate.weight")
            stack_experts(weights, mlp, self.config.num_experts, moe + "experts.{e}.w1.weight",
                          moe + "experts.{e}.w3.weight", moe + "experts.{e}.w2.weight")
        super().load_weights(weights)
