"""Write new K/V into the paged cache at their slots (torch reference)."""

from __future__ import annotations

import torch


def store_kv_ref(
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,  # [T, Hkv, D]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, Hkv, D]
    slot_mapping: torch.Tensor,  # [T] int64, slot = block_id * block_size + offset
) -> None:
    _, num_blocks, block_size, h, d = kv_cache.shape
    assert k.shape == v.shape and k.shape[1:] == (h, d), (k.shape, kv_cache.shape)
    flat = kv_cache.view(2, num_blocks * block_size, h, d)
    flat[0].index_copy_(0, slot_mapping, k.to(kv_cache.dtype))
    flat[1].index_copy_(0, slot_mapping, v.to(kv_cache.dtype))
