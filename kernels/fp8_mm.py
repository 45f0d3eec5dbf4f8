"""x @ W^T with both in FP8 (float8_e4m3fn) and a fp32 scale per row on each side (x's
per token, W's per output row), for decode steps of a few to a few hundred rows: a
Triton kernel on the FP8 tensor cores.

Why a kernel of our own: a decode step of 64-256 rows still reads each weight once and
little else, so it should take about the FP8 bytes' time. cuBLAS's row-wise scaled GEMM
(`torch._scaled_mm`) took 4.2-4.6 ms for a Llama-3-8B step's 128 GEMMs at 2-256 rows on an
H100, against 2.4 ms of bytes: at so few rows its tiles leave most of the SMs idle (one
row of 128-column tiles is 48 programs for qkv's 6,144 columns). Here a program is a
`BLOCK_M` x `BLOCK_N` tile over all of K; the row blocks of one column block are next to
each other in the grid, so they read that weight tile from L2 together. engine/fp8.py
sends a layer here where `tiles` names tiles for its shape (1 row: kernels/fp8_gemm.py).

The reference is kernels/fp8_gemm.py's `fp8_gemm_ref` on x widened by its scales.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU build: the torch reference does the work
    triton = None

from tandem.kernels.fp8_quant import FP8

# The best tiles of benchmarks/fp8_mm_tiles.py's sweep on an H100 (Llama-3-8B's layers, 32
# distinct weights each, in a CUDA graph), by rows (up to 32, 64, 128) and by columns
# (up to 4,096: o and down; up to 8,192: qkv; more: gate_up); None where cuBLAS's
# `_scaled_mm` was as fast. Narrow layers have few column tiles, each streaming a long
# row of W: narrow tiles and a deep pipeline keep more of the SMs reading. Against
# `_scaled_mm`, ms for the 32 layers (o, down, qkv, gate_up):
#   4 rows   0.34 / 0.89 / 0.41 / 1.38 against 0.49 / 1.55 / 0.61 / 1.62 (16-row tiles)
#   16 rows  0.34 / 0.89 / 0.43 / 1.40 against 0.47 / 1.44 / 0.59 / 1.56 (16-row tiles)
#   32 rows  0.32 / 0.83 / 0.44 / 1.46 against 0.46 / 1.33 / 0.57 / 1.63
#   64 rows  0.30 / 0.80 / 0.41 / 1.46 against 0.45 / 1.25 / 0.52 / 1.53
#   128 rows 0.33 / 0.84 against 0.45 / 1.19; qkv and gate_up tie (0.47 / 1.57 against
#            0.47 / 1.56) and stay with cuBLAS
_TILES: dict[tuple[int, int], tuple[int, ...] | None] = {
    # (rows up to, columns up to): (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages)
    (32, 4096): (32, 32, 256, 4, 5), (32, 8192): (32, 32, 256, 4, 5),
    (32, 1 << 62): (32, 32, 128, 4, 3),
    (64, 4096): (64, 32, 256, 4, 5), (64, 8192): (64, 64, 256, 4, 5),
    (64, 1 << 62): (64, 64, 256, 4, 3),
    (128, 4096): (64, 64, 256, 4, 5), (128, 8192): None, (128, 1 << 62): None,
}
# More rows than this: cuBLAS (ties at 256 rows, far ahead at prefill's thousands).
MAX_ROWS = 128
# The tiles for a call that names none where the table says cuBLAS: the sweep's best at
# 256 rows.
_LARGE = {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 128, "num_warps": 8, "num_stages": 3}


def tiles(m: int, n: int, k: int) -> dict[str, int] | None:
    """The kernel's tiles for an [m, k] x [k, n] product; None where `_scaled_mm` is as
    fast (or m > MAX_ROWS)."""
    if m > MAX_ROWS:
        return None
    rows = 32 if m <= 32 else 64 if m <= 64 else 128
    cols = 4096 if n <= 4096 else 8192 if n <= 8192 else 1 << 62
    tile = _TILES[rows, cols]
    if tile is None:
        return None
    bm, bn, bk, warps, stages = tile
    if m <= 16:
        bm = 16
    return {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "num_warps": warps,
            "num_stages": stages}


def fp8_mm(xq: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor,
           scale: torch.Tensor, bias: torch.Tensor | None = None,
           out_dtype: torch.dtype = torch.bfloat16,
           config: dict[str, int] | None = None) -> torch.Tensor:
    """(xq * x_scale[:, None]) @ (weight * scale[:, None])^T + bias in one launch:
    xq [M, K] and weight [N, K] FP8, the scales fp32; accumulated in fp32."""
    assert triton is not None, "Triton is not installed"
    m, k = xq.shape
    n = weight.shape[0]
    assert xq.dtype == FP8 and weight.dtype == FP8 and weight.shape == (n, k), (
        xq.dtype, weight.dtype, weight.shape)
    assert xq.stride(1) == 1 and weight.stride(1) == 1, (xq.stride(), weight.stride())
    assert x_scale.shape == (m,) and scale.shape == (n,), (x_scale.shape, scale.shape)
    assert bias is None or bias.shape == (n,), bias.shape
    out = torch.empty(m, n, dtype=out_dtype, device=xq.device)
    if m == 0:
        return out
    cfg = dict(config or tiles(m, n, k) or _LARGE)
    grid = (triton.cdiv(m, cfg["BLOCK_M"]), triton.cdiv(n, cfg["BLOCK_N"]))
    _fp8_mm_kernel[grid](
        xq, x_scale, weight, scale, bias if bias is not None else scale, out, m, n, k,
        xq.stride(0), weight.stride(0), out.stride(0), HAS_BIAS=bias is not None, **cfg,
    )
    return out


if triton is not None:

    @triton.jit
    def _fp8_mm_kernel(x, x_scale, w, w_scale, bias, out, M, N, K, x_row, w_row, out_row,
                       HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr):
        pid_m, pid_n = tl.program_id(0), tl.program_id(1)
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        m_ok, n_ok = rm < M, rn < N
        xs = x + rm.to(tl.int64)[:, None] * x_row + rk[None, :]  # [BLOCK_M, BLOCK_K]
        ws = w + rn.to(tl.int64)[None, :] * w_row + rk[:, None]  # [BLOCK_K, BLOCK_N]
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k_ok = k0 + rk < K
            a = tl.load(xs, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            b = tl.load(ws, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
            acc = tl.dot(a, b, acc)
            xs += BLOCK_K
            ws += BLOCK_K
        acc *= tl.load(x_scale + rm, mask=m_ok, other=0.0)[:, None]
        acc *= tl.load(w_scale + rn, mask=n_ok, other=0.0)[None, :]
        if HAS_BIAS:
            acc += tl.load(bias + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(out + rm.to(tl.int64)[:, None] * out_row + rn[None, :],
                 acc.to(out.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])
