"""Rows quantized to FP8 (float8_e4m3fn), one fp32 scale a row mapping its largest |x| to
448: a Triton kernel and its torch reference. Activations go through it before an FP8
GEMM of more than one row, four times a layer; the MLP's silu(gate) * up is quantized in
the kernel that computes it (`silu_mul_quantize`), which saves writing and reading it
back in bf16.

One program a row. A row of up to `_ONE_PASS` values is read once, held in registers
while its largest |x| is found, and written; a longer one is read twice (a pass for the
largest |x|, a pass to write). On an H100, in CUDA graphs, a call on 128 rows of 4,096
took 2.75 us (two passes: 3.12), of 14,336 7.7 us (12.3); on 2,048 rows 11.2 us (13.3)
and 53 (50). `silu_mul_quantize` of Llama-3-8B's 14,336 a row runs 32 warps a row: on
2,048 rows 60.5 us against 90 at 8 warps, on 8,192 rows 221 against 334 (2.7 TB/s), on
128 rows 6.3 against 8.0."""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU build: the torch reference does the work
    triton = None

from tandem.kernels.silu_mul import silu_mul, silu_mul_ref

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
        block = triton.next_power_of_2(cols)
        one_pass = block <= _ONE_PASS
        _quantize_rows_kernel[(rows,)](x, q, scale, cols, x.stride(0),
                                       BLOCK=block if one_pass else 4096, ONE_PASS=one_pass,
                                       num_warps=8 if block >= 8192 else 4)
    return q, scale


def silu_mul_quantize_ref(gate_up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, 2F] -> `quantize_rows_ref` of silu(gate) * up, rounded to gate_up's dtype
    first (as the unfused kernels round it)."""
    return quantize_rows_ref(silu_mul_ref(gate_up))


def silu_mul_quantize(gate_up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize_rows(silu_mul(gate_up))` in one launch where a row fits in registers
    (F <= `_ONE_PASS`), bit for bit; in two launches otherwise."""
    assert triton is not None, "Triton is not installed"
    rows, two_f = gate_up.shape
    f = two_f // 2
    assert two_f == 2 * f and gate_up.stride(1) == 1, (gate_up.shape, gate_up.stride())
    block = triton.next_power_of_2(f)
    if block > _ONE_PASS:
        return quantize_rows(silu_mul(gate_up))
    q = torch.empty(rows, f, dtype=FP8, device=gate_up.device)
    scale = torch.empty(rows, dtype=torch.float32, device=gate_up.device)
    if rows:
        _silu_mul_quantize_kernel[(rows,)](gate_up, q, scale, f, gate_up.stride(0), BLOCK=block,
                                           num_warps=max(4, min(32, block // 512)))
    return q, scale


# Rows up to this many values are held in registers (32 fp32 a thread at 8 warps).
_ONE_PASS = 16384


if triton is not None:

    @triton.jit
    def _quantize_rows_kernel(x, q, scale, cols, x_row, BLOCK: tl.constexpr,
                              ONE_PASS: tl.constexpr):
        r = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK)
        if ONE_PASS:  # BLOCK >= cols: the row in registers
            ok = offs < cols
            v = tl.load(x + r * x_row + offs, mask=ok, other=0.0).to(tl.float32)
            _quantize_held_row(v, q + r * cols + offs, ok, scale + r)
        else:
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
                v = tl.clamp(tl.math.div_rn(v, s), -448.0, 448.0)
                tl.store(q + r * cols + c0 + offs, v.to(q.dtype.element_ty), mask=ok)

    @triton.jit
    def _silu_mul_quantize_kernel(gate_up, q, scale, f, in_row, BLOCK: tl.constexpr):
        r = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK)
        ok = offs < f
        gate = tl.load(gate_up + r * in_row + offs, mask=ok, other=0.0).to(tl.float32)
        up = tl.load(gate_up + r * in_row + f + offs, mask=ok, other=0.0).to(tl.float32)
        # silu_mul's expression, rounded to its output dtype as it stores it
        y = (gate / (1.0 + tl.exp(-gate)) * up).to(gate_up.dtype.element_ty).to(tl.float32)
        _quantize_held_row(y, q + r * f + offs, ok, scale + r)

    @triton.jit
    def _quantize_held_row(v, q_ptrs, ok, scale_ptr):
        """A row held in registers (fp32, zeros where not `ok`) quantized: its scale (the
        largest |v| / 448, 1 for a row of zeros) to `scale_ptr`, its FP8 values to
        `q_ptrs`."""
        top = tl.max(tl.abs(v), axis=0)
        s = tl.where(top > 0, top / 448.0, 1.0)
        tl.store(scale_ptr, s)
        v = tl.clamp(tl.math.div_rn(v, s), -448.0, 448.0)  # `/` is approximate on CUDA
        tl.store(q_ptrs, v.to(q_ptrs.dtype.element_ty), mask=ok)
