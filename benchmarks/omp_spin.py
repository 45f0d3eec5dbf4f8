"""How long the OpenMP workers of CPU nodes that share the cores should spin: `tandem up`
(1P1D by default) on this machine's CPU, its nodes started under each GOMP_SPINCOUNT
given ("passive": OMP_WAIT_POLICY=PASSIVE, no spin), measured as `vs_llamacpp.py` measures
it (1 and 8 streams of --input-len -> --output-len, streamed) and with a burst of
--burst-prompts short completions at once (rate inf); one JSON.

    .venv/bin/python benchmarks/omp_spin.py --spins passive,10000,300000 \\
        --up-flags "--cpu-weights fp16" --json benchmarks/results/omp_spin_cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import sys
import time
from pathlib import Path
from typing import Any

import vs_llamacpp as served_bench


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--spins", default="passive,10000,300000",
                   help="GOMP_SPINCOUNT values, comma-separated; 'passive' for "
                        "OMP_WAIT_POLICY=PASSIVE (default: %(default)s)")
    p.add_argument("--rounds", type=int, default=1,
                   help="times each setting runs, in turn (default: %(default)s)")
    p.add_argument("--up-flags", default="--cpu-weights fp16",
                   help="tandem up's flags, quoted (default: %(default)s)")
    p.add_argument("--input-len", type=int, default=64, help="(default: %(default)s)")
    p.add_argument("--output-len", type=int, default=128, help="(default: %(default)s)")
    p.add_argument("--prompts-per-stream", type=int, default=4,
                   help="prompts sent per stream at 1 and 8 streams (default: %(default)s)")
    p.add_argument("--burst-prompts", type=int, default=64,
                   help="completions of 16 -> 16 tokens sent at once (default: %(default)s)")
    p.add_argument("--json", type=Path, default=None, help="write the figures here")
    return p.parse_args()


def _env(spin: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    if spin == "passive":
        env["OMP_WAIT_POLICY"] = "PASSIVE"
    else:
        env["GOMP_SPINCOUNT"] = str(int(spin))
    return env


def one(spin: str, args: argparse.Namespace) -> dict[str, Any]:
    """Streams and a burst against one `tandem up`, its nodes under `spin`."""
    port = served_bench._free_port()
    cmd = [sys.executable, "-m", "tandem.cli", "up", "--port", str(port),
           *shlex.split(args.up_flags)]
    burst = argparse.Namespace(input_len=16, output_len=16)
    figures: dict[str, Any] = {}

    def run(url: str) -> None:
        figures.update(served_bench.streams(url, args))
        started = time.monotonic()
        figures["burst"] = served_bench.bench(url, args.burst_prompts, args.burst_prompts,
                                              burst)
        figures["burst"]["wall_s"] = time.monotonic() - started

    # The nodes inherit `spin`'s environment through tandem up.
    served_bench.serve(cmd, port, served_bench.tandem_up_ok, run, env=_env(spin))
    return figures


def main() -> None:
    args = parse_args()
    spins = args.spins.split(",")
    runs: dict[str, list[dict[str, Any]]] = {spin: [] for spin in spins}
    for _ in range(args.rounds):
        for spin in spins:
            print(f"spin {spin}: tandem up {args.up_flags}", flush=True)
            runs[spin].append(one(spin, args))
    if args.json:
        args.json.write_text(json.dumps({
            "date": time.strftime("%Y-%m-%d"),
            "machine": {"cpu_count": os.cpu_count(), "processor": served_bench._cpu_name(),
                        "platform": platform.platform()},
            "args": {k: str(v) for k, v in vars(args).items()},
            "runs": runs,
        }, indent=1) + "\n")


if __name__ == "__main__":
    main()
