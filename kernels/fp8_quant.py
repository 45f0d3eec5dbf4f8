"""Rows quantized to FP8 (float8_e4m3fn), one fp32 scale a row mapping its largest |x| to
448: a Triton kernel (one program a row: a pass for the largest |x|, a pass to write)
and its torch reference. Prefill's activations go through it before an FP8 GEMM."""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU build: the torch reference does the work
    triton = None

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # float8_e4m3fn's largest finite value; it has no inf


def quantize_rows_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[R, C] -> (FP8 [R, C], fp32 scales [R]) with x ~= fp8 * scale[:, None]; a row of
    zeros gets a scale of 1 (its values are 0 either way)."""
    amax = x.abs().amax(dim=1).float()
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (x.float() / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q, scale


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize_rows_ref` in one launch (CUDA, or the Triton interpreter)."""
    assert triton is not None, "Triton is not installed"
    rows, cols = x.shape
    assert x.stride(1) == 1, x.stride()
    q = torch.empty(rows, cols, dtype=FP8, device=x.device)
    scale = torch.empty(rows, dtype=torch.float32, device=x.device)
    if rows:
        _quantize_rows_kernel[(rows,)](x, q, scale, cols, x.stride(0),
                                       BLOCK=min(4096, triton.next_power_of_2(cols)))
    return q, scale


if triton is not None:

    @triton.jit
    def _quantize_rows_kernel(x, q, scale, cols, x_row, BLOCK: tl.constexpr):
        r = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK)
        amax = tl.zeros([BLOCK], dtype=tl.float32)
        for c0 in range(0, cols, BLOCK):
            v = tl.load(x + r * x_row + c0 + offs, mask=c0 + offs < cols, other=0.0)
            amax = tl.maximum(amax, tl.abs(v.to(tl.float32)))
        top = tl.max(amax, axis=0)
        s = tl.where(top > 0, top / 448.0, 1.0)
        tl.store(scale + r, s)
        for c0 in range(0, cols, BLOCK):
            ok = c0 + offs < cols
            v = tl.load(x + r * x_row + c0 + offs, mask=ok, other=0.0).to(tl.float32)
            v = tl.clamp(tl.math.div_rn(v, s), -448.0, 448.0)  # `/` is approximate on CUDA
            tl.store(q + r * cols + c0 + offs, v.to(q.dtype.element_ty), mask=ok)
