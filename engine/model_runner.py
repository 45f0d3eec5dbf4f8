"""Turns a scheduled batch into one flattened forward pass and returns sampled tokens."""

from __future__ import annotations

from collections.abc import Callable

import torch

from tandem.engine.attention import AttentionMetadata
from tandem.engine.config import CacheConfig, ModelConfig
from tandem.engine.models.llama import LlamaForCausalLM
from tandem.engine.sampler import Sampler, SamplerOutput
from tandem.engine.scheduler import ScheduledBatch


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
        free, total = torch.cuda.mem_get_info(device)
        budget = free - (1 - cache.kv_cache_memory_fraction) * total
    else:
        budget = cache.kv_cache_bytes
    blocks = int(budget // per_block)
    if blocks < 1:
        raise ValueError(f"no memory left for the KV cache ({budget / 2**20:.0f} MiB budget)")
    return blocks


class ModelRunner:
    def __init__(
        self,
        model: LlamaForCausalLM,
        num_blocks: int,
        block_size: int,
        sampler: Sampler,
    ) -> None:
        cfg = model.config
        p = next(model.parameters())
        self.model, self.sampler = model, sampler
        self.device, self.dtype, self.block_size = p.device, p.dtype, block_size
        # One tensor, a [2, num_blocks, block_size, H, D] view per layer: a KV transfer
        # gathers and scatters a run of layers in one kernel (kvtransfer/staging.py).
        shape = (cfg.num_layers, 2, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
        self.kv_caches = list(torch.zeros(shape, dtype=p.dtype, device=p.device).unbind(0))

    @torch.inference_mode()
    def run(
        self, batch: ScheduledBatch, on_layer: Callable[[int], None] | None = None
    ) -> SamplerOutput:
        """`on_layer(i)`: called once layer i's KV is written (see LlamaForCausalLM)."""
        input_ids, positions, meta, logits_rows = self._prepare(batch)
        hidden = self.model(input_ids, positions, self.kv_caches, meta, on_layer)
        sampling = batch.sampling_requests()
        if not sampling:
            return SamplerOutput([], [])
        logits = self.model.compute_logits(hidden[logits_rows])
        return self.sampler(logits.float(), sampling)

    def _prepare(
        self, batch: ScheduledBatch
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
        bs = self.block_size
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        seq_lens: list[int] = []
        query_start = [0]
        logits_rows: list[int] = []
        for i, (req, n) in enumerate(zip(batch.requests, batch.num_new_tokens)):
            start = req.num_computed_tokens
            ids += req.all_token_ids[start : start + n]
            span = range(start, start + n)
            pos += span
            slots += [req.block_ids[p // bs] * bs + p % bs for p in span]
            seq_lens.append(start + n)
            query_start.append(query_start[-1] + n)
            if batch.samples(i):
                logits_rows.append(query_start[-1] - 1)
        width = max(len(r.block_ids) for r in batch.requests)
        tables = [r.block_ids + [0] * (width - len(r.block_ids)) for r in batch.requests]

        def tensor(x: list) -> torch.Tensor:  # noqa: ANN001 - plain int lists
            return torch.tensor(x, dtype=torch.int64).to(self.device, non_blocking=True)

        meta = AttentionMetadata(tensor(slots), tensor(tables), seq_lens, query_start)
        return tensor(ids), tensor(pos), meta, tensor(logits_rows)
