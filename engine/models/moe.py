"""A sparse mixture-of-experts block in place of the dense MLP (Mixtral, Qwen3-MoE): a
router (`gate`, no bias) and every expert's SwiGLU weights stacked, [E, 2F, D] and
[E, D, F], as the fused kernel reads them. Checkpoints store one tensor per expert and
projection; each family's `load_weights` stacks them (`stack_experts`)."""

from __future__ import annotations

import torch
from torch import nn

from tandem.engine.ops import Ops
from tandem.kernels.fused_moe import fused_moe, fused_moe_ref, triton


class SparseMoE(nn.Module):
    def __init__(self, hidden: int, expert_size: int, num_experts: int, top_k: int,
                 renormalize: bool, ops: Ops) -> None:
        super().__init__()
        self.gate = nn.Linear(hidden, num_experts, bias=False)
        self.experts_gate_up = nn.Parameter(torch.empty(num_experts, 2 * expert_size, hidden))
        self.experts_down = nn.Parameter(torch.empty(num_experts, hidden, expert_size))
        self.top_k, self.renormalize, self.ops = top_k, renormalize, ops

    @property
    def runs_reference(self) -> bool:
        """Whether it runs the torch reference (off CUDA, or without Triton), whose work
        depends on the routing's values: no CUDA graph can hold it."""
        return triton is None or not self.experts_gate_up.is_cuda

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The router's logits in fp32, as the vocabulary's (bf16's 8-bit mantissa ties
        # experts: in a tiny Mixtral 2 of 882 choices, each flipping what follows).
        logits = self.ops.logits(x, self.gate.weight)
        # The grouped GEMM on CUDA; the reference elsewhere (it equals transformers').
        moe = fused_moe_ref if self.runs_reference else fused_moe
        return moe(x, logits, self.experts_gate_up, self.experts_down, self.top_k,
                   self.renormalize)


def stack_experts(weights: dict[str, torch.Tensor], into: str, num_experts: int,
                  gate: str, up: str, down: str) -> None:
    """Replace the per-expert tensors `{prefix}{e}.{gate|up|down}` (names with `{e}`) by
    `{into}experts_gate_up` and `{into}experts_down`; a checkpoint missing any keeps
    what it has (load_state_dict then names what is missing)."""
    names = [[p.format(e=e) for p in (gate, up, down)] for e in range(num_experts)]
    if not all(n in weights for trio in names for n in trio):
        return
    weights[into + "experts_gate_up"] = torch.stack(
        [torch.cat([weights.pop(g), weights.pop(u)]) for g, u, _ in names])
    weights[into + "experts_down"] = torch.stack([weights.pop(d) for _, _, d in names])


def data_dependent(model: nn.Module) -> bool:
    """Whether any of `model`'s expert blocks runs the torch reference."""
    return any(isinstance(m, SparseMoE) and m.runs_reference for m in model.modules())
