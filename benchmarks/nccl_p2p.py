"""Raw NCCL point-to-point bandwidth between GPU 0 and GPU 1: the ceiling the `nccl`
connector is measured against (benchmarks/transfer.py), taken in the same session.

    python benchmarks/nccl_p2p.py --sizes-mb 2 8 268
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _worker(rank: int, port: int, sizes_mb: list[float], iters: int, q) -> None:  # noqa: ANN001
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    torch.cuda.set_device(rank)
    dist.init_process_group(
        "nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2
    )
    results = {}
    for mb in sizes_mb:
        n = int(mb * 1e6)
        buf = torch.empty(n, dtype=torch.uint8, device="cuda")
        for _ in range(3):  # warm up the channel for this size
            (dist.send if rank == 0 else dist.recv)(buf, 1 - rank)
        torch.cuda.synchronize()
        dist.barrier()
        start = time.perf_counter()
        for _ in range(iters):
            (dist.send if rank == 0 else dist.recv)(buf, 1 - rank)
        torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
        results[mb] = n * iters / elapsed / 1e9
    if rank == 1:
        q.put(results)
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes-mb", type=float, nargs="+", default=[2, 8.4, 64, 268.4],
                   help="message sizes in MB (1e6 bytes)")
    p.add_argument("--iters", type=int, default=20, help="timed sends per size")
    p.add_argument("--port", type=int, default=29533, help="rendezvous port on 127.0.0.1")
    args = p.parse_args()
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, args.port, args.sizes_mb, args.iters, q))
             for r in (0, 1)]
    for proc in procs:
        proc.start()
    results = q.get(timeout=300)
    for proc in procs:
        proc.join(timeout=60)
    print("size MB   GB/s (receiver side, GPU 0 -> GPU 1)")
    for mb, gbs in results.items():
        print(f"{mb:8.1f}  {gbs:7.1f}")


if __name__ == "__main__":
    main()
