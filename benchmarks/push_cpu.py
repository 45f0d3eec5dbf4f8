"""The host work of a prefill node's KV pushes: the CPU seconds one push costs the
sending process when a step hands over many at once.

A receiver process runs a TransferAgent (ipc) over a cache; each round it reserves
`--pushes` sinks of `--blocks` blocks. The sender process builds the prefill role's own
`Transfer`s for them, hands each its last layer as the engine thread does in the step
that completes those prompts (whole pushes: ipc writes a prompt in one copy), then each
its first token, and waits for every push's end. Two ways to run them:

- `gang`: one `Gang` per step, as the prefill role runs ipc pushes now;
- `threads`: a `PushThreads` thread each, as it did before.

Reported per round: the sender's CPU seconds (every thread of it) per push, and the wall
time from the first handover to the last push's end. SmolLM2-135M's shape by default
(30 layers, 3 KV heads of 64, blocks of 16, bf16), prompts of 128 tokens: 8 blocks.

    python benchmarks/push_cpu.py                      # CPU: ipc through shared memory
    python benchmarks/push_cpu.py --device cuda --json out.json
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import threading
import time
from concurrent.futures import Future
from pathlib import Path

import torch

from tandem.kvtransfer.agent import SinkInfo, TransferAgent
from tandem.kvtransfer.ipc import IpcConnector
from tandem.kvtransfer.layout import KVLayout
from tandem.kvtransfer.sender import KVPush
from tandem.kvtransfer.staging import KVRows
from tandem.prefill_node.transfer import Gang, PushThreads, Transfer

MODEL = "smollm2-135m"
TIMEOUT_S = 120  # every wait across the processes is bounded


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                   help="both processes on the CPU or on GPU 0 (default: %(default)s)")
    p.add_argument("--layers", type=int, default=30, help="(default: %(default)s)")
    p.add_argument("--kv-heads", type=int, default=3, help="(default: %(default)s)")
    p.add_argument("--head-dim", type=int, default=64, help="(default: %(default)s)")
    p.add_argument("--block-size", type=int, default=16, help="(default: %(default)s)")
    p.add_argument("--blocks", type=int, default=8, help="blocks a prompt fills "
                   "(default: %(default)s)")
    p.add_argument("--pushes", type=int, default=16, help="pushes one step hands over "
                   "(default: %(default)s, a 2,048-token step of 128-token prompts)")
    p.add_argument("--steps", type=int, default=16, help="steps a round runs, one after "
                   "another (default: %(default)s: 256 prompts)")
    p.add_argument("--rounds", type=int, default=3, help="rounds per mode, the modes "
                   "alternating (default: %(default)s)")
    p.add_argument("--json", type=Path, default=None, help="write the figures here")
    return p.parse_args()


def _caches(args: argparse.Namespace, num_blocks: int, device: str) -> list[torch.Tensor]:
    shape = (args.layers, 2, num_blocks, args.block_size, args.kv_heads, args.head_dim)
    return list(torch.randn(shape).to(torch.bfloat16).to(device).unbind(0))


def receiver(args: argparse.Namespace, sinks_out: mp.Queue, asks: mp.Queue) -> None:
    """Reserve a round's sinks when asked (fresh blocks each round), until asked with 0."""
    per_round = args.pushes * args.steps
    caches = _caches(args, per_round * args.blocks * 2, args.device)
    connector = IpcConnector()
    agent = TransferAgent(caches, KVLayout.of(caches, MODEL), connector, lambda ids: None)
    try:
        for r in iter(lambda: asks.get(timeout=TIMEOUT_S), 0):
            first = (r % 2) * per_round * args.blocks
            sinks_out.put([agent.reserve(
                f"r{r}-{i}", range(first + i * args.blocks, first + (i + 1) * args.blocks),
                ttl_s=TIMEOUT_S).to_dict() for i in range(per_round)])
            asks.get(timeout=TIMEOUT_S)  # the round's pushes ended: free its sinks
            for i in range(per_round):
                agent.release(f"r{r}-{i}")
    finally:
        agent.close()
        connector.close()


def one_round(args: argparse.Namespace, sinks: list[SinkInfo], rows: KVRows,
              layout: KVLayout, connector: IpcConnector, gang: bool) -> dict[str, float]:
    device = rows.caches[0].device
    threads = PushThreads()
    the_gang = Gang(threads, layout.num_layers) if gang else None
    ended: list[BaseException | None] = []
    done = threading.Semaphore(0)

    def on_end(error: BaseException | None) -> None:
        ended.append(error)
        done.release()

    def open_push(target: tuple[SinkInfo, int]) -> KVPush:
        return KVPush(connector, target[0], rows, range(args.blocks), layout,
                      all_computed=True)

    cpu, wall = time.process_time(), time.perf_counter()
    for step in range(args.steps):
        transfers = []
        for sink in sinks[step * args.pushes:(step + 1) * args.pushes]:
            target: Future = Future()
            target.set_result((sink, 0))
            transfers.append(Transfer(threads, target, open_push, device,
                                      lambda: time.monotonic() + TIMEOUT_S, on_end,
                                      layout.num_layers, gang=the_gang))
        for t in transfers:  # the engine thread, in the step's launch
            t.layer_done(layout.num_layers - 1)
        if the_gang is not None:
            the_gang.flush(layout.num_layers - 1)
        for t in transfers:  # as the step lands
            t.sampled(7)
    for _ in sinks:
        if not done.acquire(timeout=TIMEOUT_S):
            raise TimeoutError("a push did not end")
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    threads.close()
    failed = [e for e in ended if e is not None]
    if failed:
        raise RuntimeError(f"{len(failed)} pushes failed: {failed[0]!r}")
    return {"cpu_ms_per_push": 1e3 * cpu / len(sinks), "wall_s": wall}


def main() -> None:
    args = parse_args()
    ctx = mp.get_context("spawn")
    sinks_out, asks = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=receiver, args=(args, sinks_out, asks), daemon=True)
    proc.start()
    caches = _caches(args, args.blocks, args.device)
    layout, rows, connector = KVLayout.of(caches, MODEL), KVRows(caches), IpcConnector()
    out: dict[str, list[dict[str, float]]] = {"gang": [], "threads": []}
    try:
        for r in range(1, 2 * args.rounds + 2):  # round 1: a warm-up
            mode = "gang" if r % 2 else "threads"
            asks.put(r)
            sinks = [SinkInfo.from_dict(s) for s in sinks_out.get(timeout=TIMEOUT_S)]
            row = one_round(args, sinks, rows, layout, connector, mode == "gang")
            asks.put(1)
            if r > 1:
                out[mode].append(row)
                print(mode, {k: round(v, 3) for k, v in row.items()}, flush=True)
    finally:
        asks.put(0)
        proc.join(TIMEOUT_S)
        connector.close()
    summary = {mode: statistics.median(r["cpu_ms_per_push"] for r in rows)
               for mode, rows in out.items()}
    print("median CPU ms per push:", {k: round(v, 3) for k, v in summary.items()})
    if args.json:
        args.json.write_text(json.dumps({"args": vars(args) | {"json": str(args.json)},
                                         "rounds": out, "median_cpu_ms_per_push": summary},
                                        indent=1))


if __name__ == "__main__":
    main()
