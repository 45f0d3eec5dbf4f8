"""Per-forward attention metadata and the attention backend the model calls."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tandem.kernels.kv_store import store_kv_ref
from tandem.kernels.paged_attention import paged_attention_ref


@dataclass(frozen=True)
class AttentionMetadata:
    """Built once per step by the model runner and passed down every layer."""

    slot_mapping: torch.Tensor  # [T] int64
    block_tables: torch.Tensor  # [B, max_blocks] int64
    seq_lens: list[int]  # [B]
    query_start: list[int]  # [B + 1]


def paged_attention(
    q: torch.Tensor,  # [T, Hq, D]
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,  # [T, Hkv, D]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, Hkv, D]
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    store_kv_ref(k, v, kv_cache, meta.slot_mapping)
    return paged_attention_ref(
        q, kv_cache, meta.block_tables, meta.seq_lens, meta.query_start, scale
    )
