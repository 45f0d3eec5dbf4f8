"""The `torch` attention backend: the reference kernels, on any device (the CPU's)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tandem.engine.attention import AttentionBackend, AttentionMetadata
from tandem.kernels.kv_store import store_kv_ref
from tandem.kernels.paged_attention import DecodeRows, paged_attention_ref


@dataclass(frozen=True)
class TorchState:
    meta: AttentionMetadata
    slots: torch.Tensor  # [T] int64: index_copy_ takes no other
    seq_lens: list[int]
    query_start: list[int]
    decode: DecodeRows | None


class TorchAttention(AttentionBackend):
    name = "torch"

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size

    def build(self, meta: AttentionMetadata) -> TorchState:
        # Host lists once per step (a sync on CUDA: this backend is the reference there).
        seq_lens, query_start = meta.seq_lens.tolist(), meta.query_start.tolist()
        decode = DecodeRows.of(meta.block_tables, seq_lens, query_start, self.block_size)
        return TorchState(meta, meta.slot_mapping.long(), seq_lens, query_start, decode)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        state: TorchState,
        scale: float,
        window: int | None = None,
        softcap: float | None = None,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
    ) -> torch.Tensor:
        store_kv_ref(k, v, kv_cache, state.slots, k_scale, v_scale)
        return paged_attention_ref(
            q, kv_cache, state.meta.block_tables, state.seq_lens, state.query_start, scale,
            state.decode, k, v, window, softcap, k_scale, v_scale,
        )
