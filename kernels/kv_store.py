"""Write new K/V into the paged cache at their slots: a Triton kernel for CUDA (one
program per token, no host sync, so it can sit inside a CUDA graph) and its torch
reference.

Several rows may share one slot (padded rows all aimed at the reserved null slot): what
lands there is unspecified and never read; every other slot gets exactly its row.

An FP8 cache (float8_e4m3fn) holds K / k_scale and V / v_scale, one scale per layer
for each: `quantize_ref` on the way in, `read_kv_ref` on the way out. e4m3fn has no
infinity and an overflowing cast is NaN, so values saturate at +-448 first. Any other
cache holds k and v cast to its dtype, and the scales are ignored.
"""

from __future__ import annotations

import torch

from tandem.kernels.fp8_quant import FP8, FP8_MAX

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU build: the torch reference does the work
    triton = None


def quantize_ref(x: torch.Tensor, scale: float) -> torch.Tensor:
    """x / scale in FP8, saturated (in float32, as the kernel divides)."""
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)


def read_kv_ref(cached: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """Cached K or V as `dtype`: FP8 values times their scale, any other as they are."""
    if cached.dtype != FP8:
        return cached.to(dtype)  # no copy when the cache is in `dtype` already
    return (cached.float() * scale).to(dtype)


def store_kv_ref(
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,  # [T, Hkv, D]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, Hkv, D]
    slot_mapping: torch.Tensor,  # [T] int64, slot = block_id * block_size + offset
    k_scale: float = 1.0,  # an FP8 cache's; ignored by any other
    v_scale: float = 1.0,
) -> None:
    _, num_blocks, block_size, h, d = kv_cache.shape
    assert k.shape == v.shape and k.shape[1:] == (h, d), (k.shape, kv_cache.shape)
    flat = kv_cache.view(2, num_blocks * block_size, h, d)
    if kv_cache.dtype == FP8:  # the CPU has no index_copy_ for FP8: copy the bytes
        flat = flat.view(torch.uint8)
        k, v = (quantize_ref(x, s).view(torch.uint8) for x, s in ((k, k_scale), (v, v_scale)))
    flat[0].index_copy_(0, slot_mapping, k.to(flat.dtype))
    flat[1].index_copy_(0, slot_mapping, v.to(flat.dtype))


def store_kv(
    k: torch.Tensor,  # [T, Hkv, D], unit last stride (a view of a fused qkv is fine)
    v: torch.Tensor,  # [T, Hkv, D], unit last stride
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, Hkv, D] contiguous
    slot_mapping: torch.Tensor,  # [T] int32 or int64, slot = block_id * block_size + offset
    k_scale: float = 1.0,  # an FP8 cache's; ignored by any other
    v_scale: float = 1.0,
) -> None:
    """`store_kv_ref` in one launch, cast (FP8: quantized) on the way."""
    assert triton is not None, "Triton is not installed"
    _, num_blocks, block_size, h, d = kv_cache.shape
    t = k.shape[0]
    assert k.shape == v.shape == (t, h, d), (k.shape, v.shape, kv_cache.shape)
    assert k.stride(2) == 1 and v.stride(2) == 1, (k.stride(), v.stride())
    assert kv_cache.is_contiguous(), kv_cache.stride()
    assert slot_mapping.shape == (t,) and slot_mapping.dtype in (torch.int32, torch.int64), (
        slot_mapping.shape, slot_mapping.dtype)
    assert k.device == v.device == kv_cache.device == slot_mapping.device
    if t == 0:
        return
    _store_kv_kernel[(t,)](
        k, v, kv_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        num_blocks * block_size * h * d, h, d, float(k_scale), float(v_scale),
        BLOCK_H=triton.next_power_of_2(h), BLOCK_D=triton.next_power_of_2(d),
        FP8=kv_cache.dtype == FP8,
    )


if triton is not None:

    @triton.jit
    def _store_kv_kernel(k, v, cache, slots, k_tok, k_head, v_tok, v_head,
                         v_offset, heads, dim, k_scale, v_scale,
                         BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, FP8: tl.constexpr):
        # program t: all heads of token t. Cache offsets in int64: a cache is often more
        # than 2**31 elements.
        t = tl.program_id(0).to(tl.int64)
        slot = tl.load(slots + t).to(tl.int64)  # int32 slots: offsets pass 2**31
        hs = tl.arange(0, BLOCK_H)[:, None]
        ds = tl.arange(0, BLOCK_D)[None, :]
        mask = (hs < heads) & (ds < dim)
        dst = cache + slot * heads * dim + hs * dim + ds
        key = tl.load(k + t * k_tok + hs * k_head + ds, mask=mask)
        val = tl.load(v + t * v_tok + hs * v_head + ds, mask=mask)
        if FP8:
            key = _quantize(key, k_scale)
            val = _quantize(val, v_scale)
        tl.store(dst, key.to(cache.dtype.element_ty), mask=mask)
        tl.store(dst + v_offset, val.to(cache.dtype.element_ty), mask=mask)

    @triton.jit
    def _quantize(x, scale):
        # quantize_ref's float32 x / scale, correctly rounded (`/` is approximate on
        # CUDA), saturated: the cast to FP8 follows
        x = tl.math.div_rn(x.to(tl.float32), scale)
        return tl.minimum(tl.maximum(x, -448.0), 448.0)
