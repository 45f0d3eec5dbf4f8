"""The `triton` attention backend: the KV store, split-K paged decode attention for
decode-only steps, and paged flash attention for every other step (decode rows mixed
with prompts, chunks after a cached prefix)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tandem.engine.attention import AttentionBackend, AttentionMetadata
from tandem.kernels.decode_attention import choose_num_splits, decode_attention
from tandem.kernels.kv_store import store_kv
from tandem.kernels.prefill_attention import prefill_attention


@dataclass(frozen=True)
class TritonState:
    meta: AttentionMetadata
    num_splits: int  # decode steps: split-K partitions per (sequence, kv head)


class TritonAttention(AttentionBackend):
    name = "triton"

    def __init__(self, device: torch.device, block_size: int, num_kv_heads: int) -> None:
        self.block_size, self.num_kv_heads = block_size, num_kv_heads
        self.num_sms = (
            torch.cuda.get_device_properties(device).multi_processor_count
            if device.type == "cuda" else 4
        )

    def build(self, meta: AttentionMetadata) -> TritonState:
        splits = 1
        if meta.is_decode:
            splits = choose_num_splits(
                meta.num_seqs, self.num_kv_heads, meta.max_seq_len, self.block_size, self.num_sms
            )
        return TritonState(meta, splits)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        state: TritonState,
        scale: float,
        window: int | None = None,
        softcap: float | None = None,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
    ) -> torch.Tensor:
        m = state.meta
        window, softcap = window or 0, softcap or 0.0
        store_kv(k, v, kv_cache, m.slot_mapping, k_scale, v_scale)
        if m.is_decode:
            return decode_attention(
                q, kv_cache, m.block_tables, m.seq_lens, scale, state.num_splits,
                window=window, softcap=softcap, k_scale=k_scale, v_scale=v_scale,
            )
        return prefill_attention(
            q, kv_cache, m.block_tables, m.seq_lens, m.query_start, m.max_query_len, scale,
            window=window, softcap=softcap, k_scale=k_scale, v_scale=v_scale,
        )
