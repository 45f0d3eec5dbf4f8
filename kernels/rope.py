"""Rotary position embedding, applied in place to q and k (rotate-half, the Hugging Face
Llama convention): a Triton kernel and its torch reference. Both read cos/sin from one
fp32 table built at load time, compute in fp32 and round once to the tensors' dtype."""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU build: the torch reference does the work
    triton = None

# Elements of one half-head tile a program rotates: (heads per program) x D/2.
_TILE = 2048


def rope_cache(inv_freq: torch.Tensor, max_positions: int) -> torch.Tensor:
    """[max_positions, D] float32: cos(p * inv_freq) in the first half, sin in the second."""
    pos = torch.arange(max_positions, dtype=torch.float32, device=inv_freq.device)
    freqs = pos[:, None] * inv_freq.float()[None, :]  # [P, D/2]
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1)


def apply_rope_ref_(
    q: torch.Tensor,  # [T, Hq, D]
    k: torch.Tensor,  # [T, Hkv, D]
    positions: torch.Tensor,  # [T] int64
    cache: torch.Tensor,  # [max_positions, D] float32, from rope_cache
) -> None:
    half = cache.shape[1] // 2
    cos_sin = cache[positions, None]  # [T, 1, D]
    cos, sin = cos_sin[..., :half], cos_sin[..., half:]  # [T, 1, D/2]
    for x in _heads(q, k):
        x1, x2 = x[..., :half].float(), x[..., half:].float()  # views when x is fp32
        out1, out2 = x1 * cos - x2 * sin, x2 * cos + x1 * sin
        x[..., :half], x[..., half:] = out1, out2


def _heads(q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """(one [T, Hq + Hkv, D] view of both) where k's heads follow q's in memory, row by
    row (a fused qkv's views), so one pass of a few torch ops rotates both: half of a CPU
    decode step's rope time is those ops' overhead. Else (q, k)."""
    t, hq, d = q.shape
    follows = (k.dtype == q.dtype and q.stride()[1:] == k.stride()[1:] == (d, 1)
               and k.stride(0) == q.stride(0)
               and k.data_ptr() == q.data_ptr() + hq * d * q.element_size())
    if not follows:
        return q, k
    return (q.as_strided((t, hq + k.shape[1], d), q.stride()),)


def qk_tiles(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
             cache: torch.Tensor) -> tuple[int, int, int, int] | None:
    """The layout a kernel over q's and k's heads by token asserts (this one's and
    qk_norm_rope's), and its tiles: (heads per program, D/2 padded, q's blocks, k's
    blocks); None for no token."""
    assert triton is not None, "Triton is not installed"
    t, hq, d = q.shape
    hkv = k.shape[1]
    assert k.shape == (t, hkv, d) and d % 2 == 0, (q.shape, k.shape)
    assert q.stride(2) == 1 and k.stride(2) == 1, (q.stride(), k.stride())
    assert cache.dtype == torch.float32 and cache.is_contiguous() and cache.shape[1] == d, (
        cache.dtype, cache.shape)
    assert positions.shape == (t,) and positions.dtype in (torch.int32, torch.int64), (
        positions.shape, positions.dtype)
    assert q.dtype == k.dtype and q.device == k.device == positions.device == cache.device
    if t == 0:
        return None
    block_d = triton.next_power_of_2(d // 2)
    block_h = min(triton.next_power_of_2(max(hq, hkv)), max(1, _TILE // block_d))
    return block_h, block_d, triton.cdiv(hq, block_h), triton.cdiv(hkv, block_h)


def apply_rope_(
    q: torch.Tensor,  # [T, Hq, D], unit last stride (a view of a fused qkv is fine)
    k: torch.Tensor,  # [T, Hkv, D], unit last stride
    positions: torch.Tensor,  # [T] int64, each < max_positions (not checked on device)
    cache: torch.Tensor,  # [max_positions, D] float32 contiguous, from rope_cache
) -> None:
    """`apply_rope_ref_` in one launch: program (t, j) rotates block j of token t's heads,
    q's blocks first, then k's."""
    tiles = qk_tiles(q, k, positions, cache)
    if tiles is None:
        return
    t, hq, hkv, d = q.shape[0], q.shape[1], k.shape[1], q.shape[2]
    block_h, block_d, q_blocks, k_blocks = tiles
    _rope_kernel[(t, q_blocks + k_blocks)](
        q, k, positions, cache, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        hq, hkv, q_blocks, d // 2, BLOCK_H=block_h, BLOCK_D=block_d,
    )


if triton is not None:

    @triton.jit
    def _rotate(x, row, head_stride, heads, head0, half, cos, sin,
                BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
        hs = head0 + tl.arange(0, BLOCK_H)[:, None]
        ds = tl.arange(0, BLOCK_D)[None, :]
        mask = (hs < heads) & (ds < half)
        ptr = x + row + hs * head_stride + ds
        x1 = tl.load(ptr, mask=mask, other=0.0)
        x2 = tl.load(ptr + half, mask=mask, other=0.0)
        x1f, x2f = x1.to(tl.float32), x2.to(tl.float32)
        tl.store(ptr, (x1f * cos - x2f * sin).to(x1.dtype), mask=mask)
        tl.store(ptr + half, (x2f * cos + x1f * sin).to(x1.dtype), mask=mask)

    @triton.jit
    def _rope_kernel(q, k, positions, cache, q_tok, q_head, k_tok, k_head,
                     hq, hkv, q_blocks, half, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        j = tl.program_id(1)
        pos = tl.load(positions + t)
        ds = tl.arange(0, BLOCK_D)[None, :]
        cos = tl.load(cache + pos * 2 * half + ds, mask=ds < half, other=0.0)  # [1, BLOCK_D]
        sin = tl.load(cache + pos * 2 * half + half + ds, mask=ds < half, other=0.0)
        if j < q_blocks:
            _rotate(q, t * q_tok, q_head, hq, j * BLOCK_H, half, cos, sin, BLOCK_H, BLOCK_D)
        else:
            _rotate(k, t * k_tok, k_head, hkv, (j - q_blocks) * BLOCK_H, half, cos, sin,
                    BLOCK_H, BLOCK_D)
