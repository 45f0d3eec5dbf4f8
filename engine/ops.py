"""The model's pointwise kernels, chosen once with the attention backend: Triton fusions
on CUDA (RMSNorm + residual add, RoPE in place, per-head q/k RMSNorm + RoPE, SiLU·mul),
their torch references elsewhere. Each pair computes the same thing (kernels/*.py,
tests/test_kernels_small.py). On the CPU an engine whose weights are not fp32 runs C++
fusions of the same (engine/cpu_ops.py `fused_for`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from tandem.engine import cpu_linear as cpu_linear_mod
from tandem.engine import cpu_ops
from tandem.engine.fp8 import Fp8Linear
from tandem.kernels import qk_norm_rope, rms_norm, rope, silu_mul


def cpu_linear(x: torch.Tensor, layer: nn.Linear | Fp8Linear) -> torch.Tensor:
    if type(layer) is Fp8Linear:
        return layer(x)
    return cpu_linear_mod.linear(x, layer.weight, layer.bias)


def linear(x: torch.Tensor, layer: nn.Linear | Fp8Linear) -> torch.Tensor:
    if type(layer) is Fp8Linear:  # quantized (engine/fp8.py): it picks its kernel
        return layer(x)
    return F.linear(x, layer.weight, layer.bias)


def logits_fp32(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """[N, D] x [V, D] -> [N, V] in float32, accumulated in fp32 and never rounded to a half
    type: bf16 logits are 0.125 apart near 20, so two tokens tie often and the greedy
    pick would follow rounding noise rather than the model."""
    if hidden.is_cuda and hidden.dtype in (torch.bfloat16, torch.float16):
        return torch.mm(hidden, weight.t(), out_dtype=torch.float32)
    return F.linear(hidden, weight)


@dataclass(frozen=True)
class Ops:
    # (x [T, H], weight, eps, residual [T, H] | None) -> normed, or (normed, x + residual)
    rms_norm: Callable
    # (q [T, Hq, D], k [T, Hkv, D], positions [T], cos_sin [P, D]) -> None, in place
    apply_rope_: Callable
    # (gate_up [T, 2F]) -> silu(gate) * up [T, F]
    silu_mul: Callable
    # (x [T, in], nn.Linear) -> [T, out]
    linear: Callable = linear
    # (hidden [N, D], embedding [V, D]) -> logits [N, V]
    logits: Callable = logits_fp32
    # (q [T, Hq, D], k, q_weight [D], k_weight [D], eps, positions, cos_sin) -> None, in
    # place: each head RMS-normed, then RoPE. None: rms_norm over each head, then apply_rope_
    qk_norm_rope_: Callable | None = None


TORCH_OPS = Ops(rms_norm.rms_norm_ref, rope.apply_rope_ref_, silu_mul.silu_mul_ref)
CPU_OPS = Ops(rms_norm.rms_norm_ref, rope.apply_rope_ref_, silu_mul.silu_mul_ref,
              cpu_linear, cpu_linear_mod.linear)
CPU_FUSED_OPS = Ops(cpu_ops.rms_norm, cpu_ops.apply_rope_, cpu_ops.silu_mul, cpu_linear,
                    cpu_linear_mod.linear)
TRITON_OPS = Ops(rms_norm.rms_norm, rope.apply_rope_, silu_mul.silu_mul,
                 qk_norm_rope_=qk_norm_rope.qk_norm_rope_)


def ops_for(backend: str, device: torch.device, fused: bool = False) -> Ops:
    """`fused`: the CPU's C++ fusions (cpu_ops.fused_for said so)."""
    if backend == "triton":
        return TRITON_OPS
    if device.type != "cpu":
        return TORCH_OPS
    return CPU_FUSED_OPS if fused else CPU_OPS
