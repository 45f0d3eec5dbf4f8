"""Two processes on one GPU: is a prefill-like graph slowed by a neighbour's decode-like
loop? Times a CUDA graph of large GEMMs (30 pairs of [2048, 576] x [576, 4608] x [4608,
576], bf16: a prefill step's shape) alone, then while a second process replays a graph of
300 small GEMM + SiLU launches ([128, 576] x [576, 576]: a decode step's) back to back;
and the small graph alone and beside. Without MPS the device time-slices between the two
processes; under MPS (CUDA_MPS_PIPE_DIRECTORY naming a running daemon) their kernels run
side by side (results/serve_5b_wake_mps_nvidia-h200.json).

    python benchmarks/gpu_timeslice.py [--label mps]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import time
from collections.abc import Callable

import torch


def _graph(build: Callable[[], torch.Tensor]) -> torch.cuda.CUDAGraph:
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up cuBLAS off the capture
        build()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        build()
    return graph


def small_graph() -> torch.cuda.CUDAGraph:
    x = torch.randn(128, 576, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(576, 576, device="cuda", dtype=torch.bfloat16)

    def build() -> torch.Tensor:
        y = x
        for _ in range(300):
            y = torch.nn.functional.silu(y @ w)
        return y
    return _graph(build)


def big_graph() -> torch.cuda.CUDAGraph:
    a = torch.randn(2048, 576, device="cuda", dtype=torch.bfloat16)
    w1 = torch.randn(576, 4608, device="cuda", dtype=torch.bfloat16)
    w2 = torch.randn(4608, 576, device="cuda", dtype=torch.bfloat16)

    def build() -> torch.Tensor:
        y = a
        for _ in range(30):
            y = (y @ w1) @ w2
        return y
    return _graph(build)


def median_ms(graph: torch.cuda.CUDAGraph, n: int) -> float:
    times = []
    for _ in range(n):
        torch.cuda.synchronize()
        t = time.perf_counter()
        graph.replay()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def decode_loop(ready: mp.Event, stop: mp.Event, out: mp.Queue) -> None:
    graph = small_graph()
    alone = median_ms(graph, 50)
    ready.set()
    times = []
    while not stop.is_set():  # two replays in flight, as a step ahead keeps one
        t = time.perf_counter()
        graph.replay()
        graph.replay()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t) * 1e3 / 2)
    out.put((alone, statistics.median(times)))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--label", default="", help="printed first (default: none)")
    p.add_argument("--replays", type=int, default=30, help="(default: %(default)s)")
    args = p.parse_args()
    big = big_graph()
    alone = median_ms(big, args.replays)
    ctx = mp.get_context("spawn")
    ready, stop, out = ctx.Event(), ctx.Event(), ctx.Queue()
    neighbour = ctx.Process(target=decode_loop, args=(ready, stop, out))
    neighbour.start()
    ready.wait()
    time.sleep(0.5)
    beside = median_ms(big, args.replays)
    stop.set()
    small_alone, small_beside = out.get()
    neighbour.join()
    print(f"{args.label} prefill-like graph: alone {alone:.2f} ms, beside the decode loop "
          f"{beside:.2f} ms; decode-like graph: alone {small_alone:.3f} ms, beside "
          f"{small_beside:.3f} ms")


if __name__ == "__main__":
    main()
