"""The `ipc` connector's data path alone: a sender process maps a receiver process's KV
cache and its write guard (`kvtransfer.ipc`) and writes a request's blocks into it with
one guarded kernel per copy, gather and scatter in one, with no control path around it.
The ceiling `benchmarks/transfer.py --connector ipc` is measured against.

    python benchmarks/ipc_copy.py                 # sender on GPU 0, receiver on GPU 1
    python benchmarks/ipc_copy.py --device cpu    # shared memory
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import time
from typing import Any

import torch

from tandem.kernels.block_copy import copy_blocks
from tandem.kvtransfer.ipc import WriteGuard
from tandem.kvtransfer.ipc_mapping import SharedCaches, export

QUEUE_TIMEOUT_S = 300


def _shape(args: argparse.Namespace, num_blocks: int) -> tuple[int, int, int]:
    """The cache as the agent sees it: [2L, N, E]."""
    return (2 * args.layers, num_blocks, args.block_size * args.kv_heads * args.head_dim)


def _rows(args: argparse.Namespace, num_blocks: int, seed: int, device: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(_shape(args, num_blocks), generator=g).to(torch.bfloat16).to(device)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _ids(num_blocks: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(2)
    return torch.randperm(num_blocks, generator=g)[:n], torch.randperm(num_blocks, generator=g)[:n]


def receiver_main(args: argparse.Namespace, num_blocks: int, n: int, to_sender: Any,
                  done: Any) -> None:
    device = torch.device("cpu")
    if args.device == "cuda":
        device = torch.device("cuda", 1 if torch.cuda.device_count() > 1 else 0)
        torch.cuda.set_device(device)
    dst = torch.zeros(_shape(args, num_blocks), dtype=torch.bfloat16, device=device)
    guard = WriteGuard(num_blocks, device)
    [ticket] = guard.open_many([_ids(num_blocks, n)[1].to(device)])
    to_sender.put((export(dst), guard.desc, ticket))
    done.wait(QUEUE_TIMEOUT_S)  # keep the cache alive while the sender writes it


def sender_main(args: argparse.Namespace, num_blocks: int, n: int, from_receiver: Any,
                results: Any) -> None:
    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    src = _rows(args, num_blocks, 1, str(device))
    src_ids, dst_ids = (ids.to(device) for ids in _ids(num_blocks, n))
    caches = SharedCaches()
    cache_desc, tags_desc, ticket = from_receiver.get(timeout=QUEUE_TIMEOUT_S)
    t0 = time.perf_counter()
    dst, tags = caches.open(cache_desc, device), caches.open(tags_desc, device)
    map_s = time.perf_counter() - t0
    times = []
    for i in range(args.warmup + args.iters):
        _sync(device)
        t0 = time.perf_counter()
        copy_blocks(src, src_ids, dst, dst_ids, (tags, ticket))
        _sync(device)
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
    exact = torch.equal(dst[:, dst_ids].cpu(), src[:, src_ids].cpu())
    untouched = not dst.cpu().index_fill_(1, dst_ids.cpu(), 0).any()
    for desc in (cache_desc, tags_desc):
        caches.release(desc, device)
    caches.close()
    results.put({"map_s": map_s, "copy_s": times, "exact": exact and untouched})


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                   help="cuda: sender on GPU 0, receiver on GPU 1 (or 0 if only one)")
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    args = p.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA GPU here; --device cpu measures the shared-memory copy")
    n = -(-args.tokens // args.block_size)
    num_blocks = 2 * n
    nbytes = 2 * args.layers * n * args.block_size * args.kv_heads * args.head_dim * 2
    ctx = mp.get_context("spawn")
    to_sender, results, done = ctx.Queue(), ctx.Queue(), ctx.Event()
    procs = [ctx.Process(target=receiver_main, args=(args, num_blocks, n, to_sender, done)),
             ctx.Process(target=sender_main, args=(args, num_blocks, n, to_sender, results))]
    for proc in procs:
        proc.start()
    try:
        r = results.get(timeout=QUEUE_TIMEOUT_S)
    finally:
        done.set()
        for proc in procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()
    copy_s = statistics.median(r["copy_s"])
    print(f"{args.layers} layers x {n} blocks, bf16, {nbytes / 1e6:.1f} MB; "
          f"mapping the receiver's cache {r['map_s'] * 1e3:.2f} ms (once per receiver)")
    print(f"guarded write (gather + move + scatter, one kernel): "
          f"{nbytes / copy_s / 1e9:.1f} GB/s median ({copy_s * 1e3:.3f} ms incl. launch), "
          f"exact and nothing else written: {r['exact']}")


if __name__ == "__main__":
    main()
