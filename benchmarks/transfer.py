"""KV transfer micro-benchmark: one request's KV pushed between two processes.

Default: Llama-3-8B shapes (32 layers, 8 kv heads, head dim 128, bf16, block 16) for a
2,048-token prompt: 128 blocks, 268 MB. The sender process gathers the blocks (random
source ids), sends them, and the receiver process's TransferAgent scatters them into
random sink ids, as in serving (ipc: the sender writes them straight into the sink's
blocks, one kernel). Two modes:

- default: every layer is computed before the push starts (KVPush `all_computed`, as
  `push()` sends a finished prefill or cached blocks): the bandwidth figure;
- `--layer-ms X`: layer-wise, the sender hands over one layer every X ms, as a prefill
  computing its layers would (1.8 ms: a 2,048-token Llama-3-8B prefill of 59 ms over 32
  layers): the tail figure.

Reported per iteration:

- data: from the first send_layer() (the first gather) to the sink being ready on the
  receiver, gather and scatter included; GB/s = bytes / data time (GB = 1e9 bytes). The
  begin/accept handshake before it is a fixed per-request round trip that a prefill
  overlaps with computing its first layer (ipc with every layer computed does not wait
  for the accept: its start() is connecting and mapping the sink);
- wall: from the sender's start() (connect + begin/accept) to the sink being ready;
- tail: from the last layer handed to send_layer() to the sink being ready, what
  layer-wise pushing leaves on the critical path after the prefill's last layer (with
  every layer computed, ipc writes them all at the first layer, so on CPU, where the
  write is done when it returns, its sink can be ready before the last is handed over).

Both processes stamp time.monotonic(), one system-wide clock on a Linux host.

    python benchmarks/transfer.py                                   # tcp, cpu loopback
    python benchmarks/transfer.py --connector nccl --device cuda    # GPU 0 -> GPU 1
    python benchmarks/transfer.py --connector nccl --device cuda --layer-ms 1.8
    python benchmarks/transfer.py --connector ipc --device cuda     # one host: no staging
    python benchmarks/transfer.py --tokens 512 --iters 3 --json out.json
    python benchmarks/transfer.py --connector ucx --opt key=value   # connector options
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import multiprocessing as mp
import platform
import pstats
import queue
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from tandem.engine.config import parse_dtype
from tandem.kvtransfer.agent import SinkInfo, TransferAgent
from tandem.kvtransfer.connector import get_connector
from tandem.kvtransfer.layout import KVLayout
from tandem.kvtransfer.sender import KVPush
from tandem.kvtransfer.staging import KVRows

MODEL = "llama-3-8b"
QUEUE_TIMEOUT_S = 300  # nothing here may hang: every wait across processes is bounded


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--connector", default="tcp",
                   help="tcp | ucx | nccl | ipc (default: %(default)s)")
    p.add_argument("--opt", action="append", default=[], metavar="KEY=VALUE",
                   help="option passed to get_connector on both sides (repeatable)")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                   help="cuda: sender on GPU 0, receiver on GPU 1 (or 0 if only one)")
    p.add_argument("--host", default="127.0.0.1", help="receiver's listen host")
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--ring", type=int, default=2, help="KVPush staging slots")
    p.add_argument("--message-mb", type=float, default=64,
                   help="largest KVPush message in MiB: layers stack up to it while the "
                        "link is busy (default: %(default)s)")
    p.add_argument("--layer-ms", type=float, default=0.0,
                   help="layer-wise: hand the sender one layer every this many ms "
                        "(default 0: every layer computed up front)")
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="write the results here")
    p.add_argument("--profile", default=None, metavar="FILE",
                   help="profile the sender's open of each measured push (KVPush and its "
                        "start(): the host work a prefill node does during its step) and "
                        "write the top functions here")
    return p.parse_args()


def _options(pairs: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for pair in pairs:
        key, _, raw = pair.partition("=")
        for cast in (int, float):
            try:
                out[key] = cast(raw)
                break
            except ValueError:
                continue
        else:
            out[key] = raw
    return out


def _device(args: argparse.Namespace, role: str) -> torch.device:
    if args.device == "cpu":
        return torch.device("cpu")
    index = 1 if role == "receiver" and torch.cuda.device_count() > 1 else 0
    return torch.device("cuda", index)


def _caches(args: argparse.Namespace, num_blocks: int, device: torch.device) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(args.seed)
    shape = (args.layers, 2, num_blocks, args.block_size, args.kv_heads, args.head_dim)
    # One tensor with a view per layer, as the engine allocates its cache.
    base = torch.randn(shape, generator=g).to(parse_dtype(args.dtype)).to(device)
    return list(base.unbind(0))


def _block_ids(num_blocks: int, n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randperm(num_blocks, generator=g)[:n].tolist()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _staging_s(caches: list[torch.Tensor], ids: list[int], scatter: bool) -> float:
    """Seconds to gather (or scatter) every layer once, in-process: the staging cost alone."""
    index = torch.tensor(ids, device=caches[0].device)  # as the agent and KVPush hold it
    shape = (len(caches), 2, len(ids), *caches[0].shape[2:])
    staged = torch.empty(shape, dtype=caches[0].dtype, device=caches[0].device)
    rows = KVRows(caches)
    rows.gather(0, index, staged)
    t0 = 0.0
    for _ in range(2):  # the first pass warms up (lazy CUDA kernel loading, page faults)
        _sync(caches[0].device)
        t0 = time.monotonic()
        if scatter:
            rows.scatter(0, index, staged)
        else:
            rows.gather(0, index, staged)
    _sync(caches[0].device)
    return time.monotonic() - t0


def receiver_main(
    args: argparse.Namespace, n: int, sinks: Any, results: Any, stop: Any
) -> None:
    device = _device(args, "receiver")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    num_blocks = 2 * n  # sink ids are a random half of the cache, so scatter really scatters
    caches = _caches(args, num_blocks, device)
    layout = KVLayout.of(caches, MODEL)
    ids = _block_ids(num_blocks, n, args.seed + 1)
    results.put(("scatter_s", _staging_s(caches, ids, scatter=True)))
    ready_at: dict[str, float] = {}
    connector = get_connector(args.connector, **_options(args.opt))
    agent = TransferAgent(caches, layout, connector, lambda ids: None, args.host,
                          on_ready=lambda rid: ready_at.setdefault(rid, time.monotonic()))
    try:
        for i in range(args.warmup + args.iters):
            rid = f"bench-{i}"
            sinks.put(agent.reserve(rid, ids, ttl_s=QUEUE_TIMEOUT_S).to_dict())
            if not agent.wait_ready(rid, timeout=QUEUE_TIMEOUT_S):
                raise RuntimeError(f"{rid} not ready: {agent.status(rid)}")
            agent.release(rid)
            results.put(("ready", i, ready_at[rid]))
        stop.wait(QUEUE_TIMEOUT_S)  # the sender's last `end` still needs its `done`
    finally:
        agent.close()


def sender_main(args: argparse.Namespace, n: int, sinks: Any, results: Any, stop: Any) -> None:
    device = _device(args, "sender")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    num_blocks = 2 * n
    caches = _caches(args, num_blocks, device)
    layout = KVLayout.of(caches, MODEL)
    ids = _block_ids(num_blocks, n, args.seed + 2)
    results.put(("gather_s", _staging_s(caches, ids, scatter=False)))
    rows = KVRows(caches)  # built once, as a prefill node holds it for its cache
    connector = get_connector(args.connector, **_options(args.opt))
    profile = cProfile.Profile() if args.profile else None
    for i in range(args.warmup + args.iters):
        sink = SinkInfo.from_dict(sinks.get(timeout=QUEUE_TIMEOUT_S))
        measured = profile is not None and i >= args.warmup
        if measured:
            profile.enable()
        t_start = time.monotonic()
        with KVPush(connector, sink, rows, ids, layout, send_timeout=60, reply_timeout=60,
                    ring=args.ring, message_bytes=int(args.message_mb * 2**20),
                    all_computed=not args.layer_ms) as p:
            p.start()
            t_first = t_last = time.monotonic()
            if measured:
                profile.disable()
            for layer in range(layout.num_layers):
                if layer and args.layer_ms:
                    time.sleep(args.layer_ms / 1e3)  # the prefill computing this layer
                t_last = time.monotonic()
                p.send_layer(layer)
            p.finish()
        results.put(("sent", i, t_start, t_first, t_last, time.monotonic()))
    if profile is not None:
        out = io.StringIO()
        pstats.Stats(profile, stream=out).sort_stats("cumulative").print_stats(40)
        Path(args.profile).write_text(f"{args.iters} push opens ({args.connector}, "
                                      f"{args.tokens} tokens)\n{out.getvalue()}")


def run(args: argparse.Namespace) -> dict[str, Any]:
    layout = KVLayout(MODEL, args.dtype, args.layers, args.kv_heads, args.head_dim,
                      args.block_size)
    n = -(-args.tokens // args.block_size)
    nbytes = layout.block_bytes * n * layout.num_layers
    ctx = mp.get_context("spawn")
    sinks, results, stop = ctx.Queue(), ctx.Queue(), ctx.Event()
    procs = [ctx.Process(target=f, args=(args, n, sinks, results, stop), name=f.__name__)
             for f in (receiver_main, sender_main)]
    for proc in procs:
        proc.start()
    got: dict[str, Any] = {}
    ready: dict[int, float] = {}
    sent: dict[int, tuple[float, ...]] = {}
    deadline = time.monotonic() + QUEUE_TIMEOUT_S
    try:
        while len(ready) < args.warmup + args.iters or len(sent) < len(ready):
            if any(p.exitcode not in (None, 0) for p in procs) or time.monotonic() > deadline:
                raise RuntimeError(f"benchmark processes failed: {[p.exitcode for p in procs]}")
            try:
                msg = results.get(timeout=1)
            except queue.Empty:
                continue
            if msg[0] == "ready":
                ready[msg[1]] = msg[2]
            elif msg[0] == "sent":
                sent[msg[1]] = msg[2:]
            else:
                got[msg[0]] = msg[1]
    finally:
        stop.set()
        for proc in procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()
    iters = []
    for i in range(args.warmup, args.warmup + args.iters):
        t_start, t_first, t_last, t_finish = sent[i]
        data, wall = ready[i] - t_first, ready[i] - t_start
        iters.append({"data_s": data, "gbps": nbytes / data / 1e9,
                      "wall_s": wall, "wall_gbps": nbytes / wall / 1e9,
                      "tail_s": ready[i] - t_last, "finish_s": t_finish - t_start})
    return {
        "connector": args.connector, "device": args.device, "host": platform.node(),
        "layout": layout.to_dict(), "ring": args.ring, "message_mb": args.message_mb,
        "layer_ms": args.layer_ms,
        "tokens": args.tokens, "blocks": n, "bytes": nbytes,
        "gather_gbps": nbytes / got["gather_s"] / 1e9,
        "scatter_gbps": nbytes / got["scatter_s"] / 1e9,
        "iters": iters,
        "median_gbps": statistics.median(it["gbps"] for it in iters),
        "median_data_s": statistics.median(it["data_s"] for it in iters),
        "median_wall_gbps": statistics.median(it["wall_gbps"] for it in iters),
        "median_wall_s": statistics.median(it["wall_s"] for it in iters),
        "median_tail_s": statistics.median(it["tail_s"] for it in iters),
    }


def main() -> None:
    args = parse_args()
    r = run(args)
    print(f"{r['connector']} on {r['device']}: {args.layers} layers x {r['blocks']} blocks "
          f"({r['tokens']} tokens), {args.dtype}, {r['bytes'] / 1e6:.1f} MB, "
          f"ring {args.ring}, messages up to {args.message_mb:g} MiB")
    print(f"staging alone: gather {r['gather_gbps']:.2f} GB/s, "
          f"scatter {r['scatter_gbps']:.2f} GB/s")
    print(f"{'iter':>4} {'data ms':>8} {'GB/s':>7} {'wall ms':>8} {'GB/s':>7} {'tail ms':>8} "
          f"{'finish ms':>10}")
    for i, it in enumerate(r["iters"]):
        print(f"{i:>4} {it['data_s'] * 1e3:>8.3f} {it['gbps']:>7.1f} {it['wall_s'] * 1e3:>8.3f} "
              f"{it['wall_gbps']:>7.1f} {it['tail_s'] * 1e3:>8.3f} {it['finish_s'] * 1e3:>10.2f}")
    print(f"median: {r['median_gbps']:.1f} GB/s (data {r['median_data_s'] * 1e3:.3f} ms); "
          f"with the handshake {r['median_wall_gbps']:.1f} GB/s "
          f"(wall {r['median_wall_s'] * 1e3:.3f} ms); "
          f"tail after last layer {r['median_tail_s'] * 1e3:.3f} ms")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(r, f, indent=2)


if __name__ == "__main__":
    main()
