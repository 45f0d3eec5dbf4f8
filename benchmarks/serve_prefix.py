"""Prefix reuse across nodes: `tandem bench serve --dataset-name prefix-repetition`
against `tandem up --prefill 2 --decode 1` with the Redis index, with the router's
in-memory index, and with prefix caching off; the nodes' prefix-cache hit rate (from
the router's /metrics) and the TTFT of each, in one run.

    python benchmarks/serve_prefix.py --json benchmarks/results/serve_prefix_cpu-2core.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from serve_vs_engine import wait_ok  # benchmarks/, beside this script


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct", help="(default: %(default)s)")
    p.add_argument("--num-prompts", type=int, default=16, help="(default: %(default)s)")
    p.add_argument("--num-prefixes", type=int, default=2, help="(default: %(default)s)")
    p.add_argument("--prefix-len", type=int, default=384, help="(default: %(default)s)")
    p.add_argument("--suffix-len", type=int, default=32, help="(default: %(default)s)")
    p.add_argument("--output-len", type=int, default=8, help="(default: %(default)s)")
    p.add_argument("--max-concurrency", type=int, default=2, help="(default: %(default)s)")
    p.add_argument("--port", type=int, default=8391, help="(default: %(default)s)")
    p.add_argument("--redis-port", type=int, default=6391, help="(default: %(default)s)")
    p.add_argument("--json", type=Path, default=None, help="write the figures here")
    return p.parse_args()


def cache_counters(url: str) -> tuple[float, float]:
    """(prompt tokens looked up, found) over every node, from the router's /metrics."""
    text = urllib.request.urlopen(f"{url}/metrics", timeout=10).read().decode()
    sums = {"queries": 0.0, "hits": 0.0}
    for name, value in re.findall(r"^tandem:prefix_cache_(queries|hits)_total\{.*\} (\S+)$",
                                  text, re.M):
        sums[name] += float(value)
    return sums["queries"], sums["hits"]


def run_config(args: argparse.Namespace, flags: list[str], out: Path) -> dict[str, Any]:
    url = f"http://127.0.0.1:{args.port}"
    up = subprocess.Popen(
        [sys.executable, "-m", "tandem.cli", "up", "--port", str(args.port), "--model",
         args.model, "--prefill", "2", "--decode", "1", *flags],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        wait_ok(url, up)
        subprocess.run(
            [sys.executable, "-m", "tandem.cli", "bench", "serve", "--base-url", url,
             "--dataset-name", "prefix-repetition", "--num-prompts", str(args.num_prompts),
             "--prefix-repetition-num-prefixes", str(args.num_prefixes),
             "--prefix-repetition-prefix-len", str(args.prefix_len),
             "--prefix-repetition-suffix-len", str(args.suffix_len),
             "--prefix-repetition-output-len", str(args.output_len),
             "--max-concurrency", str(args.max_concurrency), "--metric-percentiles", "50,90",
             "--percentile-metrics", "ttft,e2el", "--save-result", "--result-dir",
             str(out.parent), "--result-filename", out.name, "--disable-tqdm"],
            check=True, stdout=subprocess.DEVNULL)
        time.sleep(6)  # the router polls each node's counters every few seconds
        queries, hits = cache_counters(url)
        result = json.loads(out.read_text())
        return {"flags": flags, "completed": result["completed"],
                "mean_ttft_ms": result["mean_ttft_ms"],
                "median_ttft_ms": result["median_ttft_ms"],
                "p90_ttft_ms": result["p90_ttft_ms"],
                "output_throughput": result["output_throughput"],
                "prefix_cache_queries": queries, "prefix_cache_hits": hits,
                "hit_rate": hits / queries if queries else 0.0}
    finally:
        os.killpg(up.pid, signal.SIGINT)
        up.wait(timeout=60)


def main() -> None:
    args = parse_args()
    redis_bin = shutil.which("redis-server")
    if redis_bin is None:
        raise SystemExit("needs redis-server for the Redis index")
    redis = subprocess.Popen([redis_bin, "--port", str(args.redis_port), "--bind",
                              "127.0.0.1", "--save", "", "--appendonly", "no"],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    configs = {
        "redis index": ["--index", f"redis://127.0.0.1:{args.redis_port}/0"],
        "memory index": ["--index", "memory"],
        "prefix caching off": ["--no-prefix-caching"],
    }
    results = {}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for name, flags in configs.items():
                results[name] = run_config(args, flags, Path(tmp) / "run.json")
                r = results[name]
                print(f"{name:20s} hit rate {r['hit_rate']:6.1%}  median TTFT "
                      f"{r['median_ttft_ms']:8.1f} ms  p90 {r['p90_ttft_ms']:8.1f} ms",
                      flush=True)
    finally:
        redis.terminate()
        redis.wait(timeout=10)
    off = results["prefix caching off"]["median_ttft_ms"]
    for name in ("redis index", "memory index"):
        results[name]["ttft_gain_over_no_cache"] = off / results[name]["median_ttft_ms"]
        print(f"{name}: median TTFT {results[name]['ttft_gain_over_no_cache']:.2f}x faster "
              f"than with prefix caching off")
    if args.json:
        args.json.write_text(json.dumps({"date": time.strftime("%Y-%m-%d"),
                                         "cpu_count": os.cpu_count(),
                                         "args": vars(args) | {"json": str(args.json)},
                                         "results": results}, indent=1))
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
