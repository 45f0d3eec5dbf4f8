"""The fused MoE kernel's tiles (`kernels/fused_moe.tiles`) against others, on the GPU:
Qwen3-30B-A3B's expert shape (128 experts of 768, 8 a token, hidden 2,048), bf16, at a
few token counts; each config's time for one layer's experts (both grouped GEMMs, with
the routing and alignment), and the bytes-read limit at the decode sizes.

    python benchmarks/moe_tiles.py [--tokens 1,8,64,2048] [--json out.json]
"""

from __future__ import annotations

import argparse
import itertools
import json
from functools import partial

import torch

from tandem.kernels import fused_moe as fm


def run(x, logits, gate_up, down, top_k, tile):  # noqa: ANN001, ANN201
    return fm.fused_moe(x, logits, gate_up, down, top_k, True, tile=tile)


def time_ms(fn, iters: int = 20) -> float:  # noqa: ANN001
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    with torch.cuda.graph(graph):
        for _ in range(iters):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", default="1,8,64,2048")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    d, f, e, k = 2048, 768, 128, 8
    g = torch.Generator(device="cuda").manual_seed(0)
    gate_up = (torch.randn(e, 2 * f, d, generator=g, device="cuda") / d**0.5).bfloat16()
    down = (torch.randn(e, d, f, generator=g, device="cuda") / f**0.5).bfloat16()
    small = [dict(BLOCK_M=16, BLOCK_N=n, BLOCK_K=kk, num_warps=w, num_stages=s)
             for n, kk, w, s in itertools.product((16, 32, 64, 128), (64, 128, 256), (2, 4),
                                                  (2, 4))]
    large = [dict(BLOCK_M=m, BLOCK_N=n, BLOCK_K=kk, num_warps=w, num_stages=s)
             for m, n, kk, w, s in itertools.product((32, 64, 128), (64, 128, 256), (32, 64),
                                                     (4, 8), (3, 4))]
    results = []
    for t in (int(v) for v in args.tokens.split(",")):
        x = torch.randn(t, d, generator=g, device="cuda").bfloat16()
        logits = torch.randn(t, e, generator=g, device="cuda").bfloat16()
        touched = 1 - (1 - k / e) ** t
        limit_ms = 3 * f * d * 2 * e * touched / 4.2e12 * 1e3  # H200's ~4.2 TB/s
        flops = 2 * t * k * 3 * f * d
        default = fm.tiles(t * k, e)
        rows = []
        for tile in (small if t * k <= 4 * e else large):
            try:
                ms = time_ms(partial(run, x, logits, gate_up, down, k, tile))
            except Exception as exc:  # noqa: BLE001 - a config the GPU cannot run
                print(f"tokens {t}: {tile} failed: {type(exc).__name__}")
                continue
            rows.append((ms, tile))
        rows.sort(key=lambda r: r[0])
        ms_default = time_ms(partial(run, x, logits, gate_up, down, k, default))
        best_ms, best = rows[0]
        print(f"tokens {t}: default {ms_default:.3f} ms {default}; best {best_ms:.3f} ms "
              f"{best}; bytes limit {limit_ms:.3f} ms, {flops / best_ms / 1e9:.0f} TFLOP/s")
        for ms, tile in rows[:5]:
            print(f"    {ms:.3f} ms {tile}")
        results.append({"tokens": t, "default_ms": ms_default, "default": default,
                        "best_ms": best_ms, "best": best, "limit_ms": limit_ms,
                        "top": [{"ms": ms, "tile": tile} for ms, tile in rows[:5]]})
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"gpu": torch.cuda.get_device_name(), "results": results}, out, indent=1)


if __name__ == "__main__":
    main()
