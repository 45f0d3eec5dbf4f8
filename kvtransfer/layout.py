"""The KV layout both ends of a transfer must agree on before any byte moves.

A layer's cache is `[2, num_blocks, block_size, num_kv_heads, head_dim]`; a transfer
moves, per layer, the gathered `[2, n, block_size, num_kv_heads, head_dim]` of n blocks.
Two caches can hold the same number of bytes per block and still disagree (heads vs
head_dim, fp16 vs bf16, another model), so the whole layout is compared, never sizes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any

import torch

from tandem.kvtransfer.connector import TransferError, dtype_from_name, dtype_name


class LayoutMismatch(TransferError):
    """The two ends of a transfer disagree on the KV layout."""


@dataclass(frozen=True)
class KVLayout:
    model_id: str
    dtype: str  # torch dtype name, "bfloat16": JSON-able and comparable across processes
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int

    def __post_init__(self) -> None:
        dtype_from_name(self.dtype)  # fail at construction on a name torch doesn't know

    @classmethod
    def of(cls, kv_caches: Sequence[torch.Tensor], model_id: str) -> KVLayout:
        """The layout of per-layer caches `[2, num_blocks, block_size, H, D]`."""
        if not kv_caches:
            raise ValueError("no KV cache layers")
        first = kv_caches[0]
        if first.dim() != 5 or first.shape[0] != 2:
            raise ValueError(f"KV cache layer is not [2, blocks, bs, H, D]: {tuple(first.shape)}")
        for i, c in enumerate(kv_caches):
            if c.shape != first.shape or c.dtype != first.dtype:
                raise ValueError(
                    f"layer {i} is {tuple(c.shape)} {c.dtype}, "
                    f"layer 0 is {tuple(first.shape)} {first.dtype}"
                )
        _, _, block_size, heads, head_dim = first.shape
        return cls(model_id, dtype_name(first.dtype), len(kv_caches), heads, head_dim, block_size)

    @property
    def torch_dtype(self) -> torch.dtype:
        return dtype_from_name(self.dtype)

    @property
    def block_bytes(self) -> int:
        """Bytes of one block of one layer, K and V together."""
        elems = 2 * self.block_size * self.num_kv_heads * self.head_dim
        return elems * self.torch_dtype.itemsize

    def staging_shape(self, num_blocks: int) -> tuple[int, int, int, int, int]:
        """Shape of one layer's gathered blocks, as it travels."""
        return (2, num_blocks, self.block_size, self.num_kv_heads, self.head_dim)

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}  # flat: no asdict walk

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> KVLayout:
        names = {f.name for f in fields(cls)}
        missing = names - d.keys()
        if missing:
            raise LayoutMismatch(f"layout is missing {sorted(missing)}")
        return cls(**{k: d[k] for k in names})

    def check(self, other: KVLayout, ours: str = "here", theirs: str = "there") -> None:
        """Raise LayoutMismatch naming every field that differs, with both values;
        `ours` and `theirs` say where each value comes from ("on the sender")."""
        if self == other:
            return
        diffs = [
            f"{f.name}: {getattr(self, f.name)!r} {ours} vs {getattr(other, f.name)!r} {theirs}"
            for f in fields(self)
            if getattr(self, f.name) != getattr(other, f.name)
        ]
        if diffs:
            raise LayoutMismatch("KV layout mismatch: " + "; ".join(diffs))
