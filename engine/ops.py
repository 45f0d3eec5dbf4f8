"""The model's pointwise kernels, chosen once with the attention backend: Triton fusions
on CUDA (RMSNorm + residual add, RoPE in place, SiLU·mul), their torch references
elsewhere. Each pair computes the same thing (kernels/*.py, tests/test_kernels_small.py)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from tandem.kernels import rms_norm, rope, silu_mul


@dataclass(frozen=True)
class Ops:
    # (x [T, H], weight, eps, residual [T, H] | None) -> normed, or (normed, x + residual)
    rms_norm: Callable
    # (q [T, Hq, D], k [T, Hkv, D], positions [T], cos_sin [P, D]) -> None, in place
    apply_rope_: Callable
    # (gate_up [T, 2F]) -> silu(gate) * up [T, F]
    silu_mul: Callable


TORCH_OPS = Ops(rms_norm.rms_norm_ref, rope.apply_rope_ref_, silu_mul.silu_mul_ref)
TRITON_OPS = Ops(rms_norm.rms_norm, rope.apply_rope_, silu_mul.silu_mul)


def ops_for(backend: str) -> Ops:
    return TRITON_OPS if backend == "triton" else TORCH_OPS
