"""Where each per-step input lies in the model runner's step buffer (one host->device
copy a step), the same offsets for every step of one shape, so a CUDA graph finds its
inputs where it was captured reading them."""

from __future__ import annotations

import functools
from dataclasses import dataclass

SECTION_ALIGN = 16  # int32s (64 bytes): where each section of a step's inputs starts


@dataclass(frozen=True)
class StepLayout:
    """Where each input of a step lies in the step buffer: sections packed one after
    another, so a CUDA graph captured for a decode batch of B rows finds its inputs at the
    same offsets every time (T = B = S there). Each section starts on a multiple of
    `SECTION_ALIGN` elements: Triton compiles a kernel once per alignment of its pointers, so
    sections at offsets that follow the step's sizes would compile new kernels in the
    middle of serving (0.1-1 s each on a cold cache)."""

    num_tokens: int  # T
    num_seqs: int  # B
    num_logits: int  # S: rows whose logits are sampled
    num_updates: int  # K: block-table entries written this step
    num_carries: int = 0  # C: input ids taken from the last launched step's tokens

    @functools.cached_property  # packed and then viewed each step: computed once
    def offsets(self) -> dict[str, tuple[int, int]]:
        t, b, s, k, c = (self.num_tokens, self.num_seqs, self.num_logits, self.num_updates,
                         self.num_carries)
        sizes = {"ids": t, "positions": t, "slots": t, "seq_lens": b, "query_start": b + 1,
                 "rows": b, "logits_rows": s, "update_at": k, "update_to": k,
                 "carry_to": c, "carry_from": c}
        out, at = {}, 0
        for name, n in sizes.items():
            out[name] = (at, at + n)
            at += -(-n // SECTION_ALIGN) * SECTION_ALIGN
        return out

    @property
    def size(self) -> int:
        return self.offsets["carry_from"][1]
