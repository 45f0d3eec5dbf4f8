"""The `torch` attention backend: the reference kernels, on any device (the CPU's). Built
`fused` (engine/cpu_ops.py `fused_for`), a decode-only step's layers store and attend in
one C++ call (cpu_ops.decode_attention), except a layer with a sliding window or softcap,
or over an FP8 cache, which keeps the reference; so does every step with a prompt in it,
whose own attention outweighs the per-op overhead the fusion saves."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from tandem.engine import cpu_ops
from tandem.engine.attention import AttentionBackend, AttentionMetadata
from tandem.kernels.kv_store import store_kv_ref
from tandem.kernels.paged_attention import DecodeRows, paged_attention_ref


@dataclass(frozen=True)
class TorchState:
    meta: AttentionMetadata
    block_size: int
    fused: bool  # a decode-only step of a fused backend

    # What the reference reads, made on its first layer's use (a fused step's layers
    # never use it): host lists (a sync on CUDA: this backend is the reference there).
    @functools.cached_property
    def slots(self) -> torch.Tensor:  # [T] int64: index_copy_ takes no other
        return self.meta.slot_mapping.long()

    @functools.cached_property
    def seq_lens(self) -> list[int]:
        return self.meta.seq_lens.tolist()

    @functools.cached_property
    def query_start(self) -> list[int]:
        return self.meta.query_start.tolist()

    @functools.cached_property
    def decode(self) -> DecodeRows | None:
        return DecodeRows.of(self.meta.block_tables, self.seq_lens, self.query_start,
                             self.block_size)


class TorchAttention(AttentionBackend):
    name = "torch"

    def __init__(self, block_size: int, fused: bool = False) -> None:
        self.block_size, self.fused = block_size, fused

    def build(self, meta: AttentionMetadata) -> TorchState:
        return TorchState(meta, self.block_size, self.fused and meta.is_decode)

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
        meta = state.meta
        if (state.fused and window is None and softcap is None
                and kv_cache.dtype == torch.float32):
            return cpu_ops.decode_attention(q, k, v, kv_cache, meta.slot_mapping,
                                            meta.block_tables, meta.seq_lens, scale)
        store_kv_ref(k, v, kv_cache, state.slots, k_scale, v_scale)
        return paged_attention_ref(
            q, kv_cache, meta.block_tables, state.seq_lens, state.query_start, scale,
            state.decode, k, v, window, softcap, k_scale, v_scale,
        )
