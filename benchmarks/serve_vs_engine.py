"""How much of the engine's speed survives the serving path: the offline engine and
`tandem up` in one run, on the same token-id prompts, greedy, exact output lengths.

1. Offline: `LLM.generate` on N prompts at once (generated tok/s), and the engine's
   decode step time at batch 1 ((t(1 + n tokens) - t(1 token)) / n, median of 3).
2. Served: `tandem up <--up-flags>`, then `tandem bench serve` with N streams
   (--max-concurrency N, the same N prompts) and with one stream.
3. The ratios: served tok/s at N streams / offline tok/s at batch N, and the median ITL
   at one stream / the engine's batch-1 step time.

    python benchmarks/serve_vs_engine.py --json benchmarks/results/serve_vs_engine_cpu.json
    python benchmarks/serve_vs_engine.py --up-flags="--colocated 1"

Issue 24's 5b (N prompts at once, rate inf, the engine batching at most --max-num-seqs):

    python benchmarks/serve_vs_engine.py --model smollm2-135m --load-format dummy \
        --device cuda --dtype bfloat16 --streams 256 --input-len 128 --output-len 256 \
        --max-num-seqs 128 --no-prefix-caching --burst \
        --up-flags="--colocated 1 --skip-tokenizer-init"
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from tandem import LLM, SamplingParams
from tandem.bench.datasets import random_requests


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct", help="(default: %(default)s)")
    p.add_argument("--device", default="cpu", help="(default: %(default)s)")
    p.add_argument("--dtype", default="float32", help="(default: %(default)s)")
    p.add_argument("--streams", type=int, default=8, help="N (default: %(default)s)")
    p.add_argument("--input-len", type=int, default=128, help="(default: %(default)s)")
    p.add_argument("--output-len", type=int, default=64, help="(default: %(default)s)")
    p.add_argument("--single-stream-prompts", type=int, default=3,
                   help="requests of the one-stream run (default: %(default)s)")
    p.add_argument("--load-format", default="auto", help="(default: %(default)s)")
    p.add_argument("--max-num-seqs", type=int, default=64,
                   help="the engine's batch, offline and served (default: %(default)s)")
    p.add_argument("--no-prefix-caching", action="store_true",
                   help="off in both, so every prompt is computed")
    p.add_argument("--up-log", type=Path, default=None,
                   help="write tandem up's output here (default: dropped)")
    p.add_argument("--burst", action="store_true",
                   help="send the N streams at once, as a burst at rate inf (no client "
                        "concurrency limit): the engine queues what its batch cannot hold")
    p.add_argument("--up-flags", action="append", default=None,
                   help="more flags for tandem up, quoted; repeat to measure several "
                        "configurations against the one offline run (default: none)")
    p.add_argument("--port", type=int, default=8390, help="(default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="(default: %(default)s)")
    p.add_argument("--json", type=Path, default=None, help="write the figures here")
    return p.parse_args()


def offline(args: argparse.Namespace, prompts: list[list[int]]) -> dict[str, float]:
    llm = LLM(args.model, device=args.device, dtype=args.dtype, load_format=args.load_format,
              max_num_seqs=args.max_num_seqs,
              enable_prefix_caching=not args.no_prefix_caching)
    greedy = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    before = dict(llm.engine.runner.steps)
    t = time.perf_counter()
    outs = llm.generate(prompts, greedy)
    batch_s = time.perf_counter() - t
    steps_by_kind = {k: n - before[k] for k, n in llm.engine.runner.steps.items()}
    assert all(len(o.token_ids) == args.output_len for o in outs)
    steps = []
    for p in prompts[:3]:
        t = time.perf_counter()
        llm.generate(p, one)
        t1 = time.perf_counter() - t
        t = time.perf_counter()
        llm.generate(p, greedy)
        steps.append((time.perf_counter() - t - t1) / (args.output_len - 1))
    del llm
    gc.collect()
    return {"batch_s": batch_s, "batch_tok_s": len(prompts) * args.output_len / batch_s,
            "step_ms_batch1": statistics.median(steps) * 1000, "steps": steps_by_kind}


def engine_steps(url: str) -> dict[str, float]:
    """The nodes' engine steps so far by kind, summed (the router's /metrics)."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as r:
        text = r.read().decode()
    steps: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("tandem:engine_steps_total{"):
            labels, value = line.rsplit(" ", 1)
            kind = labels.split('kind="', 1)[1].split('"', 1)[0]
            steps[kind] = steps.get(kind, 0.0) + float(value)
    return steps


def wait_ok(url: str, proc: subprocess.Popen, timeout_s: float = 600) -> None:
    """Until `tandem up` at `url` reports every node up; raises if it exits first."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                health = json.loads(r.read())
                if health["status"] == "ok" and all(health["nodes"].values()):
                    return
        except OSError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError("tandem up did not come up")
        time.sleep(1)


def served(args: argparse.Namespace, up_flags: str, out_dir: Path) -> dict[str, Any]:
    url = f"http://127.0.0.1:{args.port}"
    log = open(args.up_log, "a") if args.up_log else subprocess.DEVNULL  # noqa: SIM115
    up = subprocess.Popen(
        [sys.executable, "-m", "tandem.cli", "up", "--port", str(args.port), "--model",
         args.model, "--device", args.device, "--dtype", args.dtype, "--load-format",
         args.load_format, "--max-num-seqs", str(args.max_num_seqs),
         *(["--no-prefix-caching"] if args.no_prefix_caching else []),
         *shlex.split(up_flags)],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_ok(url, up)
        results = {}
        streams = None if args.burst else args.streams
        for name, n, conc in (("warmup", 2, 2), ("streams", args.streams, streams),
                              ("one_stream", args.single_stream_prompts, 1)):
            limit = [] if conc is None else ["--max-concurrency", str(conc)]
            before = engine_steps(url)
            subprocess.run(
                [sys.executable, "-m", "tandem.cli", "bench", "serve", "--base-url", url,
                 "--num-prompts", str(n), "--random-input-len", str(args.input_len),
                 "--random-output-len", str(args.output_len), *limit,
                 "--seed", str(args.seed), "--metric-percentiles", "50,90,99",
                 "--save-result", "--result-dir", str(out_dir), "--result-filename",
                 f"{name}.json", "--disable-tqdm"], check=True, stdout=subprocess.DEVNULL)
            results[name] = json.loads((out_dir / f"{name}.json").read_text())
            time.sleep(1.5)  # the router polls node stats every second
            results[name]["engine_steps"] = {k: n - before.get(k, 0.0)
                                             for k, n in engine_steps(url).items()}
        return results
    finally:
        os.killpg(up.pid, signal.SIGINT)
        up.wait(timeout=60)


def main() -> None:
    args = parse_args()
    from tandem.engine.loader import load_model_config, resolve_model

    vocab = load_model_config(resolve_model(args.model, args.load_format)).vocab_size
    # The bench's own random prompts (same seed), so both sides see the same token ids.
    reqs = random_requests(args.streams, args.input_len, args.output_len, 0.0, vocab,
                           args.seed)
    prompts = [list(r.prompt) for r in reqs]
    # Served first: its processes are gone, and their memory free, when the offline
    # engine loads (one card holds one of them at a time).
    serves = {}
    for flags in args.up_flags or [""]:
        with tempfile.TemporaryDirectory() as tmp:
            serves[flags] = served(args, flags, Path(tmp))
    engine = offline(args, prompts)
    print(f"offline: batch {args.streams} {engine['batch_tok_s']:.1f} gen tok/s, "
          f"batch-1 step {engine['step_ms_batch1']:.1f} ms, steps {engine['steps']}",
          flush=True)
    variants = {}
    for flags, serve in serves.items():
        many, one = serve["streams"], serve["one_stream"]
        figures = {
            "offline_batch_tok_s": engine["batch_tok_s"],
            "offline_step_ms_batch1": engine["step_ms_batch1"],
            "offline_steps": engine["steps"],
            "served_streams_tok_s": many["output_throughput"],
            "served_streams_steps": many["engine_steps"],
            "served_one_stream_median_itl_ms": one["median_itl_ms"],
            "served_one_stream_tok_s": one["output_throughput"],
            "served_streams_median_ttft_ms": many["median_ttft_ms"],
            "streams_ratio": many["output_throughput"] / engine["batch_tok_s"],
            "itl_over_step": one["median_itl_ms"] / engine["step_ms_batch1"],
        }
        variants[flags] = figures
        print(f"served [{flags}]: {args.streams} streams {many['output_throughput']:.1f} gen "
              f"tok/s ({figures['streams_ratio']:.0%} of offline), TTFT p50 "
              f"{many['median_ttft_ms']:.1f} ms, steps {many['engine_steps']}; one stream "
              f"median ITL {one['median_itl_ms']:.1f} ms ({figures['itl_over_step']:.2f}x "
              f"the step)", flush=True)
    if args.json:
        args.json.write_text(json.dumps({
            "date": time.strftime("%Y-%m-%d"), "args": vars(args) | {"json": str(args.json)},
            "cpu_count": os.cpu_count(), "offline": engine, "variants": variants,
            "served": {flags: {k: {x: v for x, v in r.items() if not isinstance(v, list)}
                               for k, r in serve.items()} for flags, serve in serves.items()},
        }, indent=1, default=str))
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
