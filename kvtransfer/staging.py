"""Gather a request's scattered KV blocks into one contiguous staging buffer per layer,
and scatter a received one back into the sink's block ids.

One indexing op each way (torch reference; a Triton kernel may replace it), so a layer
travels as one message however many blocks it has. Works on any device.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import torch


def _index(block_ids: Sequence[int] | torch.Tensor, device: torch.device) -> torch.Tensor:
    return torch.as_tensor(block_ids, dtype=torch.long, device=device)


def gather_blocks(
    layer_cache: torch.Tensor,
    block_ids: Sequence[int] | torch.Tensor,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """layer_cache: [2, num_blocks, bs, H, D] -> contiguous [2, n, bs, H, D], in the order
    of `block_ids`. `out`, if given, is reused (its shape must be [2, n, bs, H, D])."""
    idx = _index(block_ids, layer_cache.device)
    if out is None:
        return torch.index_select(layer_cache, 1, idx)
    return torch.index_select(layer_cache, 1, idx, out=out)


def scatter_blocks(
    layer_cache: torch.Tensor,
    block_ids: Sequence[int] | torch.Tensor,
    staged: torch.Tensor,
) -> None:
    """Write staged[:, i] into block block_ids[i] of layer_cache; no other block changes.
    block_ids must be distinct (a repeated id would be written in no defined order)."""
    # staged: [2, n, bs, H, D]
    n = len(block_ids)
    want = (2, n, *layer_cache.shape[2:])
    if tuple(staged.shape) != want or staged.dtype != layer_cache.dtype:
        raise ValueError(
            f"staged {tuple(staged.shape)} {staged.dtype} does not fit {n} blocks of "
            f"{tuple(layer_cache.shape)} {layer_cache.dtype}"
        )
    idx = _index(block_ids, layer_cache.device)
    layer_cache.index_copy_(1, idx, staged.to(layer_cache.device))


class StagingPool:
    """Reusable receive buffers, so a layer does not land in freshly mapped memory
    (first-touch page faults cost more than the copy on CPU). A buffer is handed out
    by `take` and comes back by `give` only after its frame was scattered, so two frames
    in flight never share memory whatever the connector's threading. Thread-safe."""

    def __init__(self, keep: int = 8) -> None:
        self._keep = keep  # spare buffers kept in all, most recently returned first
        self._spare: list[torch.Tensor] = []
        self._lock = threading.Lock()

    def take(
        self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        with self._lock:
            for i, t in enumerate(self._spare):
                if tuple(t.shape) == shape and t.dtype == dtype and t.device == device:
                    return self._spare.pop(i)
        return torch.empty(shape, dtype=dtype, device=device)

    def give(self, t: torch.Tensor) -> None:
        with self._lock:
            self._spare.insert(0, t)
            del self._spare[self._keep:]
