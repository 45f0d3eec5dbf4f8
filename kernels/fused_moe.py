"""Mixture of experts over stacked expert weights: `gate_up` [E, 2F, D] (each expert's
gate rows, then its up rows, as the dense MLP's fused GEMM) and `down` [E, D, F]. Each
token goes to the top-k experts of the router's softmax (renormalised over those k where
the family says so); their SwiGLU outputs, weighted, are summed.

`fused_moe_ref` is the torch reference: per expert, the tokens routed to it, in expert
order, as transformers computes it (so fp32 results match it exactly). It is
data-dependent (which experts are hit), so a CUDA graph cannot hold it: the engine runs
MoE models eagerly until the Triton grouped GEMM (tokens sorted by expert) lands.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, E] logits -> (weights [T, k] in the logits' dtype, expert ids [T, k]): the
    softmax in fp32, its top k, renormalised to sum to 1 if `renormalize`."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = probs.topk(top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(router_logits.dtype), ids


def fused_moe_ref(x: torch.Tensor,  # [T, D]
                  router_logits: torch.Tensor,  # [T, E]
                  gate_up: torch.Tensor,  # [E, 2F, D]
                  down: torch.Tensor,  # [E, D, F]
                  top_k: int, renormalize: bool) -> torch.Tensor:  # [T, D]
    weights, ids = route(router_logits, top_k, renormalize)
    out = torch.zeros_like(x)
    for expert in ids.unique().tolist():  # ascending, as transformers adds them
        tokens, slot = (ids == expert).nonzero(as_tuple=True)
        gate, up = F.linear(x[tokens], gate_up[expert]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, down[expert])
        out.index_add_(0, tokens, (y * weights[tokens, slot, None]).to(x.dtype))
    return out
