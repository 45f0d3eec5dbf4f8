"""The linear layers of one decode or prefill step in FP8 against bf16, on the GPU.

For a named shape (default Llama-3-8B), every layer's four GEMMs (qkv, o, gate_up,
down) with distinct random weights per layer, so the weights stream from memory as in
a real step (one layer's would sit in L2), at each row count:
- bf16 `F.linear`;
- `fp8_gemm` (kernels/fp8_gemm.py, weight-only) with its default tiles, and the best of a
  sweep of tiles (`--sweep`);
- `_scaled_mm` with per-token activation quantization (engine/fp8.py's `scaled_mm`), and
  with one scale for all of x (the weight's row scales applied after);
- `Fp8Linear` as the engine dispatches it.
Each figure is the median of replays of a CUDA graph of the whole step's GEMMs (as the
engine runs them: launched one by one from Python, they take longer to launch than to
run), beside the time the weight bytes take at the measured copy rate. One JSON.

    python benchmarks/fp8_gemm.py --json results/fp8_gemm_<kind>.json --kind <kind> --sweep
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from engine_gpu import copy_bandwidth

from tandem.engine import fp8
from tandem.engine.config import NAMED_SHAPES
from tandem.kernels.fp8_gemm import fp8_gemm, fp8_gemm_ref, tiles
from tandem.kernels.fp8_quant import quantize_rows_ref

ROWS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 2048)


def shapes(model: str) -> list[tuple[str, int, int]]:
    """(name, N, K) of a decoder layer's linear layers."""
    c = NAMED_SHAPES[model]
    qkv = (c.num_heads + 2 * c.num_kv_heads) * c.head_dim
    return [("qkv", qkv, c.hidden_size), ("o", c.hidden_size, c.num_heads * c.head_dim),
            ("gate_up", 2 * c.intermediate_size, c.hidden_size),
            ("down", c.hidden_size, c.intermediate_size)]


def timed(fn: Any, reps: int) -> float:
    """Median seconds of `fn()` replayed from a CUDA graph (as the engine's decode steps
    run: launched from Python, 128 small kernels take longer to launch than to run)."""
    fn()  # compiles
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    del graph
    return statistics.median(times)


def sweep_configs(m: int) -> list[dict[str, int]]:
    """fp8_gemm's tiles to try at `m` rows."""
    if m == 1:
        grid = itertools.product((4, 8, 16), (1024, 2048, 4096), (4, 8), (2, 3, 4))
        return [{"BLOCK_M": 1, "BLOCK_N": n, "BLOCK_K": k, "num_warps": w, "num_stages": st}
                for n, k, w, st in grid]
    grid = itertools.product((16, 32, 64), (128, 256, 512), (4, 8), (3, 4))
    return [{"BLOCK_M": 16, "BLOCK_N": n, "BLOCK_K": k, "num_warps": w, "num_stages": st}
            for n, k, w, st in grid if n * k <= 64 * 512]


def scaled_mm_tensor(x: torch.Tensor, w8: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """`_scaled_mm` with one scale for x and none for W, W's row scales after."""
    amax = x.abs().amax().float()
    sx = torch.where(amax > 0, amax / 448.0, 1.0)
    xq = (x / sx).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    one = torch.ones((), device=x.device)
    out = torch._scaled_mm(xq, w8.t(), scale_a=sx, scale_b=one, out_dtype=torch.float32)
    return (out * scale).to(x.dtype)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="llama-3-8b", help="a named shape (default: %(default)s)")
    p.add_argument("--rows", default=",".join(map(str, ROWS)),
                   help="row counts, comma-separated (default: %(default)s)")
    p.add_argument("--reps", type=int, default=10, help="timed runs per figure")
    p.add_argument("--sweep", action="store_true",
                   help="also time a sweep of fp8_gemm tiles at 1 and 16 rows")
    p.add_argument("--per-shape", action="store_true",
                   help="also time the one-row tiles for each layer shape alone")
    p.add_argument("--kind", default=None, help="the machine's label, put in the JSON")
    p.add_argument("--json", type=Path, default=None, help="write the figures here")
    args = p.parse_args()
    torch.manual_seed(0)
    c = NAMED_SHAPES[args.model]
    dims = shapes(args.model)
    # layers x shapes weights, bf16 and their FP8 rows.
    bf16 = [[torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5 for _, n, k in dims]
            for _ in range(c.num_layers)]
    q8 = [[quantize_rows_ref(w) for w in layer] for layer in bf16]
    bytes16 = sum(w.numel() * 2 for layer in bf16 for w in layer)
    rate = copy_bandwidth("cuda", 1 << 30)  # bytes read + written a second
    check = {}
    for (name, _, k), (w8, s) in zip(dims, q8[0]):
        x = torch.randn(3, k, device="cuda", dtype=torch.bfloat16)
        ref = fp8_gemm_ref(x, w8, s).float()
        for m in (1, 3):
            got = fp8_gemm(x[:m], w8, s).float()
            check[f"{name}_rows{m}"] = float((got - ref[:m]).abs().max() / ref.abs().max())
    print("max error against the reference, relative to the largest output:", check)

    def step(fn: Any, m: int) -> Any:
        xs = [torch.randn(m, k, device="cuda", dtype=torch.bfloat16) for _, _, k in dims]
        return lambda: [fn(xs[i], layer, i) for layer in range(c.num_layers)
                        for i in range(len(dims))]

    methods = {
        "bf16": lambda x, layer, i: F.linear(x, bf16[layer][i]),
        "fp8_gemm": lambda x, layer, i: fp8_gemm(x, *q8[layer][i]),
        "scaled_mm": lambda x, layer, i: fp8.scaled_mm(x, *q8[layer][i], None),
        "scaled_mm_tensor": lambda x, layer, i: scaled_mm_tensor(x, *q8[layer][i]),
        "fp8_linear": lambda x, layer, i: linears[layer][i](x),
    }
    linears = []
    for layer in q8:
        linears.append([])
        for w8, s in layer:
            lin = fp8.Fp8Linear(w8.shape[1], w8.shape[0], False, torch.bfloat16, w8.device)
            lin.weight.data, lin.weight_scale.data = w8, s
            linears[-1].append(lin)
    rows = [int(r) for r in args.rows.split(",")]
    figures: list[dict[str, Any]] = []
    for m in rows:
        fig: dict[str, Any] = {"rows": m}
        for name, fn in methods.items():
            if name == "fp8_gemm" and m > 64:
                continue
            fig[name + "_ms"] = timed(step(fn, m), args.reps) * 1e3
        fig["bf16_bytes_ms"] = bytes16 / rate * 1e3
        fig["fp8_bytes_ms"] = bytes16 / 2 / rate * 1e3
        print(json.dumps(fig))
        figures.append(fig)
    sweeps: dict[str, Any] = {}
    if args.sweep:
        for m in (1, 16):
            results = []
            for cfg in sweep_configs(m):
                try:
                    t = timed(step(lambda x, layer, i, cfg=cfg: fp8_gemm(
                        x, *q8[layer][i], config=cfg), m), 5)
                except Exception as e:  # a tile the GPU cannot run (shared memory)
                    results.append({**cfg, "error": str(e)[:200]})
                    continue
                results.append({**cfg, "ms": t * 1e3})
            ok = sorted((r for r in results if "ms" in r), key=lambda r: r["ms"])
            sweeps[str(m)] = {"default": tiles(m, 4096, 4096), "best": ok[:8], "all": results}
            print(f"rows {m}: best {ok[:3]}")
    per_shape: dict[str, Any] = {}
    if args.per_shape:
        for i, (name, n, k) in enumerate(dims):
            x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
            results = []
            for cfg in sweep_configs(1):
                t = timed(lambda cfg=cfg, i=i, x=x: [fp8_gemm(x, *q8[layer][i], config=cfg)
                                                     for layer in range(c.num_layers)], 5)
                results.append({**cfg, "ms": t * 1e3})
            best = sorted(results, key=lambda r: r["ms"])
            per_shape[name] = {"n": n, "k": k, "fp8_bytes_ms": c.num_layers * n * k / rate * 1e3,
                               "default": tiles(1, n, k), "best": best[:5], "all": results}
            print(f"{name} [{n}, {k}]: bytes {per_shape[name]['fp8_bytes_ms']:.3f} ms, "
                  f"best {best[:2]}")
    out = {"model": args.model, "per_shape": per_shape, "kind": args.kind,
           "device": torch.cuda.get_device_name(),
           "date": time.strftime("%Y-%m-%d"), "copy_bytes_per_s": rate,
           "bf16_weight_bytes": bytes16, "max_gemv_rows": fp8.MAX_GEMV_ROWS,
           "error_vs_reference": check, "figures": figures, "sweeps": sweeps}
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
