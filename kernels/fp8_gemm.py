"""x @ W^T with W in FP8 (float8_e4m3fn, one fp32 scale per output row) for one row (a
decode step of one sequence): a Triton kernel that streams the FP8 weight and widens it
in registers (weight-only: x stays in its dtype), and its torch reference.

Why a kernel of our own: at one row a linear layer is a read of its weight, so FP8
should take half bf16's time. Measured on an H100, the 128 GEMMs of a Llama-3-8B step
replayed in a CUDA graph (benchmarks/fp8_gemm.py): bf16 5.23 ms, this kernel 2.85 ms
with `tiles` (the bytes alone 2.37 ms at the measured copy rate), `_scaled_mm` with x
quantized per row 4.64 ms. From two
rows on `_scaled_mm` wins or ties (4.2-4.6 ms up to 256 rows, 27 ms against bf16's 41
at 2,048), so engine/fp8.py sends only single rows here.

Program (n block, m block): BLOCK_N output columns for BLOCK_M rows, over all of K. With
BLOCK_M == 1 the product is a sum over the tile (no tensor cores, no padded rows);
otherwise `tl.dot` on the weight tile widened to x's dtype.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU build: the torch reference does the work
    triton = None

from tandem.kernels.fp8_quant import FP8


def fp8_gemm_ref(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                 bias: torch.Tensor | None = None, out_dtype: torch.dtype | None = None
                 ) -> torch.Tensor:
    """x [M, K] (any float dtype), weight [N, K] FP8, scale [N] fp32 -> [M, N] in
    `out_dtype` (x's by default): the weight widened to fp32, scaled per row, multiplied
    in fp32."""
    w = weight.float() * scale.float()[:, None]
    out = x.float() @ w.t()
    if bias is not None:
        out = out + bias.float()
    return out.to(out_dtype or x.dtype)


def tiles(m: int, n: int, k: int) -> dict[str, int]:
    """The kernel's tiles for an [m, k] x [k, n] product. At one row: four output rows a
    program; rows read 1,024 at a time, 2,048 where they are long (K > 4,096) or many
    (N > 16,384); 8 warps for a small square layer, else 4. The best of a sweep (4 / 8 /
    16 rows, 1,024-4,096 columns, 4 / 8 warps, 2-4 stages) for each of Llama-3-8B's shapes
    on an H100, 32 layers of distinct weights in a CUDA graph, per layer: qkv [6144, 4096]
    11.9 us, o [4096, 4096] 9.0, gate_up [28672, 4096] 42.5, down [4096, 14336] 24.9, the
    logits [128256, 4096] 173 (bf16's 378); eight rows a program took 1-3% longer."""
    if m == 1:
        long = k > 4096 or n > 16384
        return {"BLOCK_M": 1, "BLOCK_N": 4, "BLOCK_K": 2048 if long else 1024,
                "num_warps": 8 if n <= 4096 and not long else 4, "num_stages": 3}
    return {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 128, "num_warps": 8, "num_stages": 4}


def fp8_gemm(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
             bias: torch.Tensor | None = None, config: dict[str, int] | None = None,
             out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """`fp8_gemm_ref` in one launch, accumulated in fp32 and returned in `out_dtype` (x's
    by default). One-row tiles (`BLOCK_M` 1) widen the weight and sum; others multiply on
    the tensor cores, the weight widened to x's dtype."""
    assert triton is not None, "Triton is not installed"
    m, k = x.shape
    n = weight.shape[0]
    assert weight.dtype == FP8 and weight.shape == (n, k), (weight.dtype, weight.shape)
    assert weight.stride(1) == 1 and x.stride(1) == 1, (weight.stride(), x.stride())
    assert scale.dtype == torch.float32 and scale.shape == (n,), (scale.dtype, scale.shape)
    assert bias is None or bias.shape == (n,), bias.shape
    out = torch.empty(m, n, dtype=out_dtype or x.dtype, device=x.device)
    if m == 0:
        return out
    cfg = dict(config or tiles(m, n, k))
    grid = (triton.cdiv(n, cfg["BLOCK_N"]), triton.cdiv(m, cfg["BLOCK_M"]))
    _fp8_gemm_kernel[grid](
        x, weight, scale, bias if bias is not None else scale, out, m, n, k,
        x.stride(0), weight.stride(0), out.stride(0), HAS_BIAS=bias is not None, **cfg,
    )
    return out


if triton is not None:

    @triton.jit
    def _fp8_gemm_kernel(x, w, scale, bias, out, M, N, K, x_row, w_row, out_row,
                         HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr,
                         BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        pid_n, pid_m = tl.program_id(0), tl.program_id(1)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        n_ok = rn < N
        w_rows = w + rn.to(tl.int64)[:, None] * w_row  # [BLOCK_N, 1]
        if BLOCK_M == 1:
            acc = tl.zeros([BLOCK_N], dtype=tl.float32)
            x_row_ptr = x + pid_m.to(tl.int64) * x_row
            for k0 in range(0, K, BLOCK_K):
                ks = k0 + rk
                k_ok = ks < K
                xs = tl.load(x_row_ptr + ks, mask=k_ok, other=0.0).to(tl.float32)
                ws = tl.load(w_rows + ks[None, :], mask=n_ok[:, None] & k_ok[None, :],
                             other=0.0).to(tl.float32)  # [BLOCK_N, BLOCK_K]
                acc += tl.sum(ws * xs[None, :], axis=1)
            acc = acc * tl.load(scale + rn, mask=n_ok, other=0.0)
            if HAS_BIAS:
                acc += tl.load(bias + rn, mask=n_ok, other=0.0).to(tl.float32)
            tl.store(out + pid_m.to(tl.int64) * out_row + rn, acc.to(out.dtype.element_ty),
                     mask=n_ok)
        else:
            rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
            m_ok = rm < M
            x_rows = x + rm.to(tl.int64)[:, None] * x_row  # [BLOCK_M, 1]
            acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                ks = k0 + rk
                k_ok = ks < K
                xs = tl.load(x_rows + ks[None, :], mask=m_ok[:, None] & k_ok[None, :],
                             other=0.0)  # [BLOCK_M, BLOCK_K]
                ws = tl.load(w_rows + ks[None, :], mask=n_ok[:, None] & k_ok[None, :],
                             other=0.0)  # [BLOCK_N, BLOCK_K]
                acc += tl.dot(xs, tl.trans(ws.to(xs.dtype)))
            acc = acc * tl.load(scale + rn, mask=n_ok, other=0.0)[None, :]
            if HAS_BIAS:
                acc += tl.load(bias + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
            tl.store(out + rm.to(tl.int64)[:, None] * out_row + rn[None, :],
                     acc.to(out.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])
