"""cuBLAS on the Llama-3-8B decode GEMMs alone: for 1 and 128 rows, each weight's time
and the rate it is read at, under cuBLAS and cuBLASLt with and without reduced-precision
bf16 reductions. Timed in CUDA graphs over enough weight copies that they come from HBM.
It tells how near the engine's GEMMs can get to the copy rate without a GEMM of our own
(results/profiles/gemm_shapes_nvidia-h200.txt).

    python benchmarks/gemm_shapes.py
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton

# name: (out features, in features) of one layer's weights, and the LM head's
SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096),
          "down": (4096, 14336), "lm_head": (128256, 4096)}


def time_us(rows: int, n: int, k: int) -> float:
    copies = max(1, (512 << 20) // (n * k * 2))
    weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(copies)]
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)

    def run() -> None:
        for w in weights:
            F.linear(x, w)

    return triton.testing.do_bench_cudagraph(run) * 1e3 / copies


def main() -> None:
    for lib in ("cublas", "cublaslt"):
        torch.backends.cuda.preferred_blas_library(lib)
        for reduced in (True, False):
            torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = reduced
            for rows in (1, 128):
                cells = []
                for name, (n, k) in SHAPES.items():
                    us = time_us(rows, n, k)
                    cells.append(f"{name} {us:.1f}us {n * k * 2 / us / 1e6:.2f}TB/s")
                print(f"{lib} reduced={reduced} M={rows}: " + "; ".join(cells), flush=True)


if __name__ == "__main__":
    main()
