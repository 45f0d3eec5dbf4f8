"""How many KV blocks an engine gets: a block's bytes over every layer, and on CUDA this
process's share of the device, sized from the share (other nodes may be placed on the
same device), never from what happens to be free while a neighbour loads."""

from __future__ import annotations

import gc
import logging
import time

import torch

from tandem.engine.config import CacheConfig, ModelConfig

log = logging.getLogger(__name__)


def kv_block_bytes(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * config.num_layers * block_size * config.num_kv_heads * config.head_dim * elem


def num_kv_blocks(
    config: ModelConfig, cache: CacheConfig, dtype: torch.dtype, device: torch.device
) -> int:
    if cache.num_blocks is not None:
        return cache.num_blocks
    per_block = kv_block_bytes(config, cache.block_size, dtype)
    if device.type == "cuda":
        budget = _cuda_kv_budget(cache.kv_cache_memory_fraction, device)
    else:
        budget = cache.kv_cache_bytes
    blocks = int(budget // per_block) - 1  # one more is the null block
    if blocks < 1:
        raise ValueError(f"no memory left for the KV cache ({budget / 2**20:.0f} MiB budget)")
    return blocks


# What a CUDA process holds outside PyTorch's allocator (its context, cuBLAS and NCCL
# workspaces, CUDA graphs' pools beyond the allocator's): kept out of the KV budget.
NON_TORCH_BYTES = 1 << 30
_NEIGHBOUR_WAIT_S = 120.0  # a neighbour loading its weights may hold more for this long


def _cuda_kv_budget(fraction: float, device: torch.device) -> int:
    """This process's share of the device (`fraction`: other nodes placed on it hold
    theirs) less what it holds already, sized from the share, never from what happens
    to be free while a neighbour loads. What loading left in the caching allocator is
    released first, and so is an engine of this process that nothing reaches any more
    (its cycles wait for a collection: an `LLM` dropped before the next is built). If the
    device has less free than that (a neighbour still loading, or holding more than its
    share), wait a while for it, then take what is free."""
    gc.collect()
    torch.cuda.empty_cache()
    total = torch.cuda.mem_get_info(device)[1]
    budget = int(fraction * total) - torch.cuda.memory_reserved(device) - NON_TORCH_BYTES
    deadline = time.monotonic() + _NEIGHBOUR_WAIT_S
    while (free := torch.cuda.mem_get_info(device)[0]) < budget:
        if time.monotonic() > deadline:
            log.warning("%.1f GiB free on %s, under this node's share (%.1f GiB): the KV "
                        "cache takes what is free", free / 2**30, device, budget / 2**30)
            return free - (256 << 20)
        time.sleep(1.0)
    return budget
