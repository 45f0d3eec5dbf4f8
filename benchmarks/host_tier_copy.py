"""The host tier's copy rates (`engine/host_tier.py`) against the link's, in one run: a
plain pinned copy of a large tensor each way (the limit), then the tier's `save` (device
blocks out to host slots) and `load` (slots back into device blocks) of one block and of
a whole prefix, on the layout of a model shape (Llama-3-8B's by default).

    python benchmarks/host_tier_copy.py --json results/host_tier_copy.json

Each figure is the median over `--iters` of the time from the call to its copies'
completion (CUDA events on the stream the tier copies on, and the host's wall clock
around the call and a synchronize), as bytes per second.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import statistics
import time
from collections.abc import Callable

import torch

from tandem.engine.block_hash import BlockHash
from tandem.engine.config import NAMED_SHAPES
from tandem.engine.host_tier import Evicted, HostTier, block_bytes


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="llama-3-8b",
                   help="a named model shape (default: %(default)s)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--device-blocks", type=int, default=1024)
    p.add_argument("--host-blocks", type=int, default=512)
    p.add_argument("--prefix-blocks", type=int, default=64,
                   help="blocks of the whole prefix (64: 1,024 tokens) (default: %(default)s)")
    p.add_argument("--limit-mib", type=int, default=512,
                   help="size of the plain pinned copy (default: %(default)s)")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--json", default=None, help="write the results here")
    return p.parse_args()


def timed(fn: Callable[[], None], iters: int) -> dict[str, float]:
    """Median seconds of fn() to its copies' end: on the stream, and on the host."""
    fn()  # warm up
    torch.cuda.synchronize()
    stream_s, wall_s = [], []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0 = time.perf_counter()
        start.record()
        fn()
        end.record()
        end.synchronize()
        wall_s.append(time.perf_counter() - t0)
        stream_s.append(start.elapsed_time(end) / 1e3)
    return {"stream_s": statistics.median(stream_s), "wall_s": statistics.median(wall_s)}


def rate(nbytes: int, t: dict[str, float]) -> dict[str, float]:
    return {**t, "bytes": nbytes, "stream_gbps": nbytes / t["stream_s"] / 1e9,
            "wall_gbps": nbytes / t["wall_s"] / 1e9}


def link_limit(nbytes: int, iters: int) -> dict[str, dict]:
    """A plain copy of `nbytes` between pinned host memory and the device, each way."""
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    return {"d2h": rate(nbytes, timed(functools.partial(host.copy_, dev, non_blocking=True),
                                      iters)),
            "h2d": rate(nbytes, timed(functools.partial(dev.copy_, host, non_blocking=True),
                                      iters))}


def saver(tier: HostTier, blocks: int) -> Callable[[], None]:
    """Saves device blocks 0..blocks-1 under new hashes each call (the tier copies only
    what it does not hold)."""
    counter = itertools.count(1 << 32)

    def save() -> None:
        tier.save([Evicted(i, BlockHash(next(counter).to_bytes(16, "little")), ())
                   for i in range(blocks)])

    return save


def check_round_trip(caches: list[torch.Tensor]) -> None:
    """Blocks saved, then loaded into other blocks, arrive bit for bit."""
    tier = HostTier(8, caches)
    hashes = [BlockHash(i.to_bytes(16, "little")) for i in (1, 2, 3)]
    tier.save([Evicted(b, h, ()) for b, h in zip((5, 9, 6), hashes)])
    slots = [tier.lookup(h, ()) for h in hashes]
    tier.load(slots, [100, 101, 102])
    for cache in caches:
        assert torch.equal(cache[:, [100, 101, 102]], cache[:, [5, 9, 6]])


def main() -> None:
    args = parse_args()
    cfg = NAMED_SHAPES[args.shape]
    dev = torch.device("cuda")
    shape = (cfg.num_layers, 2, args.device_blocks, args.block_size, cfg.num_kv_heads,
             cfg.head_dim)
    caches = list(torch.randn(shape, dtype=torch.bfloat16, device=dev).unbind(0))
    per_block = block_bytes(caches)
    check_round_trip(caches)
    tier = HostTier(args.host_blocks, caches)

    results: dict[str, dict] = {"limit": link_limit(args.limit_mib << 20, args.iters)}
    for blocks in (1, args.prefix_blocks):  # the link at each case's size too
        results[f"limit_{blocks}"] = link_limit(blocks * per_block, args.iters)
        results[f"save_{blocks}"] = rate(blocks * per_block, timed(saver(tier, blocks),
                                                                   args.iters))
        slots = list(range(blocks))  # consecutive, as a run of evictions leaves them
        targets = list(range(args.device_blocks - blocks, args.device_blocks))
        results[f"load_{blocks}"] = rate(blocks * per_block, timed(
            functools.partial(tier.load, slots, targets), args.iters))
    limit = results["limit"]
    for key, r in list(results.items()):
        if key.startswith("limit"):
            continue
        way = "d2h" if key.startswith("save") else "h2d"
        same = results["limit_" + key.split("_")[1]][way]  # a plain copy of as many bytes
        r["of_limit_stream"] = r["stream_gbps"] / limit[way]["stream_gbps"]
        r["of_same_size_copy_stream"] = r["stream_gbps"] / same["stream_gbps"]
        print(f"{key:>10}: {r['bytes'] / 2**20:7.1f} MiB  stream {r['stream_gbps']:6.1f} GB/s "
              f"({r['of_limit_stream']:.0%} of {way}; a plain copy of as many bytes "
              f"{same['stream_gbps']:.1f} GB/s: {r['of_same_size_copy_stream']:.0%}), "
              f"wall {r['wall_gbps']:6.1f} GB/s")
    for way, r in limit.items():
        print(f"limit {way}: {r['stream_gbps']:.1f} GB/s on the stream, "
              f"{r['wall_gbps']:.1f} GB/s wall ({args.limit_mib} MiB pinned)")
    out = {"args": vars(args), "gpu": torch.cuda.get_device_name(dev),
           "block_bytes": per_block, "results": results}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
