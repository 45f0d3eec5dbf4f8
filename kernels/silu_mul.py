"""SiLU-and-multiply of a fused gate_up projection, silu(gate) * up: a Triton kernel
(program (t, j): block j of row t) and its torch reference, both in fp32, rounded once."""

from __future__ import annotations

import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU build: the torch reference does the work
    triton = None

_BLOCK = 1024  # columns per program


def silu_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:  # [T, 2F] -> [T, F]
    gate, up = gate_up.float().chunk(2, dim=-1)
    return (F.silu(gate) * up).to(gate_up.dtype)


def silu_mul(
    gate_up: torch.Tensor,  # [T, 2F], unit last stride: gate = first F columns, up = last F
    out: torch.Tensor | None = None,  # [T, F], unit last stride, gate_up's dtype
) -> torch.Tensor:
    """silu(gate) * up into `out` (a new tensor when None), returned."""
    assert triton is not None, "Triton is not installed"
    t, two_f = gate_up.shape
    f = two_f // 2
    assert two_f == 2 * f and gate_up.stride(1) == 1, (gate_up.shape, gate_up.stride())
    if out is None:
        out = torch.empty((t, f), dtype=gate_up.dtype, device=gate_up.device)
    assert out.shape == (t, f) and out.stride(1) == 1, (out.shape, out.stride())
    assert out.dtype == gate_up.dtype and out.device == gate_up.device
    if t > 0 and f > 0:
        block = min(_BLOCK, triton.next_power_of_2(f))
        _silu_mul_kernel[(t, triton.cdiv(f, block))](
            gate_up, out, gate_up.stride(0), out.stride(0), f, BLOCK=block)
    return out


if triton is not None:

    @triton.jit
    def _silu_mul_kernel(gate_up, out, in_row, out_row, f, BLOCK: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < f
        gate = tl.load(gate_up + t * in_row + cols, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(gate_up + t * in_row + f + cols, mask=mask, other=0.0).to(tl.float32)
        y = gate / (1.0 + tl.exp(-gate)) * up
        tl.store(out + t * out_row + cols, y.to(out.dtype.element_ty), mask=mask)
