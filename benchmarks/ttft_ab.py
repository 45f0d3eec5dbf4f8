"""TTFT of serving configurations side by side. Every `--up` starts `tandem up` at once (on
the devices its flags name, each on its own port), then one request at a time goes to
each configuration in turn, `--rounds` rounds per prompt length. A launch-bound prefill
step on one machine drifts by several milliseconds from one run to the next, so runs of
one configuration after another compare badly; taken in turn, the drift falls on every
configuration alike. Reports each configuration's median TTFT per length and the median
over rounds of its difference from the first `--up`'s.

    python benchmarks/ttft_ab.py \\
        --common "--device cuda --dtype bfloat16 --model llama-3-8b --load-format dummy \\
                  --skip-tokenizer-init --max-num-seqs 128 --no-prefix-caching" \\
        --up "colocated=--colocated 1 --gpu-memory-fraction 0.3" \\
        --up "1P1D=--connector ipc --gpu-memory-fraction 0.5" \\
        --lengths 128,1024 --rounds 20 --json out.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import secrets
import shlex
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

from serve_matrix import _named, stop  # benchmarks/, beside this script
from serve_vs_engine import wait_ok

from tandem.bench.metrics import RequestRecord
from tandem.bench.serve import _first_model, _send
from tandem.node.auth import CLUSTER_SECRET_ENV


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--up", type=_named, action="append", required=True, metavar="NAME=FLAGS",
                   help="a configuration: tandem up with these flags (repeat; the first is "
                        "the one the others are compared with)")
    p.add_argument("--common", default="", help="flags every tandem up gets, quoted")
    p.add_argument("--lengths", default="128,1024",
                   help="prompt lengths in tokens, comma-separated (default: %(default)s)")
    p.add_argument("--rounds", type=int, default=20, help="(default: %(default)s)")
    p.add_argument("--warmup", type=int, default=3,
                   help="rounds per length thrown away first (default: %(default)s)")
    p.add_argument("--output-len", type=int, default=2, help="(default: %(default)s)")
    p.add_argument("--port", type=int, default=8410,
                   help="the first configuration's port; the next ones count up "
                        "(default: %(default)s)")
    p.add_argument("--log-dir", type=Path, default=None, help="each tandem up's log here")
    p.add_argument("--json", type=Path, default=None, help="write the results here")
    p.add_argument("--note", default="", help="said in the JSON: the machine, the tree, ...")
    return p.parse_args()


async def ttft_ms(session: Any, url: str, model: str, prompt: list[int], output_len: int
                  ) -> float:
    """One streamed completion of `prompt` (token ids): its time to first token."""
    payload = {"model": model, "prompt": prompt, "max_tokens": output_len, "temperature": 0.0,
               "stream": True, "ignore_eos": True}
    rec = RequestRecord(prompt_len=len(prompt))
    await _send(session, f"{url}/v1/completions", payload, False, rec)
    if not rec.success:
        raise RuntimeError(f"{url}: {rec.error}")
    return rec.ttft * 1e3


async def measure(args: argparse.Namespace, urls: dict[str, str]) -> dict[str, Any]:
    import aiohttp

    rng = random.Random(0)
    lengths = [int(n) for n in args.lengths.split(",")]
    out: dict[str, Any] = {}
    models = {name: await _first_model(url) for name, url in urls.items()}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
        for n in lengths:
            ttfts: dict[str, list[float]] = {name: [] for name in urls}
            for r in range(args.warmup + args.rounds):
                prompt = [rng.randrange(100, 30000) for _ in range(n)]
                order = list(urls) if r % 2 == 0 else list(reversed(urls))  # no fixed first
                for name in order:
                    ms = await ttft_ms(session, urls[name], models[name], prompt, args.output_len)
                    if r >= args.warmup:
                        ttfts[name].append(ms)
            base = next(iter(urls))
            out[str(n)] = {name: {
                "median_ttft_ms": statistics.median(t),
                "p90_ttft_ms": statistics.quantiles(t, n=10)[-1],
                "median_minus_first_ms": statistics.median(
                    a - b for a, b in zip(t, ttfts[base], strict=True)),
                "ttfts_ms": t} for name, t in ttfts.items()}
            print(f"{n} tokens: " + ", ".join(
                f"{name} {v['median_ttft_ms']:.2f} ms ({v['median_minus_first_ms']:+.2f})"
                for name, v in out[str(n)].items()), flush=True)
    return out


def main() -> None:
    args = parse_args()
    secret = os.environ.get(CLUSTER_SECRET_ENV) or secrets.token_hex(32)
    ups: dict[str, subprocess.Popen] = {}
    urls: dict[str, str] = {}
    logs = []
    try:
        for i, (name, flags) in enumerate(args.up):
            port = args.port + i
            log = (open(args.log_dir / f"up_{name}.log", "w") if args.log_dir
                   else subprocess.DEVNULL)
            logs.append(log)
            ups[name] = subprocess.Popen(
                [sys.executable, "-m", "tandem.cli", "up", "--port", str(port),
                 *shlex.split(args.common), *shlex.split(flags)],
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                env=os.environ | {CLUSTER_SECRET_ENV: secret})
            urls[name] = f"http://127.0.0.1:{port}"
            wait_ok(urls[name], ups[name])  # one at a time: each sizes its KV alone
        results = asyncio.run(measure(args, urls))
    finally:
        for up in ups.values():
            stop(up)
        for log in logs:
            if log is not subprocess.DEVNULL:
                log.close()
    if args.json:
        commands = {name: f"tandem up {args.common} {flags}" for name, flags in args.up}
        args.json.write_text(json.dumps({"note": args.note, "commands": commands,
                                         "rounds": args.rounds, "results": results},
                                        indent=1))
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
