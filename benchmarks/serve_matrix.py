"""Serving configurations against workloads in one run: each `--up` starts `tandem up`
with its flags, each `--bench` runs `tandem bench serve` against it, and one JSON holds
every result (sweeps: one result per rate, and the highest rate held at the attainment
goal). `--plot` draws every sweep of a workload on one figure, a line per configuration.

    python benchmarks/serve_matrix.py \\
        --common "--device cuda --dtype bfloat16 --model llama-3-8b --load-format dummy \\
                  --skip-tokenizer-init --max-num-seqs 128" \\
        --up "1P1D=--connector ipc" --up "colocated 1=--colocated 1" \\
        --bench "sweep=--num-prompts 96 --random-input-len 1024 --random-output-len 128 \\
                 --sweep-rates 16,32,48 --goodput ttft:500 tpot:50" \\
        --json benchmarks/results/serve_sweep.json --plot benchmarks/results/serve_sweep.png
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import secrets
import shlex
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from health_probe import HealthProbe  # benchmarks/, beside this script
from serve_vs_engine import wait_ok

from tandem.bench.serve import DETAILED
from tandem.node.auth import CLUSTER_SECRET_ENV


def _named(text: str) -> tuple[str, str]:
    name, sep, flags = text.partition("=")
    if not sep or not name.strip():
        raise argparse.ArgumentTypeError(f"expected NAME=FLAGS, got {text!r}")
    return name.strip(), flags


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--up", type=_named, action="append", required=True, metavar="NAME=FLAGS",
                   help="a configuration: tandem up with these flags (repeat)")
    p.add_argument("--bench", type=_named, action="append", required=True,
                   metavar="NAME=FLAGS", help="a workload: tandem bench serve flags (repeat)")
    p.add_argument("--common", default="", help="flags every tandem up gets, quoted")
    p.add_argument("--warmup", default="--num-prompts 8 --random-input-len 64 "
                   "--random-output-len 8 --max-concurrency 4",
                   help="bench flags of a run thrown away before the workloads "
                        "(empty: none; default: %(default)s)")
    p.add_argument("--attainment-goal", type=float, default=0.9,
                   help="a sweep reports the highest rate at this SLO attainment "
                        "(default: %(default)s)")
    p.add_argument("--port", type=int, default=8392, help="(default: %(default)s)")
    p.add_argument("--bench-timeout", type=float, default=3600,
                   help="seconds one tandem bench serve run (a whole sweep) may take "
                        "(default: %(default)s)")
    p.add_argument("--log-dir", type=Path, default=None,
                   help="keep each tandem up's output here (default: discarded)")
    p.add_argument("--json", type=Path, default=None, help="write every result here")
    p.add_argument("--detailed", type=Path, default=None,
                   help="write every result with its per-request lists here (for plots)")
    p.add_argument("--plot", type=Path, default=None,
                   help="sweeps: throughput, p90 TTFT/TPOT and attainment against the rate")
    p.add_argument("--probe-health", action="store_true",
                   help="sample every node's Health rpc during each workload and report "
                        "its latencies with the results (health_probe.py)")
    p.add_argument("--note", default="", help="said in the JSON: the machine, the tree, ...")
    return p.parse_args()


def bench(url: str, flags: str, out: Path, label: str, timeout_s: float | None = None
          ) -> list[dict[str, Any]]:
    """One `tandem bench serve` run: its results, one per rate (killed after `timeout_s`)."""
    argv = [sys.executable, "-m", "tandem.cli", "bench", "serve", "--base-url", url,
            *shlex.split(flags), "--label", label, "--save-result", "--save-detailed",
            "--result-dir", str(out), "--disable-tqdm"]
    subprocess.run(argv, check=True, stdout=subprocess.DEVNULL, timeout=timeout_s)
    found = sorted(p for p in out.glob(f"{label}-*.json") if "-sweep-" not in p.name)
    results = [json.loads(p.read_text()) for p in found]
    for p in out.glob("*.json"):
        p.unlink()
    return sorted(results, key=lambda r: float(r["request_rate"]))


def summary(result: dict[str, Any]) -> dict[str, Any]:
    """The result without its per-request lists."""
    return {k: v for k, v in result.items() if k not in DETAILED and k != "latencies"}


def max_rate(results: list[dict[str, Any]], goal: float) -> float | None:
    """The highest swept rate whose SLO attainment is at least `goal` (None: none is)."""
    held = [float(r["request_rate"]) for r in results
            if r.get("slo_attainment") is not None and r["slo_attainment"] >= goal]
    return max(held) if held else None


def stop(up: subprocess.Popen) -> None:
    """Ctrl-C to `tandem up` and its nodes; killed if they are not gone in a minute."""
    try:
        os.killpg(up.pid, signal.SIGINT)
        up.wait(timeout=60)
    except ProcessLookupError:  # it had exited
        pass
    except subprocess.TimeoutExpired:
        os.killpg(up.pid, signal.SIGKILL)
        up.wait()


def prefix_counts(url: str) -> dict[str, float]:
    """The router's prefix-cache counters, summed over each role's nodes: prompt tokens
    looked up (of requests that ended) and found, by tier: `prefill.queries`,
    `decode.hits_host`, ...; and where its requests' prompts were computed:
    `routed_prefill`, `routed_decode-local` (`routed_overflow` of those by
    --prefill-overflow-ms)."""
    text = urllib.request.urlopen(f"{url}/metrics", timeout=10).read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if m := re.match(r'tandem:router_requests_total\{pool="([^"]*)"\} (\S+)$', line):
            out[f"routed_{m[1]}"] = float(m[2])
        elif m := re.match(r"tandem:router_prefill_overflows_total (\S+)$", line):
            out["routed_overflow"] = float(m[1])
        elif m := re.match(r"tandem:prefix_cache_(queries|hits)_total\{([^}]*)\} (\S+)$", line):
            labels = dict(re.findall(r'(\w+)="([^"]*)"', m[2]))
            role = labels.get("node", "").split("@")[0]
            key = f"{role}.queries" if m[1] == "queries" else (
                f"{role}.hits_{labels.get('tier', 'device')}")
            out[key] = out.get(key, 0.0) + float(m[3])
    return out


def prefix_delta(before: dict[str, float], url: str) -> dict[str, float]:
    """What a workload added to `prefix_counts`, once the router's stats poll (every
    second) has seen its last requests; with each role's hit rate over the tokens it
    looked up."""
    time.sleep(2.5)
    after = prefix_counts(url)
    delta = {k: after[k] - before.get(k, 0.0) for k in after}
    for role in {k.split(".")[0] for k in delta if "." in k}:
        hits = sum(v for k, v in delta.items() if k.startswith(f"{role}.hits_"))
        queries = delta.get(f"{role}.queries", 0.0)
        delta[f"{role}.hit_rate"] = hits / queries if queries else 0.0
    return delta


def run_config(args: argparse.Namespace, name: str, flags: str, tmp: Path
               ) -> dict[str, list[dict[str, Any]]]:
    """`tandem up` with `args.common` and `flags`, `args.warmup`, then each workload of
    `args.bench` against it: its results by workload. The cluster is stopped however
    this ends."""
    url = f"http://127.0.0.1:{args.port}"
    log = (open(args.log_dir / f"up_{name.replace(' ', '_')}.log", "w") if args.log_dir
           else subprocess.DEVNULL)
    # A cluster secret known here, so the Health probe's calls are obeyed.
    secret = os.environ.get(CLUSTER_SECRET_ENV) or secrets.token_hex(32)
    up = subprocess.Popen(
        [sys.executable, "-m", "tandem.cli", "up", "--port", str(args.port),
         *shlex.split(args.common), *shlex.split(flags)],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        env=os.environ | {CLUSTER_SECRET_ENV: secret})
    try:
        wait_ok(url, up)
        if args.warmup:
            bench(url, args.warmup, tmp, "warmup", args.bench_timeout)
        runs = {}
        for workload, bench_flags in args.bench:
            probing = HealthProbe(url, secret) if args.probe_health else None
            before = prefix_counts(url)
            with probing or contextlib.nullcontext() as probe:
                results = bench(url, bench_flags, tmp, "run", args.bench_timeout)
            runs[workload] = results
            cache = prefix_delta(before, url)
            for r in results:
                r["prefix_cache"] = cache
            print(f"{name} / {workload}: prefix cache, routing " + ", ".join(
                f"{k} {v:,.4g}" for k, v in sorted(cache.items())), flush=True)
            if probe is not None:
                health = probe.summary()
                for r in results:
                    r["health"] = health
                print(f"{name} / {workload}: Health " + ", ".join(
                    f"{node} max {h['max_ms'] or 0:.1f} ms, {h['misses']} missed"
                    for node, h in health.items()), flush=True)
            for r in results:
                att = r.get("slo_attainment")
                print(f"{name} / {workload} @ {r['request_rate']} req/s: "
                      f"{r['output_throughput']:.0f} out tok/s, median TTFT "
                      f"{r['median_ttft_ms']:.1f} ms, median ITL {r['median_itl_ms']:.2f} ms"
                      + (f", attainment {att:.1%}" if att is not None else ""), flush=True)
        return runs
    finally:
        stop(up)
        if log is not subprocess.DEVNULL:
            log.close()


def plot_workloads(raw: dict[str, dict[str, list[dict[str, Any]]]], workloads: list[str],
                   path: Path) -> None:
    """One sweep figure per workload, a line per configuration: `path` itself for one
    workload, else `path` with the workload's name appended to its stem."""
    from tandem.bench.plots import plot_sweep

    for workload in workloads:
        out = path if len(workloads) == 1 else path.with_name(
            f"{path.stem}_{workload}{path.suffix}")
        plot_sweep({name: runs[workload] for name, runs in raw.items()}, out)


def main() -> None:
    args = parse_args()
    if args.log_dir:
        args.log_dir.mkdir(parents=True, exist_ok=True)
    raw: dict[str, dict[str, list[dict[str, Any]]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, flags in args.up:
            raw[name] = run_config(args, name, flags, Path(tmp))
    doc: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d"), "note": args.note,
        "commands": {name: f"tandem up {args.common} {flags}".strip() for name, flags in args.up}
        | {f"bench {w}": f"tandem bench serve {f}" for w, f in args.bench},
        "runs": {name: {w: [summary(r) for r in rs] for w, rs in runs.items()}
                 for name, runs in raw.items()},
        "ttfts_ms": {name: {w: [[t * 1000 for t in r["ttfts"]] for r in rs]
                            for w, rs in runs.items()} for name, runs in raw.items()},
    }
    goal = {}
    for name, runs in raw.items():
        for workload, results in runs.items():
            if len(results) > 1:
                goal.setdefault(workload, {})[name] = max_rate(results, args.attainment_goal)
    if goal:
        doc[f"max_rate_at_{args.attainment_goal:.0%}_attainment"] = goal
        for workload, rates in goal.items():
            print(f"{workload}: highest rate at >= {args.attainment_goal:.0%} attainment: "
                  + ", ".join(f"{n} {r}" for n, r in rates.items()))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(doc, indent=1))
        print(f"wrote {args.json}")
    if args.detailed:
        args.detailed.write_text(json.dumps(raw))
    if args.plot and goal:
        plot_workloads(raw, list(goal), args.plot)


if __name__ == "__main__":
    main()
