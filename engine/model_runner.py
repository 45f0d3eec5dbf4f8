"""Turns a scheduled batch into one forward pass over persistent device state and returns
sampled tokens.

Allocated once, updated in place:
- the KV cache, with one block more than the pool hands out: the null block, which
  padded rows write to and read from and nobody owns;
- a device block table `[rows, W]`: a request keeps its row while it runs, and only
  the blocks it gained since its last step are written into it; row 0 is all null;
- one host buffer (pinned on CUDA) and its device twin holding every per-step input
  (`StepLayout`): one host→device copy per step.
Decode-only steps, steps that compute one prompt's tokens, and the other steps of
several sequences replay a CUDA graph (`cuda_graphs.py`) where one is captured.

`launch` starts a step without waiting for it (async scheduling): its tokens stay on the
device, and the next step's inputs take them from there (`carry_*`), so the host
prepares step N+1 while the GPU computes step N.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from tandem.engine.attention import AttentionBackend, AttentionMetadata
from tandem.engine.models.llama import LlamaForCausalLM
from tandem.engine.request import PENDING_TOKEN, Request
from tandem.engine.sampler import Sampler, SamplerOutput
from tandem.engine.scheduler import ScheduledBatch
from tandem.engine.step_layout import SECTION_ALIGN, StepLayout

if TYPE_CHECKING:
    from tandem.engine.cuda_graphs import _Graphs

NULL_ROW = 0


@dataclass(eq=False)
class SampledTokens:
    """A launched step's tokens, one per sampling request, on their way to the host."""

    host: torch.Tensor  # [S] int32, filled once `ready` has passed
    ready: torch.cuda.Event | None  # None on the CPU: the copy is done

    def result(self) -> list[int]:
        """Waits for the step (only that step) and returns its tokens."""
        if self.ready is not None:
            self.ready.synchronize()
        return self.host.tolist()


@dataclass(eq=False)
class _Row:
    index: int
    num_synced: int  # leading block ids written into the device table
    num_preemptions: int  # a preemption gives the request new blocks: resync
    num_nulled: int = 0  # leading entries pointed at the null block (given back)


class ModelRunner:
    def __init__(
        self,
        model: LlamaForCausalLM,
        attention: AttentionBackend,
        sampler: Sampler,
        num_blocks: int,
        block_size: int,
        max_num_seqs: int,
        max_num_tokens: int,
        max_model_len: int,
        kv_dtype: torch.dtype | None = None,  # None: the parameters' dtype
    ) -> None:
        cfg = model.config
        p = next(model.parameters())
        self.model, self.attention, self.sampler = model, attention, sampler
        self.device, self.dtype, self.block_size = p.device, p.dtype, block_size
        self.max_model_len = max_model_len
        self.max_num_tokens = max_num_tokens
        # One tensor, a [2, num_blocks + 1, block_size, H, D] view per layer: a KV transfer
        # gathers and scatters a run of layers in one kernel (kvtransfer/staging.py).
        self.null_block = num_blocks
        shape = (cfg.num_layers, 2, num_blocks + 1, block_size, cfg.num_kv_heads, cfg.head_dim)
        kv_dtype = kv_dtype or p.dtype
        self.kv_caches = list(torch.zeros(shape, dtype=kv_dtype, device=p.device).unbind(0))

        self.width = -(-max_model_len // block_size)  # W: table columns
        i32 = {"dtype": torch.int32, "device": self.device}
        self.table = torch.full((max_num_seqs + 1, self.width), self.null_block, **i32)
        self._rows: dict[str, _Row] = {}
        self._free_rows = list(range(self.table.shape[0] - 1, NULL_ROW, -1))
        # A step's block tables, gathered from the rows it uses: [max tokens, W].
        self.step_tables = torch.empty((max_num_tokens, self.width), **i32)
        cap = StepLayout(max_num_tokens, max_num_tokens, max_num_tokens, 0, max_num_tokens).size
        # A step's table updates beyond this take a copy of their own (_write_updates),
        # rare past the table's size; not sized by the blocks alone (a tiny model's KV
        # on a large card is tens of millions of blocks: a buffer of GBs, pinned).
        self._update_capacity = max(4096, min(2 * num_blocks, self.table.numel()))
        cap += 2 * (self._update_capacity + SECTION_ALIGN)
        pinned = self.device.type == "cuda"
        self.host = torch.zeros(cap, dtype=torch.int32, pin_memory=pinned)
        self._host_np = self.host.numpy()
        self._count = np.arange(max_num_tokens + 1, dtype=np.int32)  # 0, 1, 2, ...
        self.buffer = self.host if self.device.type == "cpu" else torch.zeros(cap, **i32)
        # The last upload has left the host buffer (set on CUDA after each copy).
        self._uploaded: torch.cuda.Event | None = None
        self._views: dict[StepLayout, dict[str, torch.Tensor]] = {}  # by layout, of buffer
        # cuda_graphs.DecodeGraphs, PrefillGraphs and MixedGraphs, set by capture_graphs.
        self.graphs = None
        self.prefill_graphs = None
        self.mixed_graphs = None
        # Steps run since start, by how: a decode graph, a graph of a step with prompt
        # tokens (a prefill graph or a mixed one), or eagerly.
        self.steps = {"decode_graph": 0, "prefill_graph": 0, "eager": 0}
        # The last launched step's tokens on the device, the row of each request among
        # them, and two host buffers they are copied to in turn (a step is read back
        # while the next one's copy may already be queued).
        self.sampled = torch.zeros(max_num_tokens, **i32)
        self._sampled_rows: dict[str, int] = {}
        self._sampled_host = [torch.zeros(max_num_tokens, dtype=torch.int32, pin_memory=pinned)
                              for _ in range(2)]
        self._turn = 0

    # --- rows of the persistent block table -------------------------------------------

    def release(self, request_id: str) -> None:
        """The request left the engine: its table row is free again."""
        row = self._rows.pop(request_id, None)
        if row is not None:
            self._free_rows.append(row.index)

    def _row(self, req: Request, updates: list[tuple[int, int]]) -> int:
        row = self._rows.get(req.request_id)
        if row is None:
            if not self._free_rows:
                self._grow_table()
            row = self._rows[req.request_id] = _Row(self._free_rows.pop(), 0, 0)
        if row.num_preemptions != req.num_preemptions:
            row.num_synced, row.num_nulled, row.num_preemptions = 0, 0, req.num_preemptions
        blocks = req.block_ids
        base = row.index * self.width
        if len(blocks) > row.num_synced:
            updates.extend(
                (base + j, blocks[j]) for j in range(row.num_synced, len(blocks))
            )
            row.num_synced = len(blocks)
        if req.num_released_blocks > row.num_nulled:  # given back: may be another's now
            updates.extend((base + j, self.null_block)
                           for j in range(row.num_nulled, req.num_released_blocks))
            row.num_nulled = req.num_released_blocks
        return row.index

    def _grow_table(self) -> None:
        # More requests hold a row than max_num_seqs (preempted requests keep theirs while
        # a decode node's reserved ones run): double the rows; the graphs read
        # step_tables, not this.
        old = self.table
        self.table = torch.full((2 * old.shape[0], self.width), self.null_block,
                                dtype=torch.int32, device=self.device)
        self.table[: old.shape[0]] = old
        self._free_rows.extend(range(self.table.shape[0] - 1, old.shape[0] - 1, -1))

    # --- one step -------------------------------------------------------------------

    @torch.inference_mode()
    def run(
        self,
        batch: ScheduledBatch,
        sampling: list[Request],
        on_layer: Callable[[int], None] | None = None,
        layerwise: bool = True,
    ) -> SamplerOutput:
        """`sampling`: `batch.sampling_requests()`, before the step advances any count.
        `on_layer(i)`: called once layer i's KV is written (see LlamaForCausalLM); if not
        `layerwise`, it may be called for every layer once the last is written (after a
        graph's replay)."""
        logits = self._forward(batch, sampling, on_layer, layerwise)
        if logits is None:
            return SamplerOutput([], [])
        return self.sampler(logits, sampling)

    @torch.inference_mode()
    def launch(self, batch: ScheduledBatch, sampling: list[Request],
               on_layer: Callable[[int], None] | None = None) -> SampledTokens:
        """Queue the step and return at once; every request in `sampling` must sample
        `on_device`. The next step may use its tokens before the host has read them:
        a request whose newest token is PENDING_TOKEN gets it from this step.
        `on_layer`: as `run`'s, not layerwise."""
        logits = self._forward(batch, sampling, on_layer, False)
        n = len(sampling)
        host = self._sampled_host[self._turn][:n]
        self._turn ^= 1
        ready = None
        if n:
            self.sampled[:n].copy_(self.sampler.sample(logits, sampling))
            host.copy_(self.sampled[:n], non_blocking=True)
            if self.device.type == "cuda":
                ready = torch.cuda.Event()
                ready.record()
        self._sampled_rows = {req.request_id: i for i, req in enumerate(sampling)}
        return SampledTokens(host, ready)

    def _forward(
        self,
        batch: ScheduledBatch,
        sampling: list[Request],
        on_layer: Callable[[int], None] | None,
        layerwise: bool,
    ) -> torch.Tensor | None:
        """The logits of the sampling rows, [len(sampling), V]; None if none sample."""
        n = len(batch.requests)
        decode_only = batch.num_tokens == n == len(sampling)
        graph = (None if decode_only or (on_layer is not None and layerwise)
                 else self._prompt_graph(batch))
        if graph is not None:
            graphs, bucket, seqs = graph
            self._upload(self._pack(batch, pad_to=n, prefill_to=bucket, seqs_to=seqs)[0])
            self.steps["prefill_graph"] += 1
            logits = graphs.replay(bucket)[: len(sampling)]  # the sampling rows come first
            if on_layer is not None:
                for i in range(self.model.config.num_layers):
                    on_layer(i)
            return logits if sampling else None
        bucket = None
        if self.graphs is not None and on_layer is None and decode_only:
            bucket = self.graphs.bucket(n)
        layout, max_seq_len = (self._pack_decodes(batch.requests, bucket or n) if decode_only
                               else self._pack(batch, pad_to=bucket or n))
        views = self._upload(layout)
        if bucket is not None:
            self.steps["decode_graph"] += 1
            return self.graphs.replay(bucket)[:n]
        self.steps["eager"] += 1
        meta = AttentionMetadata(
            slot_mapping=views["slots"], block_tables=self.step_tables[: layout.num_seqs],
            seq_lens=views["seq_lens"], query_start=views["query_start"],
            max_query_len=max(batch.num_new_tokens), max_seq_len=max_seq_len,
        )
        state = self.attention.build(meta)
        hidden = self.model(views["ids"], views["positions"], self.kv_caches, state, on_layer)
        if not sampling:
            return None
        if layout.num_logits != layout.num_tokens:
            hidden = hidden[views["logits_rows"]]
        return self.model.compute_logits(hidden)

    def _prompt_graph(self, batch: ScheduledBatch) -> tuple[_Graphs, int, int] | None:
        """For a step with prompt tokens: the prefill graph (one request) or the mixed
        graph (several) whose bucket holds it, that bucket, and the sequences the graph
        lays out (`_pack`'s `seqs_to`; 0 for a prefill graph); None if none does."""
        n, mixed = len(batch.requests), self.mixed_graphs
        if n == 1 and self.prefill_graphs is not None and batch.num_tokens > 1:
            graphs, seqs = self.prefill_graphs, 0
        elif n > 1 and mixed is not None and n < mixed.seqs:
            graphs, seqs = mixed, mixed.seqs
        else:
            return None
        bucket = graphs.bucket(batch.num_tokens)
        return None if bucket is None else (graphs, bucket, seqs)

    def _pack(self, batch: ScheduledBatch, pad_to: int, prefill_to: int = 0,
              seqs_to: int = 0) -> tuple[StepLayout, int]:
        """Write the step's inputs into the host buffer; rows past the batch, up to
        `pad_to`, are padding (a decode graph's bucket). `prefill_to` (a prefill or mixed
        graph's bucket): the tokens past the step's, up to it, are a padding sequence on
        the null row; for a prefill graph (a step of one request) both sequences' last
        tokens get logits; for a mixed one, `seqs_to` sequences (the rest empty) and as
        many logits rows, the step's sampling rows first. Returns the layout and the
        longest context."""
        bs = self.block_size
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        seq_lens: list[int] = []
        query_start = [0]
        rows: list[int] = []
        logits_rows: list[int] = []
        updates: list[tuple[int, int]] = []
        carries: list[tuple[int, int]] = []  # (index in ids, row in the last launch)
        known, sampled_rows = self._rows, self._sampled_rows
        for req, n in zip(batch.requests, batch.num_new_tokens):
            start = req.num_computed_tokens
            blocks = req.block_ids
            row = known.get(req.request_id)
            if (row is not None and row.num_synced == len(blocks)
                    and row.num_preemptions == req.num_preemptions
                    and row.num_nulled >= req.num_released_blocks):
                rows.append(row.index)  # a decode's row, its table entries all written
            else:
                rows.append(self._row(req, updates))
            prompt_len = len(req.prompt_token_ids)
            if n == 1:
                token = (req.prompt_token_ids[start] if start < prompt_len
                         else req.output_token_ids[start - prompt_len])
                if token == PENDING_TOKEN:
                    carries.append((len(ids), sampled_rows[req.request_id]))
                    token = 0
                ids.append(token)
                pos.append(start)
                slots.append(blocks[start // bs] * bs + start % bs)
            else:
                p = np.arange(start, start + n)
                ids += req.all_token_ids[start : start + n]
                assert ids[-1] != PENDING_TOKEN, "a prefill reads a pending token"
                pos += range(start, start + n)
                slots += (np.asarray(blocks)[p // bs] * bs + p % bs).tolist()
            end = query_start[-1] + n
            seq_lens.append(start + n)
            query_start.append(end)
            if start + n == prompt_len + len(req.output_token_ids):
                logits_rows.append(end - 1)
        max_seq_len = max(seq_lens)
        for _ in range(pad_to - len(rows)):
            ids.append(0)
            pos.append(0)
            slots.append(self.null_block * bs)
            seq_lens.append(1)
            query_start.append(query_start[-1] + 1)
            rows.append(NULL_ROW)
            logits_rows.append(query_start[-1] - 1)
        if prefill_to:
            pad = prefill_to - len(ids)
            ids += [0] * pad
            pos += range(pad)
            slots += [self.null_block * bs] * pad
            seq_lens.append(pad)
            query_start.append(prefill_to)
            rows.append(NULL_ROW)
            if not seqs_to:
                logits_rows = [query_start[1] - 1, prefill_to - 1]
            else:
                empty = seqs_to - len(rows)
                seq_lens += [0] * empty
                query_start += [prefill_to] * empty
                rows += [NULL_ROW] * empty
                logits_rows += [prefill_to - 1] * (seqs_to - len(logits_rows))
        if len(updates) > self._update_capacity:
            self._write_updates(updates[self._update_capacity :])
            updates = updates[: self._update_capacity]
        layout = StepLayout(len(ids), len(rows), len(logits_rows), len(updates), len(carries))
        h, o = self._host_np, layout.offsets
        if self._uploaded is not None:
            self._uploaded.synchronize()  # the last copy has read the buffer
        for name, values in (("ids", ids), ("positions", pos), ("slots", slots),
                             ("seq_lens", seq_lens), ("query_start", query_start),
                             ("rows", rows), ("logits_rows", logits_rows)):
            a, b = o[name]
            h[a:b] = values
        if updates:
            at, to = zip(*updates)
            h[slice(*o["update_at"])] = at
            h[slice(*o["update_to"])] = to
        if carries:
            to, at = zip(*carries)
            h[slice(*o["carry_to"])] = to
            h[slice(*o["carry_from"])] = at
        return layout, max_seq_len

    def _pack_decodes(self, reqs: list[Request], pad_to: int) -> tuple[StepLayout, int]:
        """`_pack` for a step where every request computes one token, its newest, and
        samples (a decode): the same inputs, but as arrays, with one pass per field rather than
        one Python iteration per request and field (a decode step's host time went
        mostly to that loop)."""
        n, bs, known = len(reqs), self.block_size, self._rows
        updates: list[tuple[int, int]] = []
        rows = [row.index if ((row := known.get(r.request_id)) is not None
                              and row.num_synced == len(r.block_ids)
                              and row.num_preemptions == r.num_preemptions
                              and row.num_nulled >= r.num_released_blocks)
                else self._row(r, updates) for r in reqs]
        starts = [r.num_computed_tokens for r in reqs]
        slots = [r.block_ids[s // bs] * bs + s % bs for r, s in zip(reqs, starts)]
        # A decode computes its request's newest token: the prompt's last if none is out.
        ids = np.array([(r.output_token_ids or r.prompt_token_ids)[-1] for r in reqs])
        pending = np.flatnonzero(ids == PENDING_TOKEN)
        if len(pending):
            sampled_rows = self._sampled_rows
            carry_from = [sampled_rows[reqs[i].request_id] for i in pending.tolist()]
            ids[pending] = 0
        if len(updates) > self._update_capacity:
            self._write_updates(updates[self._update_capacity :])
            updates = updates[: self._update_capacity]
        t = pad_to  # rows past n: padding on the null row
        layout = StepLayout(t, t, t, len(updates), len(pending))
        h, o, count = self._host_np, layout.offsets, self._count
        if self._uploaded is not None:
            self._uploaded.synchronize()  # the last copy has read the buffer
        pos = np.array(starts)
        for name, values, pad in (("ids", ids, 0), ("positions", pos, 0),
                                  ("slots", slots, self.null_block * bs),
                                  ("seq_lens", pos + 1, 1), ("rows", rows, NULL_ROW)):
            a = o[name][0]
            h[a : a + n] = values
            h[a + n : a + t] = pad
        a, b = o["query_start"]
        h[a:b] = count[: t + 1]
        a, b = o["logits_rows"]
        h[a:b] = count[:t]
        if updates:
            at, to = zip(*updates)
            h[slice(*o["update_at"])] = at
            h[slice(*o["update_to"])] = to
        if len(pending):
            h[slice(*o["carry_to"])] = pending
            h[slice(*o["carry_from"])] = carry_from
        return layout, max(starts) + 1

    def _upload(self, layout: StepLayout) -> dict[str, torch.Tensor]:
        """One host→device copy, then the table entries and the step's table rows."""
        size = layout.size
        if self.buffer is not self.host:
            self.buffer[:size].copy_(self.host[:size], non_blocking=True)
            if self._uploaded is None:
                self._uploaded = torch.cuda.Event()
            self._uploaded.record()
        views = self._views.get(layout)
        if views is None:  # a decode step's layout repeats: its views are made once
            if len(self._views) >= 1024:
                self._views.clear()
            views = self._views[layout] = {name: self.buffer[a:b]
                                           for name, (a, b) in layout.offsets.items()}
        if layout.num_updates:
            self.table.view(-1)[views["update_at"]] = views["update_to"]
        if layout.num_carries:
            views["ids"][views["carry_to"]] = self.sampled[views["carry_from"]]
        torch.index_select(self.table, 0, views["rows"],
                           out=self.step_tables[: layout.num_seqs])
        return views

    def _write_updates(self, updates: list[tuple[int, int]]) -> None:
        # More new table entries than the step buffer holds (many requests sharing a long
        # cached prefix admitted at once): a separate, synchronous copy.
        at, to = zip(*updates)
        flat = self.table.view(-1)
        flat[torch.tensor(at, device=self.device)] = torch.tensor(
            to, dtype=torch.int32, device=self.device
        )
