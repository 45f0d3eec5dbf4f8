"""A per-head RMSNorm of q and k followed by RoPE, in place (Qwen3's and Qwen3-MoE's
attention: `q_norm`, `k_norm` over each head, then the rotation): one Triton launch where
the two norms and the rotation took three, and no copy of the fused qkv's q and k views.
Its reference is the two it fuses, `rms_norm_ref` over each head then `apply_rope_ref_`,
with their rounding: normalise in fp32, round, times the weight in the dtype, round, rotate
in fp32, round."""

from __future__ import annotations

import torch

from tandem.kernels.rms_norm import rms_norm_ref
from tandem.kernels.rope import apply_rope_ref_, qk_tiles

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU build: the torch reference does the work
    triton = None

def qk_norm_rope_ref_(
    q: torch.Tensor,  # [T, Hq, D]
    k: torch.Tensor,  # [T, Hkv, D]
    q_weight: torch.Tensor,  # [D], q's dtype
    k_weight: torch.Tensor,  # [D]
    eps: float,
    positions: torch.Tensor,  # [T] int64
    cache: torch.Tensor,  # [max_positions, D] float32, from rope.rope_cache
) -> None:
    for x, w in ((q, q_weight), (k, k_weight)):
        x.copy_(rms_norm_ref(x.reshape(-1, x.shape[-1]), w, eps).view(x.shape))
    apply_rope_ref_(q, k, positions, cache)


def qk_norm_rope_(
    q: torch.Tensor,  # [T, Hq, D], unit last stride (a view of a fused qkv is fine)
    k: torch.Tensor,  # [T, Hkv, D], unit last stride
    q_weight: torch.Tensor,  # [D] contiguous, q's dtype
    k_weight: torch.Tensor,  # [D] contiguous, q's dtype
    eps: float,
    positions: torch.Tensor,  # [T] int32/int64, each < max_positions (not checked on device)
    cache: torch.Tensor,  # [max_positions, D] float32 contiguous
) -> None:
    """`qk_norm_rope_ref_` in one launch: program (t, j) normalises and rotates block j of
    token t's heads, q's blocks first, then k's."""
    tiles = qk_tiles(q, k, positions, cache)
    d = q.shape[2]
    for w in (q_weight, k_weight):
        assert w.shape == (d,) and w.is_contiguous() and w.dtype == q.dtype, (w.shape, w.dtype)
    if tiles is None:
        return
    t, hq, hkv = q.shape[0], q.shape[1], k.shape[1]
    block_h, block_d, q_blocks, k_blocks = tiles
    _qk_norm_rope_kernel[(t, q_blocks + k_blocks)](
        q, k, q_weight, k_weight, positions, cache, q.stride(0), q.stride(1), k.stride(0),
        k.stride(1), hq, hkv, q_blocks, d // 2, eps, BLOCK_H=block_h, BLOCK_D=block_d,
    )


if triton is not None:

    @triton.jit
    def _norm_rotate(x, row, head_stride, heads, head0, weight, half, eps, cos, sin,
                     BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
        hs = head0 + tl.arange(0, BLOCK_H)[:, None]
        ds = tl.arange(0, BLOCK_D)[None, :]
        mask = (hs < heads) & (ds < half)
        ptr = x + row + hs * head_stride + ds
        x1 = tl.load(ptr, mask=mask, other=0.0)
        x2 = tl.load(ptr + half, mask=mask, other=0.0)
        dtype = x1.dtype
        x1f, x2f = x1.to(tl.float32), x2.to(tl.float32)
        rstd = tl.rsqrt((tl.sum(x1f * x1f, axis=1) + tl.sum(x2f * x2f, axis=1))
                        / (2 * half) + eps)[:, None]  # [BLOCK_H, 1]
        w1 = tl.load(weight + ds, mask=ds < half, other=0.0).to(tl.float32)
        w2 = tl.load(weight + half + ds, mask=ds < half, other=0.0).to(tl.float32)
        # Rounded as the reference: the normed value, then its product with the weight.
        y1 = (w1 * (x1f * rstd).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
        y2 = (w2 * (x2f * rstd).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
        tl.store(ptr, (y1 * cos - y2 * sin).to(dtype), mask=mask)
        tl.store(ptr + half, (y2 * cos + y1 * sin).to(dtype), mask=mask)

    @triton.jit
    def _qk_norm_rope_kernel(q, k, q_weight, k_weight, positions, cache, q_tok, q_head,
                             k_tok, k_head, hq, hkv, q_blocks, half, eps,
                             BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        j = tl.program_id(1)
        pos = tl.load(positions + t)
        ds = tl.arange(0, BLOCK_D)[None, :]
        cos = tl.load(cache + pos * 2 * half + ds, mask=ds < half, other=0.0)  # [1, BLOCK_D]
        sin = tl.load(cache + pos * 2 * half + half + ds, mask=ds < half, other=0.0)
        if j < q_blocks:
            _norm_rotate(q, t * q_tok, q_head, hq, j * BLOCK_H, q_weight, half, eps, cos, sin,
                         BLOCK_H, BLOCK_D)
        else:
            _norm_rotate(k, t * k_tok, k_head, hkv, (j - q_blocks) * BLOCK_H, k_weight, half,
                         eps, cos, sin, BLOCK_H, BLOCK_D)
