"""kernels/fp8_mm.py's tiles against cuBLAS's row-wise scaled FP8 GEMM, on the GPU.

For each layer shape of a named model (default Llama-3-8B) and each row count, the
layers' GEMMs with distinct weights per layer (so the weights stream from memory, as in
a step), x already in FP8 with its row scales: `torch._scaled_mm`, and `fp8_mm` with
each tile of a sweep. Each figure is the median of replays of a CUDA graph of the
layers' GEMMs (benchmarks/fp8_gemm.py's `timed`), beside the FP8 bytes' time at the
measured copy rate. One JSON, with the best tiles per shape and row count.

    python benchmarks/fp8_mm_tiles.py --json results/fp8_mm_tiles_<kind>.json --kind <kind>
"""

from __future__ import annotations

import argparse
import itertools
import json
import time
from pathlib import Path
from typing import Any

import torch
from engine_gpu import copy_bandwidth
from fp8_gemm import shapes, timed

from tandem.engine.config import NAMED_SHAPES
from tandem.kernels.fp8_gemm import fp8_gemm_ref
from tandem.kernels.fp8_mm import fp8_mm, tiles
from tandem.kernels.fp8_quant import quantize_rows_ref

ROWS = (32, 64, 128, 256)


def configs(m: int) -> list[dict[str, int]]:
    """The tiles to try at `m` rows."""
    block_ms = sorted({min(max(16, triton_pow2(m)), 64), min(max(16, triton_pow2(m)), 128)})
    grid = itertools.product(block_ms, (32, 64, 128), (128, 256), (4, 8), (3, 5))
    return [{"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "num_warps": w, "num_stages": st}
            for bm, bn, bk, w, st in grid]


def triton_pow2(m: int) -> int:
    return 1 << (m - 1).bit_length()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="llama-3-8b", help="a named shape (default: %(default)s)")
    p.add_argument("--rows", default=",".join(map(str, ROWS)),
                   help="row counts, comma-separated (default: %(default)s)")
    p.add_argument("--reps", type=int, default=5, help="timed replays per figure")
    p.add_argument("--kind", default=None, help="the machine's label, put in the JSON")
    p.add_argument("--json", type=Path, default=None, help="write the figures here")
    args = p.parse_args()
    torch.manual_seed(0)
    layers = NAMED_SHAPES[args.model].num_layers
    dims = shapes(args.model)
    weights = [[quantize_rows_ref(torch.randn(n, k, device="cuda") / k**0.5)
                for _, n, k in dims] for _ in range(layers)]
    rate = copy_bandwidth("cuda", 1 << 30)
    rows = [int(r) for r in args.rows.split(",")]
    error: dict[str, float] = {}
    for (name, _, k), (w8, s) in zip(dims, weights[0]):  # the default tiles, ragged rows
        x8, xs = quantize_rows_ref(torch.randn(37, k, device="cuda", dtype=torch.bfloat16))
        want = fp8_gemm_ref(x8.float() * xs[:, None], w8, s).float()
        got = fp8_mm(x8, xs, w8, s).float()
        error[name] = float((got - want).abs().max() / want.abs().max())
    print("max error against the reference, relative to the largest output:", error)
    figures: list[dict[str, Any]] = []
    for m in rows:
        for i, (name, n, k) in enumerate(dims):
            x8, xs = quantize_rows_ref(torch.randn(m, k, device="cuda", dtype=torch.bfloat16))
            ws = [layer[i] for layer in weights]

            def cublas(ws=ws, x8=x8, xs=xs) -> None:
                for w8, s in ws:
                    torch._scaled_mm(x8, w8.t(), scale_a=xs[:, None], scale_b=s[None, :],
                                     out_dtype=torch.bfloat16)

            fig: dict[str, Any] = {"rows": m, "shape": name, "n": n, "k": k,
                                   "fp8_bytes_ms": layers * n * k / rate * 1e3,
                                   "scaled_mm_ms": timed(cublas, args.reps) * 1e3}
            fig["default"] = {**tiles(m, n, k), "ms": timed(
                lambda ws=ws, x8=x8, xs=xs: [fp8_mm(x8, xs, w8, s) for w8, s in ws],
                args.reps) * 1e3}
            tried = []
            for cfg in configs(m):
                try:
                    t = timed(lambda ws=ws, x8=x8, xs=xs, cfg=cfg: [
                        fp8_mm(x8, xs, w8, s, config=cfg) for w8, s in ws], args.reps)
                except Exception as e:  # noqa: BLE001 - a tile the GPU cannot run (shared memory)
                    tried.append({**cfg, "error": str(e)[:120]})
                    continue
                tried.append({**cfg, "ms": t * 1e3})
            ok = sorted((t for t in tried if "ms" in t), key=lambda t: t["ms"])
            fig["best"] = ok[:5]
            fig["all"] = tried
            print(json.dumps({key: v for key, v in fig.items() if key != "all"}), flush=True)
            figures.append(fig)
    out = {"model": args.model, "kind": args.kind, "device": torch.cuda.get_device_name(),
           "date": time.strftime("%Y-%m-%d"), "copy_bytes_per_s": rate, "layers": layers,
           "error_vs_reference": error, "figures": figures}
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
