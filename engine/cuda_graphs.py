"""CUDA graphs of the steps whose launches cost more than their compute, captured at
start, so such a step is one host→device copy, two small table kernels and one graph
launch:
- decode-only steps, one graph per batch-size bucket (`DecodeGraphs`);
- steps that compute one prompt's tokens (a prompt, or a chunk of one) and nothing else,
  one graph per token-count bucket (`PrefillGraphs`). At Llama-3-8B's shape a step of a
  few hundred tokens takes longer to launch from Python than to run, and a thread beside
  the engine's (a KV push) slows the launches further;
- every other step of several sequences (prompts admitted beside running decodes, chunks
  of several prompts), one graph per token-count bucket, each for every sequence the
  engine may step at once (`MixedGraphs`). At small shapes such a step took 11-40 ms to
  launch eagerly, and a burst's admission is a run of them.

A graph reads the runner's step buffer at the offsets its bucket's layout packs to
(`StepLayout`), and `step_tables[:rows]`. Padding writes the null slot: the rows past a
decode batch, and in a prefill or mixed graph a sequence holding the tokens past the
step's; a mixed graph's sequences past that one are empty (no query, no context). Its
attention metadata is fixed at capture (the longest context the engine allows; a prefill
or mixed graph's query length is its bucket), so the kernels' grids never change: they
read the real lengths from the buffer."""

from __future__ import annotations

import bisect
import functools
from collections.abc import Callable

import torch
from tqdm import tqdm

from tandem.engine.attention import AttentionMetadata
from tandem.engine.model_runner import NULL_ROW, ModelRunner
from tandem.engine.step_layout import StepLayout

# Prefill graphs go up to this many tokens: past it a step's compute dwarfs its launches.
PREFILL_GRAPH_MAX_TOKENS = 2048


def bucket_sizes(max_batch: int) -> list[int]:
    sizes = [b for b in (1, 2, 4, 8) if b < max_batch]
    sizes += range(16, max_batch, 16)
    return sorted(set(sizes) | {max_batch})


def prefill_sizes(max_tokens: int) -> list[int]:
    """Powers of two from 16 to 256, then every 128 tokens: a step of a few hundred
    tokens and more is compute-bound, so it is padded by less than 128."""
    top = min(max_tokens, PREFILL_GRAPH_MAX_TOKENS)
    sizes = [t for t in (16, 32, 64, 128, 256) if t < top]
    sizes += range(384, top, 128)
    return sorted(set(sizes) | {top}) if top > 1 else []


class _Graphs:
    """One graph per size, sharing one memory pool (replayed one at a time, on the
    runner's stream, so they may). On a CPU runner (tests) each size's forward is kept
    and run eagerly: the very work a graph would replay, its layout included."""

    desc = ""
    # Rows of logits a replay returns: every row of the layout that has them, or the first n.
    logits_kept: int | None = None

    def __init__(self, runner: ModelRunner, sizes: list[int]) -> None:
        self.runner = runner
        self.sizes = sizes
        self._replays: dict[int, Callable[[], torch.Tensor]] = {}

    def bucket(self, n: int) -> int | None:
        """The smallest captured size that holds n; None if none does."""
        i = bisect.bisect_left(self.sizes, n)
        return self.sizes[i] if i < len(self.sizes) else None

    def replay(self, bucket: int) -> torch.Tensor:
        return self._replays[bucket]()  # [rows with logits (or logits_kept of them), V]

    @torch.inference_mode()
    def capture(self, pool: tuple[int, int] | None, show_progress: bool = True) -> None:
        cuda = self.runner.device.type == "cuda"
        # A capture stream of the runner's device: torch's default one is made once per
        # process, on whichever device was current then.
        stream = torch.cuda.Stream(self.runner.device) if cuda else None
        # Largest first: the smaller graphs reuse its memory from the shared pool.
        for size in tqdm(sorted(self.sizes, reverse=True), desc=self.desc,
                         disable=not show_progress):
            forward = self._forward(size)
            if not cuda:
                self._replays[size] = forward
                continue
            forward()  # warm up: Triton compiles, cuBLAS picks its kernels
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, stream=stream):
                logits = forward()
            self._replays[size] = functools.partial(_replay, graph, logits)
        if cuda:
            torch.cuda.synchronize()

    def _forward(self, size: int) -> Callable[[], torch.Tensor]:
        r = self.runner
        layout, columns, max_query_len = self._fill(size)
        h, o = r._host_np, layout.offsets
        for name, values in columns.items():
            h[slice(*o[name])] = values
        views = r._upload(layout)
        meta = AttentionMetadata(
            slot_mapping=views["slots"], block_tables=r.step_tables[: layout.num_seqs],
            seq_lens=views["seq_lens"], query_start=views["query_start"],
            max_query_len=max_query_len, max_seq_len=r.max_model_len,
        )

        def forward() -> torch.Tensor:
            # Built in the forward, as a step builds it: the torch backend (a CPU runner's)
            # reads the lengths from the buffer here; the triton one only host ints.
            state = r.attention.build(meta)
            hidden = r.model(views["ids"], views["positions"], r.kv_caches, state)
            if layout.num_logits != layout.num_tokens:
                hidden = hidden[views["logits_rows"]]
            return r.model.compute_logits(hidden[: self.logits_kept])

        return forward

    def _fill(self, size: int) -> tuple[StepLayout, dict[str, object], int]:
        """The layout a step of `size` packs to, values for its inputs while capturing
        (any that keep every index in range), and the query length it is captured for."""
        raise NotImplementedError


class DecodeGraphs(_Graphs):
    desc = "capturing decode graphs"

    def __init__(self, runner: ModelRunner, max_batch: int) -> None:
        super().__init__(runner, bucket_sizes(max_batch))

    def _fill(self, size: int) -> tuple[StepLayout, dict[str, object], int]:
        r = self.runner
        columns = {"ids": 0, "positions": 0, "slots": r.null_block * r.block_size,
                   "seq_lens": 1, "rows": NULL_ROW, "query_start": range(size + 1),
                   "logits_rows": range(size)}
        return StepLayout(size, size, size, 0), columns, 1


class PrefillGraphs(_Graphs):
    """A step of one request computing n > 1 tokens, padded to a bucket of T tokens:
    the request is sequence 0, the T - n padding tokens sequence 1 (on the null row),
    and both sequences' last tokens get logits rows (`ModelRunner._pack_prefill`), of
    which only the request's is computed: a single row, as the eager step of that request
    computes it (FP8's single-row logits differ from its batched ones)."""

    desc = "capturing prefill graphs"
    logits_kept = 1

    def __init__(self, runner: ModelRunner, max_tokens: int) -> None:
        super().__init__(runner, prefill_sizes(max_tokens))

    def _fill(self, size: int) -> tuple[StepLayout, dict[str, object], int]:
        r = self.runner
        half = size // 2
        columns = {"ids": 0, "positions": 0, "slots": r.null_block * r.block_size,
                   "seq_lens": [half, size - half], "rows": NULL_ROW,
                   "query_start": [0, half, size], "logits_rows": [half - 1, size - 1]}
        return StepLayout(size, 2, 2, 0), columns, size


class MixedGraphs(_Graphs):
    """A step of n > 1 sequences that is not decode-only, padded to a bucket of T tokens
    and to `seqs` sequences (`ModelRunner._pack`'s `seqs_to`): the tokens past the step's
    are one padding sequence on the null row, the sequences past it empty, and the step's
    sampling rows come first among the `seqs` logits rows. Its attention grid is one of
    `seqs` sequences and T queries whatever the step holds: the programs of empty
    sequences and of query tiles past a sequence's end return at once."""

    desc = "capturing mixed graphs"

    def __init__(self, runner: ModelRunner, max_tokens: int, max_seqs: int) -> None:
        super().__init__(runner, prefill_sizes(max_tokens))
        self.seqs = max_seqs + 1  # the step's, and the padding sequence

    def _fill(self, size: int) -> tuple[StepLayout, dict[str, object], int]:
        r, s, half = self.runner, self.seqs, size // 2
        columns = {"ids": 0, "positions": 0, "slots": r.null_block * r.block_size,
                   "seq_lens": [half, size - half] + [0] * (s - 2), "rows": NULL_ROW,
                   "query_start": [0, half] + [size] * (s - 1),
                   "logits_rows": [half - 1] + [size - 1] * (s - 1)}
        return StepLayout(size, s, s, 0), columns, size


def _replay(graph: torch.cuda.CUDAGraph, logits: torch.Tensor) -> torch.Tensor:
    graph.replay()
    return logits


def capture_graphs(runner: ModelRunner, max_batch: int, max_tokens: int,
                   show_progress: bool = True, mixed: bool = False) -> None:
    """Capture the kinds into one pool and hand them to the runner (`mixed`: mixed graphs
    too). `max_batch`: the most sequences a step holds."""
    pool = torch.cuda.graph_pool_handle() if runner.device.type == "cuda" else None
    if mixed:
        runner.mixed_graphs = MixedGraphs(runner, max_tokens,
                                          min(max_batch, runner.max_num_tokens - 1))
        runner.mixed_graphs.capture(pool, show_progress)  # the largest graphs first
    prefill = PrefillGraphs(runner, max_tokens)
    prefill.capture(pool, show_progress)
    decode = DecodeGraphs(runner, max_batch)
    decode.capture(pool, show_progress)
    runner.graphs, runner.prefill_graphs = decode, prefill
