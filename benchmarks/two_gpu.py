"""The two-GPU benchmark of record: 1P1D (a prefill GPU and a decode GPU) against two
colocated replicas on the same two GPUs, in one run, one JSON.

1. Goodput under SLOs: `tandem up` 1P1D with each `--connectors` entry, then
   `--colocated 2`, each against Poisson rate sweeps of random prompts (`--workload`,
   default 1,024 -> 128 and 4,096 -> 256, SLOs TTFT <= 500 ms and TPOT <= 50 ms): the
   highest rate each holds at 90% SLO attainment, and the ratio 1P1D / colocated.
2. The TTFT disaggregation adds: single 2,048-token requests one at a time through each
   configuration, against the engine's own prefill of the same prompts (the offline
   engine on the first device with the same flags, run before any cluster holds it).
3. The transfer rates, GPU 0 -> GPU 1: raw NCCL p2p (`nccl_p2p.py`) and each connector
   (`transfer.py`), run first, while nothing else holds the GPUs.

Defaults are the run of record, on `nvidia-h200-x2` (estimated at 15-20 minutes):

    python benchmarks/two_gpu.py --kind nvidia-h200-x2 \\
        --json benchmarks/results/two_gpu_nvidia-h200-x2.json \\
        --plot benchmarks/results/two_gpu_nvidia-h200-x2.png

A command may run for at most so long on a lent machine, so the run can be split: each
call runs some configurations (`--only`) and writes what it measured (`--part`); a later
call reads earlier parts (`--merge`), skips what they hold, and once every configuration
is measured writes the tables, JSON and plots (a final `--merge` of every part needs no
GPU):

    python benchmarks/two_gpu.py --only ipc --part p1.json
    python benchmarks/two_gpu.py --merge p1.json --only colocated --part p2.json
    python benchmarks/two_gpu.py --merge p1.json p2.json --only nccl --part p3.json
    python benchmarks/two_gpu.py --merge p1.json p2.json p3.json --json ... --plot ...

Every piece is a flag, so the same code dry-runs on a CPU (`--skip-transfer` skips the
GPU-only part 3; `nccl` runs over gloo there):

    python benchmarks/two_gpu.py --devices cpu,cpu \\
        --common "--device cpu --dtype float32 --max-num-seqs 8 --no-prefix-caching" \\
        --warmup "--num-prompts 2 --random-input-len 32 --random-output-len 4" \\
        --workload 64:8:8:1,2 --ttft-len 128 --ttft-requests 3 --ttft-warmup 1 \\
        --skip-transfer --json /tmp/two_gpu.json --plot /tmp/two_gpu.png
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import platform
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from serve_matrix import max_rate, plot_workloads, run_config, summary  # benchmarks/

from tandem.bench.datasets import random_requests

HERE = Path(__file__).resolve().parent
COMMON = ("--device cuda --dtype bfloat16 --model llama-3-8b --load-format dummy "
          "--skip-tokenizer-init --max-num-seqs 128 --no-prefix-caching")
WORKLOADS = ("1024:128:192:16,24,32,40,48,56,64", "4096:256:128:4,6,8,10,12,14,16")
COLOCATED = "colocated 2"
TTFT = "ttft"  # the workload name of the single-request TTFT run
# The TTFT prompts' seed: not the sweeps' (0), so no TTFT prompt starts with a sweep's.
TTFT_SEED = 1
MOONCAKE_PCT = 4.2  # the TTFT Mooncake reports disaggregation adding
TARGET_PCT = 3.0


@dataclass(frozen=True)
class Workload:
    input_len: int
    output_len: int
    num_prompts: int  # per rate
    rates: tuple[float, ...]

    @property
    def name(self) -> str:
        return f"{self.input_len}-{self.output_len}"

    def bench_flags(self, slos: str) -> str:
        return (f"--num-prompts {self.num_prompts} --random-input-len {self.input_len} "
                f"--random-output-len {self.output_len} "
                f"--sweep-rates {','.join(f'{r:g}' for r in self.rates)} "
                f"--goodput {slos} --metric-percentiles 50,90,99")


def _workload(text: str) -> Workload:
    try:
        tokens_in, tokens_out, prompts, rates = text.split(":")
        return Workload(int(tokens_in), int(tokens_out), int(prompts),
                        tuple(float(r) for r in rates.split(",")))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected INPUT:OUTPUT:PROMPTS:R1,R2,..., got {text!r}") from None


def _devices(text: str) -> tuple[str, str]:
    names = [d.strip() for d in text.split(",")]
    if len(names) != 2 or not all(names):
        raise argparse.ArgumentTypeError(f"expected two devices, got {text!r}")
    return names[0], names[1]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    g = p.add_argument_group("configurations")
    g.add_argument("--devices", type=_devices, default=("cuda:0", "cuda:1"), metavar="D0,D1",
                   help="1P1D: prefill on D0, decode on D1; colocated: a replica on each "
                        "(default: cuda:0,cuda:1)")
    g.add_argument("--connectors", default="ipc,nccl",
                   help="one 1P1D configuration per connector (default: %(default)s)")
    g.add_argument("--overflow-connectors", default="",
                   help="one more 1P1D configuration per connector here, named "
                        "'<connector>-overflow', whose router sends the prefill node's "
                        "overflow to the decode node (--prefill-overflow-ms; default: none)")
    g.add_argument("--overflow-ms", type=float, default=200.0,
                   help="those configurations' --prefill-overflow-ms (default: %(default)s)")
    g.add_argument("--overflow-flags", default="",
                   help="more tandem up flags for those configurations, e.g. "
                        "'--decode-max-num-batched-tokens 512'")
    g.add_argument("--common", default=COMMON,
                   help="flags every tandem up gets, and the offline engine its engine "
                        "flags (default: %(default)s)")
    g.add_argument("--port", type=int, default=8394, help="(default: %(default)s)")
    g = p.add_argument_group("goodput")
    g.add_argument("--workload", type=_workload, action="append", default=None,
                   metavar="IN:OUT:PROMPTS:R1,R2,...",
                   help="a sweep of random IN -> OUT token requests, PROMPTS per rate "
                        f"(repeat; default: {' and '.join(WORKLOADS)})")
    g.add_argument("--slos", default="ttft:500 tpot:50",
                   help="tandem bench serve --goodput (default: %(default)s)")
    g.add_argument("--tight-slos", default="ttft:500 tpot:15",
                   help="a second SLO pair, judged from each request's TTFT and TPOT "
                        "(where a colocated node's prefills break its decodes' pace; "
                        "default: %(default)s)")
    g.add_argument("--attainment-goal", type=float, default=0.9,
                   help="a sweep reports the highest rate at this SLO attainment "
                        "(default: %(default)s)")
    g.add_argument("--warmup", default="--num-prompts 32 --random-input-len 2048 "
                   "--random-range-ratio 0.75 --random-output-len 16 --max-concurrency 8",
                   help="bench flags of a run thrown away after each start-up (default: "
                        "%(default)s: prompt lengths 512..3,584, chunked ones included)")
    g.add_argument("--probe-health", action="store_true",
                   help="sample every node's Health rpc during each workload "
                        "(health_probe.py)")
    g.add_argument("--bench-timeout", type=float, default=1200,
                   help="seconds one tandem bench serve run may take (default: %(default)s)")
    g = p.add_argument_group("TTFT of disaggregation")
    g.add_argument("--ttft-len", type=int, default=2048, help="prompt tokens (default: 2048)")
    g.add_argument("--ttft-requests", type=int, default=20,
                   help="timed, after --ttft-warmup more, each served one at a time and "
                        "prefilled by the offline engine (default: %(default)s)")
    g.add_argument("--ttft-warmup", type=int, default=3, help="(default: %(default)s)")
    g.add_argument("--engine-timeout", type=float, default=900,
                   help="seconds the offline engine may take, load included "
                        "(default: %(default)s)")
    g = p.add_argument_group("transfer")
    g.add_argument("--skip-transfer", action="store_true",
                   help="skip nccl_p2p.py and transfer.py (they need two GPUs): for dry runs")
    g.add_argument("--p2p-mb", type=float, default=268.4,
                   help="raw NCCL p2p message size in MB: one 2,048-token Llama-3-8B "
                        "request's KV (default: %(default)s)")
    g.add_argument("--transfer-iters", type=int, default=20, help="(default: %(default)s)")
    g = p.add_argument_group("output")
    g.add_argument("--kind", default=None,
                   help="the machine, as the README names it (default: from the devices)")
    g.add_argument("--log-dir", type=Path, default=None,
                   help="keep each tandem up's output here (default: discarded)")
    g.add_argument("--json", type=Path, default=None, help="write every result here")
    g.add_argument("--detailed", type=Path, default=None,
                   help="write every run with its per-request lists here")
    g.add_argument("--plot", type=Path, default=None,
                   help="one sweep figure per workload (its name appended to the stem)")
    g.add_argument("--note", default="", help="said in the JSON")
    g = p.add_argument_group("a run split over several calls")
    g.add_argument("--only", default=None, metavar="NAMES",
                   help="run only these configurations: connector names and 'colocated', "
                        "comma-separated (default: every one not in --merge's parts)")
    g.add_argument("--part", type=Path, default=None,
                   help="write what this call measured (per-request lists too) here")
    g.add_argument("--merge", type=Path, nargs="+", default=[], metavar="PART",
                   help="earlier calls' --part files: their measurements are reused, not "
                        "run again (the machine is the first part's)")
    args = p.parse_args()
    args.workload = args.workload or [_workload(w) for w in WORKLOADS]
    args.connectors = [c.strip() for c in args.connectors.split(",") if c.strip()]
    args.overflow_connectors = [c.strip() for c in args.overflow_connectors.split(",")
                                if c.strip()]
    return args


def configurations(args: argparse.Namespace) -> dict[str, str]:
    """Name -> `tandem up` flags (beside `--common`)."""
    first, second = args.devices
    def one_p_one_d(c: str) -> str:
        return (f"--prefill 1 --decode 1 --prefill-devices {first} --decode-devices {second} "
                f"--connector {c}")

    disaggregated = {f"1P1D {c}": one_p_one_d(c) for c in args.connectors}
    overflow = {f"1P1D {c}-overflow": (f"{one_p_one_d(c)} --prefill-overflow-ms "
                                       f"{args.overflow_ms:g} {args.overflow_flags}").strip()
                for c in args.overflow_connectors}
    return (disaggregated | overflow
            | {COLOCATED: f"--colocated 2 --decode-devices {first},{second}"})


def selected(args: argparse.Namespace, configs: dict[str, str]) -> dict[str, str]:
    """The configurations `--only` names (all of them without it)."""
    if args.only is None:
        return configs
    wanted = {n.strip() for n in args.only.split(",") if n.strip()}
    names = {n: n.split()[-1] if n != COLOCATED else "colocated" for n in configs}
    unknown = wanted - set(names.values())
    if unknown:
        raise SystemExit(f"--only: no configuration {sorted(unknown)}; "
                         f"choose from {sorted(names.values())}")
    return {n: f for n, f in configs.items() if names[n] in wanted}


def load_parts(paths: list[Path]) -> dict[str, Any]:
    """Earlier calls' measurements, merged: machine, engine_ms, transfer, raw."""
    merged: dict[str, Any] = {"raw": {}}
    for path in paths:
        part = json.loads(path.read_text())
        for key in ("machine", "engine_ms", "transfer"):
            if key in part and key not in merged:
                merged[key] = part[key]
        merged["raw"].update(part["raw"])
    return merged


def ttft_flags(args: argparse.Namespace) -> str:
    return (f"--num-prompts {args.ttft_warmup + args.ttft_requests} --random-input-len "
            f"{args.ttft_len} --random-output-len 2 --max-concurrency 1 --seed {TTFT_SEED}")


def machine(kind: str | None) -> dict[str, Any]:
    import torch

    gpus = ([torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
            if torch.cuda.is_available() else [])
    tree = subprocess.run(["git", "-C", str(HERE), "describe", "--always", "--dirty"],
                          capture_output=True, text=True, check=False).stdout.strip()
    return {"kind": kind or (f"{len(gpus)} x {gpus[0]}" if gpus else "cpu"), "gpus": gpus,
            "host": platform.node(), "tree": tree,
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}


def transfer_rates(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    """Raw NCCL p2p and each connector, GPU 0 -> GPU 1, as the transfer benchmarks
    measure them (each a subprocess, bounded)."""
    p2p = subprocess.run([sys.executable, str(HERE / "nccl_p2p.py"), "--sizes-mb",
                          str(args.p2p_mb)], check=True, capture_output=True, text=True,
                         timeout=600).stdout
    out: dict[str, Any] = {"nccl_p2p_gbps": _p2p_table(p2p), "connectors": {}}
    for connector in args.connectors:
        path = tmp / f"transfer_{connector}.json"
        subprocess.run([sys.executable, str(HERE / "transfer.py"), "--connector", connector,
                        "--device", "cuda", "--iters", str(args.transfer_iters),
                        "--json", str(path)], check=True, stdout=subprocess.DEVNULL,
                       timeout=600)
        out["connectors"][connector] = json.loads(path.read_text())
    return out


def _p2p_table(stdout: str) -> dict[str, float]:
    """nccl_p2p.py's table: a `size MB  GB/s` row per size, under a header."""
    rates = {}
    for line in stdout.splitlines():
        try:
            mb, gbps = map(float, line.split())
        except ValueError:
            continue  # the header
        rates[f"{mb:g}"] = gbps
    if not rates:
        raise RuntimeError(f"nccl_p2p.py printed no rates:\n{stdout}")
    return rates


def engine_prefill_ms(common: str, device: str, length: int, runs: int, warmup: int
                      ) -> list[float]:
    """The engine's own time for one token of each of the served TTFT run's prompts (the
    bench's own, same count and seed), one call each: an engine built from `common`'s
    engine flags as `tandem node` builds its own. Milliseconds of each timed call."""
    from tandem.cli import build_parser
    from tandem.engine.cli_generate import engine_config
    from tandem.engine.llm_engine import LLMEngine, run_to_completion
    from tandem.engine.sampling_params import SamplingParams

    flags, _ = build_parser().parse_known_args(
        ["generate", *shlex.split(common), "--device", device])
    engine = LLMEngine(engine_config(flags))
    prompts = random_requests(warmup + runs, length, 2, 0.0, engine.model_config.vocab_size,
                              TTFT_SEED)
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    times = []
    for i, r in enumerate(prompts):
        req = engine.make_request(f"prefill-{i}", list(r.prompt), one)
        t = time.perf_counter()
        run_to_completion(engine, [req])  # returns with the token on the host
        times.append((time.perf_counter() - t) * 1000)
    return times[warmup:]


def engine_prefill(args: argparse.Namespace) -> list[float]:
    """`engine_prefill_ms` in a process of its own, so its device memory is surely
    free when it returns."""
    with mp.get_context("spawn").Pool(1) as pool:
        job = pool.apply_async(engine_prefill_ms, (args.common, args.devices[0],
                                                   args.ttft_len, args.ttft_requests,
                                                   args.ttft_warmup))
        times = job.get(timeout=args.engine_timeout)
        pool.close()  # a clean exit: terminating it leaks a semaphore
        pool.join()
    return times


def ttft_overhead(args: argparse.Namespace, engine_ms: list[float],
                  raw: dict[str, dict[str, list[dict[str, Any]]]]) -> dict[str, Any]:
    """Each configuration's median served TTFT against the engine's median prefill."""
    engine = statistics.median(engine_ms)
    served = {}
    for name, runs in raw.items():
        (run,) = runs[TTFT]
        ms = [t * 1000 for t, e in zip(run["ttfts"], run["errors"]) if not e]
        ms = ms[args.ttft_warmup:]
        ttft = statistics.median(ms)
        served[name] = {"ttfts_ms": ms, "median_ms": ttft, "added_ms": ttft - engine,
                        "added_pct": 100 * (ttft - engine) / ttft}
    colocated = served[COLOCATED]["median_ms"]
    for s in served.values():
        s["over_colocated_ms"] = s["median_ms"] - colocated
    return {"prompt_tokens": args.ttft_len, "requests": args.ttft_requests,
            "engine_prefill_median_ms": engine,
            "served": served, "target_pct": TARGET_PCT, "mooncake_pct": MOONCAKE_PCT}


def goodput(args: argparse.Namespace, raw: dict[str, dict[str, list[dict[str, Any]]]]
            ) -> tuple[dict[str, dict[str, float | None]], dict[str, dict[str, float]]]:
    """Per workload: each configuration's highest rate at the attainment goal, and each
    disaggregated one's ratio to colocated (where both held some rate)."""
    rates = {w.name: {name: max_rate(runs[w.name], args.attainment_goal)
                      for name, runs in raw.items()} for w in args.workload}
    ratios = {}
    for workload, held in rates.items():
        base = held[COLOCATED]
        ratios[workload] = {name: r / base for name, r in held.items()
                            if name != COLOCATED and r is not None and base}
    return rates, ratios


def _slo_ms(slos: str) -> dict[str, float]:
    """`ttft:500 tpot:15` -> {"ttft": 500.0, "tpot": 15.0}."""
    return {k: float(v) for k, v in (part.split(":") for part in slos.split())}


def attainment(result: dict[str, Any], slos: str) -> float:
    """The share of a run's requests that met `slos` (ttft, tpot in ms), from its
    per-request lists; a failed request meets none."""
    limit = _slo_ms(slos)
    met = 0
    for ttft, latency, out, error in zip(result["ttfts"], result["latencies"],
                                         result["output_lens"], result["errors"]):
        tpot = (latency - ttft) / (out - 1) if out > 1 else 0.0
        met += not error and ttft * 1e3 <= limit.get("ttft", math.inf) and (
            tpot * 1e3 <= limit.get("tpot", math.inf))
    return met / max(1, len(result["ttfts"]))


def ideal_fifo(rate: float, service_s: float, ttft_s: float, requests: int,
               runs: int = 400) -> float:
    """The mean SLO attainment of an ideal prefill server: one FIFO queue, each prompt
    taking `service_s` with nothing else added, Poisson arrivals at `rate` (`runs`
    seeded runs of `requests` each): the most any 1P1D with one prefill GPU of that speed
    can hold at `ttft_s`, whatever its serving path costs."""
    import random

    met = 0
    for seed in range(runs):
        arrivals = random.Random(seed)
        now = free = 0.0
        for _ in range(requests):
            now += arrivals.expovariate(rate)
            free = max(now, free) + service_s
            met += free - now <= ttft_s
    return met / (runs * requests)


def capacity(args: argparse.Namespace, engine_ms: list[float],
             raw: dict[str, dict[str, list[dict[str, Any]]]]) -> dict[str, Any]:
    """The prefill GPU's rate, R = its prefill tokens/s (the engine's, measured in this
    run) / the prompt length, per workload; and at each SLO pair each configuration's
    highest rate at the attainment goal, and 1P1D's as a share of R and of colocated's."""
    tokens_s = args.ttft_len / (statistics.median(engine_ms) / 1e3)
    out: dict[str, Any] = {"prefill_tokens_per_s": tokens_s, "workloads": {}}
    for w in args.workload:
        entry: dict[str, Any] = {"R": tokens_s / w.input_len}
        ttft_s = _slo_ms(args.slos).get("ttft", math.inf) / 1e3
        entry["ideal_fifo_attainment"] = {
            f"{r:g}": ideal_fifo(r, w.input_len / tokens_s, ttft_s, w.num_prompts)
            for r in w.rates}
        for slos in (args.slos, args.tight_slos):
            held = {}
            for name, runs in raw.items():
                rates = [float(r["request_rate"]) for r in runs[w.name]
                         if attainment(r, slos) >= args.attainment_goal]
                held[name] = max(rates) if rates else None
            entry[slos] = {"max_rate": held, "of_R": {
                n: r / entry["R"] for n, r in held.items() if r is not None}}
        out["workloads"][w.name] = entry
    return out


def _num(x: float | None, unit: str = "") -> str:
    return "none" if x is None else f"{x:,.4g}{unit}"


def markdown(args: argparse.Namespace, doc: dict[str, Any]) -> str:
    """The README's tables."""
    m, goal = doc["machine"], f"{args.attainment_goal:.0%}"
    lines = [f"**`{m['kind']}` ({', '.join(m['gpus']) or m['host']}), {m['date']}**, "
             f"one run, `{args.common}`; SLOs `{args.slos}`.", ""]
    head = "| configuration |"
    for w in args.workload:
        head += f" {w.input_len:,} -> {w.output_len}: req/s at {goal} | ratio |"
    lines += [head + f" TTFT, {args.ttft_len:,} tokens | added to the engine's prefill |",
              "|" + " --- |" * (3 + 2 * len(args.workload))]
    ttft, names = doc["ttft"], list(doc["runs"])
    for name in names:
        row = f"| {name} |"
        for w in args.workload:
            ratio = doc["ratio_to_colocated"][w.name].get(name)
            row += (f" {_num(doc['max_rate'][w.name][name])} |"
                    f" {'1x' if name == COLOCATED else _num(ratio, 'x')} |")
        s = ttft["served"][name]
        lines.append(row + f" {s['median_ms']:.1f} ms | {s['added_ms']:.1f} ms "
                           f"({s['added_pct']:.1f}%) |")
    transfer = ", ".join(f"{n} {ttft['served'][n]['over_colocated_ms']:.1f} ms"
                         for n in names if n != COLOCATED)
    lines += ["", f"Engine prefill alone, median of {args.ttft_requests}: "
              f"{ttft['engine_prefill_median_ms']:.1f} ms (target: added <= {TARGET_PCT:g}% "
              f"of TTFT; Mooncake reports {MOONCAKE_PCT:g}%). TTFT over colocated's (the "
              f"transfer's share): {transfer}."]
    for w in args.workload:
        lines += ["", f"{w.input_len:,} -> {w.output_len}, {w.num_prompts} requests per rate "
                  "(attainment, goodput req/s, p90 TTFT):", "",
                  "| req/s |" + "".join(f" {n} |" for n in names),
                  "|" + " --- |" * (1 + len(names))]
        for i, rate in enumerate(w.rates):
            row = f"| {rate:g} |"
            for name in names:
                r = doc["runs"][name][w.name][i]
                row += (f" {r['slo_attainment']:.1%}, {r['request_goodput']:.1f},"
                        f" {r['p90_ttft_ms']:,.0f} ms |")
            lines.append(row)
    cap = doc["capacity"]
    lines += ["", f"Prefill capacity of one GPU (the engine's {args.ttft_len:,}-token prefill):"
              f" {cap['prefill_tokens_per_s']:,.0f} tokens/s. Highest rate at {goal} "
              "attainment (share of R):", "",
              "| workload | R req/s | SLOs |" + "".join(f" {n} |" for n in names),
              "|" + " --- |" * (3 + len(names))]
    for w in args.workload:
        entry = cap["workloads"][w.name]
        for slos in (args.slos, args.tight_slos):
            row = f"| {w.input_len:,} -> {w.output_len} | {entry['R']:.1f} | `{slos}` |"
            for name in names:
                rate = entry[slos]["max_rate"][name]
                share = entry[slos]["of_R"].get(name)
                row += f" {_num(rate)}" + (f" ({share:.0%})" if share else "") + " |"
            lines.append(row)
    lines += ["", "An ideal prefill server of that rate (one FIFO queue, nothing but the "
              "prefill itself, Poisson arrivals; the most 1P1D can hold) would attain, at "
              f"TTFT <= {_slo_ms(args.slos).get('ttft', math.inf):g} ms:", ""]
    for w in args.workload:
        ideal = cap["workloads"][w.name]["ideal_fifo_attainment"]
        lines.append(f"- {w.input_len:,} -> {w.output_len}: " + ", ".join(
            f"{r} req/s {a:.0%}" for r, a in ideal.items()))
    if "transfer" in doc:
        t = doc["transfer"]
        p2p = t["nccl_p2p_gbps"][f"{args.p2p_mb:g}"]
        lines += ["", "| transfer, GPU 0 -> GPU 1 | GB/s | of raw p2p |", "| --- | --- | --- |",
                  f"| raw NCCL p2p, {args.p2p_mb:g} MB | {p2p:.1f} | 100% |"]
        for c, r in t["connectors"].items():
            lines.append(f"| `{c}` connector, {r['tokens']:,} tokens ({r['bytes'] / 1e6:.1f} "
                         f"MB) | {r['median_gbps']:.1f} | {r['median_gbps'] / p2p:.0%} |")
    return "\n".join(lines)


def _terminate(*_: object) -> None:
    raise SystemExit(143)  # so every `finally` stops its cluster on SIGTERM too


def main() -> None:
    args = parse_args()
    signal.signal(signal.SIGTERM, _terminate)
    if args.log_dir:
        args.log_dir.mkdir(parents=True, exist_ok=True)
    configs = configurations(args)
    args.bench = [(w.name, w.bench_flags(args.slos)) for w in args.workload]
    args.bench.append((TTFT, ttft_flags(args)))
    earlier = load_parts(args.merge)
    raw: dict[str, dict[str, list[dict[str, Any]]]] = dict(earlier["raw"])
    part: dict[str, Any] = {"machine": earlier.get("machine") or machine(args.kind), "raw": {}}
    doc: dict[str, Any] = {"machine": part["machine"], "note": args.note,
                           "commands": {n: f"tandem up {args.common} {f}"
                                        for n, f in configs.items()}
                           | {f"bench {w}": f"tandem bench serve {f}" for w, f in args.bench}}

    def save_part() -> None:  # what this call measured, so far
        if args.part:
            args.part.parent.mkdir(parents=True, exist_ok=True)
            args.part.write_text(json.dumps(part))

    with tempfile.TemporaryDirectory() as tmp:
        if "transfer" in earlier:
            doc["transfer"] = earlier["transfer"]
        elif not args.skip_transfer:
            doc["transfer"] = part["transfer"] = transfer_rates(args, Path(tmp))
            save_part()
            print("transfer:", {"nccl_p2p_gbps": doc["transfer"]["nccl_p2p_gbps"]}
                  | {c: round(r["median_gbps"], 1)
                     for c, r in doc["transfer"]["connectors"].items()}, flush=True)
        engine_ms = earlier.get("engine_ms")
        if engine_ms is None:
            engine_ms = part["engine_ms"] = engine_prefill(args)
            save_part()
            print(f"engine prefill, {args.ttft_len} tokens: median "
                  f"{statistics.median(engine_ms):.1f} ms", flush=True)
        doc["engine_prefill_ms"] = engine_ms
        for name, flags in selected(args, configs).items():
            if name in raw:
                continue  # measured by an earlier call
            raw[name] = part["raw"][name] = run_config(args, name, flags, Path(tmp))
            save_part()
            doc["runs"] = {n: {w: [summary(r) for r in rs] for w, rs in runs.items()}
                           for n, runs in raw.items()}
            if args.json:  # what a later failure leaves
                args.json.parent.mkdir(parents=True, exist_ok=True)
                args.json.write_text(json.dumps(doc | {"partial": True}, indent=1))
    missing = [n for n in configs if n not in raw]
    if missing:
        print(f"not measured yet: {', '.join(missing)}; the tables wait for a call that "
              "merges every part", flush=True)
        return
    raw = {n: raw[n] for n in configs}  # in the tables' order
    doc["runs"] = {n: {w: [summary(r) for r in rs] for w, rs in runs.items()}
                   for n, runs in raw.items()}
    doc["max_rate"], doc["ratio_to_colocated"] = goodput(args, raw)
    doc["attainment_goal"] = args.attainment_goal
    doc["ttft"] = ttft_overhead(args, engine_ms, raw)
    doc["capacity"] = capacity(args, engine_ms, raw)
    table = markdown(args, doc)
    print("\n" + table)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(doc | {"markdown": table}, indent=1))
        print(f"wrote {args.json}")
    if args.detailed:
        args.detailed.write_text(json.dumps(raw))
    if args.plot:
        args.plot.parent.mkdir(parents=True, exist_ok=True)
        plot_workloads(raw, [w.name for w in args.workload], args.plot)


if __name__ == "__main__":
    main()
