"""Qwen3-MoE: Qwen3's attention (per-head q/k norms) with a sparse mixture of experts in
place of the MLP of every `decoder_sparse_step`-th layer not in `mlp_only_layers`
(`mlp.gate` routes to `num_experts` experts of `moe_intermediate_size`; each token's top
`num_experts_per_tok`, renormalised if `norm_topk_prob`)."""

from __future__ import annotations

import torch
from torch import nn

from tandem.engine.config import ModelConfig
from tandem.engine.models.llama import MLP
from tandem.engine.models.moe import SparseMoE, data_dependent, stack_experts
from tandem.engine.models.qwen3 import Qwen3ForCausalLM
from tandem.engine.ops import Ops


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    @classmethod
    def make_mlp(cls, config: ModelConfig, layer: int, ops: Ops) -> nn.Module:
        if not config.has_experts(layer):
            return MLP(config, ops)
        return SparseMoE(config.hidden_size, config.moe_intermediate_size, config.num_experts,
                         config.num_experts_per_tok, config.norm_topk_prob, ops)

    @property
    def data_dependent(self) -> bool:
        return data_dependent(self)

    @classmethod
    def weight_names(cls, cfg: ModelConfig) -> list[str]:
        moe_layers = [i for i in range(cfg.num_layers) if cfg.has_experts(i)]
        names = [n for n in super().weight_names(cfg)
                 if not any(n.startswith(f"model.layers.{i}.mlp.") for i in moe_layers)]
        for i in moe_layers:
            mlp = f"model.layers.{i}.mlp."
            names.append(mlp + "gate.weight")
            names += [f"{mlp}experts.{e}.{p}_proj.weight"
                      for e in range(cfg.num_experts) for p in ("gate", "up", "down")]
        return names

    def load_weights(self, weights: dict[str, torch.Tensor]) -> None:
        weights = dict(weights)
        for i in range(self.config.num_layers):
            if self.config.has_experts(i):
                mlp = f"model.layers.{i}.mlp."
                stack_experts(weights, mlp, self.config.num_experts,
                              mlp + "experts.{e}.gate_proj.weight",
                              mlp + "experts.{e}.up_proj.weight",
                              mlp + "experts.{e}.down_proj.weight")
        super().load_weights(weights)


