"""CUDA graphs of decode-only steps: one per batch-size bucket, captured at start, so a
decode step is one host→device copy, two small table kernels and one graph launch.

A graph reads the runner's step buffer at the offsets a decode step of its bucket size
packs to (`StepLayout`), and `step_tables[:bucket]`; rows past the real batch are
padding that writes the null slot. Its attention metadata is built once, for the
longest context the engine allows, so the kernels' grids never change."""

from __future__ import annotations

import bisect

import torch
from tqdm import tqdm

from tandem.engine.attention import AttentionMetadata
from tandem.engine.model_runner import NULL_ROW, ModelRunner, StepLayout


def bucket_sizes(max_batch: int) -> list[int]:
    sizes = [b for b in (1, 2, 4, 8) if b < max_batch]
    sizes += range(16, max_batch, 16)
    return sorted(set(sizes) | {max_batch})


class DecodeGraphs:
    def __init__(self, runner: ModelRunner, max_batch: int) -> None:
        self.runner = runner
        self.sizes = bucket_sizes(max_batch)
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

    def bucket(self, n: int) -> int | None:
        """The smallest captured batch size that holds n rows; None if none does."""
        i = bisect.bisect_left(self.sizes, n)
        return self.sizes[i] if i < len(self.sizes) else None

    def replay(self, bucket: int) -> torch.Tensor:
        graph, logits = self._graphs[bucket]
        graph.replay()
        return logits  # [bucket, V]

    @torch.inference_mode()
    def capture(self, show_progress: bool = True) -> None:
        pool = torch.cuda.graph_pool_handle()
        # A capture stream of the runner's device: torch's default one is made once per
        # process, on whichever device was current then.
        stream = torch.cuda.Stream(self.runner.device)
        # Largest first: the smaller graphs reuse its memory from the shared pool.
        for size in tqdm(sorted(self.sizes, reverse=True), desc="capturing CUDA graphs",
                         disable=not show_progress):
            forward = self._forward(size)
            forward()  # warm up: Triton compiles, cuBLAS picks its kernels
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, stream=stream):
                logits = forward()
            self._graphs[size] = (graph, logits)
        torch.cuda.synchronize()

    def _forward(self, size: int):  # noqa: ANN202 - a closure over the step's views
        r = self.runner
        layout = StepLayout(size, size, size, 0)
        o = layout.offsets
        h = r._host_np
        padding = {"ids": 0, "positions": 0, "slots": r.null_block * r.block_size,
                   "seq_lens": 1, "rows": NULL_ROW}
        for name, value in padding.items():
            h[slice(*o[name])] = value
        h[slice(*o["query_start"])] = range(size + 1)
        h[slice(*o["logits_rows"])] = range(size)
        views = r._upload(layout)
        meta = AttentionMetadata(
            slot_mapping=views["slots"], block_tables=r.step_tables[:size],
            seq_lens=views["seq_lens"], query_start=views["query_start"],
            max_query_len=1, max_seq_len=r.max_model_len,
        )
        state = r.attention.build(meta)

        def forward() -> torch.Tensor:
            hidden = r.model(views["ids"], views["positions"], r.kv_caches, state)
            return r.model.compute_logits(hidden)

        return forward
