"""The attention backend interface: per-step metadata, KV store and attention, chosen
by name. The model calls `backend.forward`; it never knows which backend runs.

- `torch` (`attention_torch.py`): the reference, any device; what the CPU runs.
- `triton` (`attention_triton.py`): Triton kernels over the paged cache; the CUDA default.
"""

from __future__ import annotations

import importlib.util
import os
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import torch

BACKENDS = ("torch", "triton")


@dataclass(frozen=True)
class AttentionMetadata:
    """What every backend gets, built once per step by the model runner: device tensors
    (views of its persistent buffers) and the host ints that size kernel grids.

    Row b of the batch owns queries [query_start[b], query_start[b+1]): the *last*
    q_len of its seq_lens[b] tokens. Every token's K/V slot is in `slot_mapping`; a
    padded row writes to the null slot and reads the null block, which nobody owns."""

    slot_mapping: torch.Tensor  # [T] int64
    block_tables: torch.Tensor  # [B, W] int32, row b = sequence b
    seq_lens: torch.Tensor  # [B] int32, the new tokens included
    query_start: torch.Tensor  # [B + 1] int32
    max_query_len: int
    max_seq_len: int  # an upper bound (a CUDA graph is captured for the longest context)

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]

    @property
    def is_decode(self) -> bool:
        return self.max_query_len == 1


class AttentionBackend(ABC):
    """Invariants: `build` is called once per step, outside any CUDA graph, and may read
    host values; `forward` is called once per layer, reads only tensors and what
    `build` returned, and must be capturable in a CUDA graph when the step is decode-only."""

    name: str

    @abstractmethod
    def build(self, meta: AttentionMetadata) -> Any:
        """The per-step state `forward` reads (the metadata itself, or more)."""

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,  # [T, Hq, D]
        k: torch.Tensor,  # [T, Hkv, D]
        v: torch.Tensor,  # [T, Hkv, D]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, Hkv, D]
        state: Any,  # what build returned
        scale: float,
        window: int | None = None,  # keys fewer than this many positions back only
        softcap: float | None = None,  # scores through softcap * tanh(s / softcap)
        k_scale: float = 1.0,  # an FP8 cache holds k / k_scale (kernels/kv_store.py)
        v_scale: float = 1.0,  # and v / v_scale; any other cache ignores both
    ) -> torch.Tensor:  # [T, Hq, D]
        """Store k/v at their slots, then attend over the paged cache."""


def default_backend(device: torch.device) -> str:
    has_triton = importlib.util.find_spec("triton") is not None
    return "triton" if device.type == "cuda" and has_triton else "torch"


def make_backend(
    name: str | None, device: torch.device, block_size: int, num_kv_heads: int,
    fused: bool = False,
) -> AttentionBackend:
    """`fused`: the torch backend's decode steps in C++ (engine/cpu_ops.py `fused_for`)."""
    name = name or default_backend(device)
    if name == "torch":
        from tandem.engine.attention_torch import TorchAttention

        return TorchAttention(block_size, fused)
    if name == "triton":
        if importlib.util.find_spec("triton") is None:
            raise ValueError("attention_backend='triton' needs the triton package")
        if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError(
                "attention_backend='triton' runs on CUDA (or on CPU under TRITON_INTERPRET=1); "
                "use 'torch' on the CPU"
            )
        from tandem.engine.attention_triton import TritonAttention

        return TritonAttention(device, block_size, num_kv_heads)
    raise ValueError(f"unknown attention backend {name!r}; choose one of {BACKENDS}")
