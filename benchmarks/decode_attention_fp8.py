"""The decode attention kernel over an FP8 KV cache against a bf16 one, on the GPU.

Llama-3-8B's heads (Hq 32, Hkv 8, D 128), bf16 q, a few batch x context shapes: the
bf16 cache; the FP8 cache with the products in bf16 (the tiles widened to q's dtype);
the FP8 cache with the products in fp16 (`fp16_dots`: q scaled first). Each at a few
tiles, timed in CUDA graphs over more caches than L2 holds, in KV bytes read a second;
each FP8 variant's largest difference from the torch reference. One JSON.

    python benchmarks/decode_attention_fp8.py --json results/decode_attention_fp8_<kind>.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import time
from pathlib import Path
from typing import Any

import torch
import triton
from test_kernel_decode_attention import PAGE, make_inputs

from tandem.kernels import decode_attention as kernel_module
from tandem.kernels.decode_attention import (
    choose_num_splits,
    decode_attention,
    decode_attention_ref,
)
from tandem.kernels.kv_store import FP8

SHAPES = ((128, 576), (64, 1024), (32, 2048), (1, 8192))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kind", default=None, help="the machine's label, put in the JSON")
    p.add_argument("--json", type=Path, default=None, help="write the figures here")
    args = p.parse_args()
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    scale = 128**-0.5
    figures: list[dict[str, Any]] = []
    for batch, length in SHAPES:
        tokens = batch * length * 8 * 128 * 2  # K and V values read
        copies = -(-(256 << 20) // tokens)
        inputs = [make_inputs([length] * batch, 4, 128, 8, torch.bfloat16, "cuda", seed)
                  for seed in range(copies)]
        fp8_inputs = [(q, kv.to(FP8), t, s) for q, kv, t, s in inputs]
        splits = choose_num_splits(batch, 8, length, PAGE, num_sms)
        q, kv8, tables, seq_lens = fp8_inputs[0]
        want = decode_attention_ref(q, kv8, tables, seq_lens, scale).float()
        for (name, caches, f16), tile in itertools.product(
                (("bf16", inputs, False), ("fp8", fp8_inputs, False),
                 ("fp8_f16_dots", fp8_inputs, True)),
                ((128, 3), (64, 3), (64, 2))):
            kernel_module._tile = lambda dtype, t=tile: t  # noqa: ARG005

            def run(caches: list = caches, f16: bool = f16, splits: int = splits) -> None:
                for q, kv, t, s in caches:
                    decode_attention(q, kv, t, s, scale, splits, fp16_dots=f16)

            us = triton.testing.do_bench_cudagraph(run) * 1e3 / copies
            fig = {"batch": batch, "context": length, "splits": splits, "cache": name,
                   "block_n": tile[0], "stages": tile[1], "us": us,
                   "tb_s": tokens * (1 if caches is fp8_inputs else 2) / us / 1e6}
            if caches is fp8_inputs:
                got = decode_attention(q, kv8, tables, seq_lens, scale, splits, fp16_dots=f16)
                fig["max_error"] = float((got.float() - want).abs().max())
            print(json.dumps(fig), flush=True)
            figures.append(fig)
    out = {"kind": args.kind, "device": torch.cuda.get_device_name(),
           "date": time.strftime("%Y-%m-%d"), "figures": figures}
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
