"""Soak: `tandem up` under a mixed workload for a given time, its memory and KV blocks
sampled every minute. Not a test (it runs for as long as asked): the report says whether
memory stayed flat and whether any block was still held once the load stopped.

The workload, from `--concurrency` client threads, each request drawn at random:
streaming and whole completions and chats, short and long prompts, prompts sharing a
prefix (the prefix cache), clients that go away mid-stream or before the answer, and
bad requests (400s). Every minute: each process's RSS (router and nodes), the blocks in
use on each node (the router's /metrics), and the requests so far by outcome.

    python benchmarks/soak.py --duration-min 30 --json benchmarks/results/soak_cpu-2core.json
"""

from __future__ import annotations

import argparse
import http.client
import json
import random
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections import Counter
from pathlib import Path
from typing import Any

MODEL = "smollm2-135m-instruct"
KINDS = ("stream", "whole", "chat", "long", "shared-prefix", "disconnect", "go-away", "bad")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--duration-min", type=float, default=30.0,
                   help="how long the load runs (default: %(default)s)")
    p.add_argument("--concurrency", type=int, default=8,
                   help="client threads sending requests back to back (default: %(default)s)")
    p.add_argument("--max-tokens", type=int, default=32,
                   help="upper bound of each request's max_tokens (default: %(default)s)")
    p.add_argument("--sample-s", type=float, default=60.0,
                   help="seconds between samples (default: %(default)s)")
    p.add_argument("--up-flags", default="--num-kv-blocks 1024 --max-model-len 2048",
                   help="flags for tandem up, quoted (default: %(default)s)")
    p.add_argument("--port", type=int, default=8391, help="(default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="(default: %(default)s)")
    p.add_argument("--json", type=Path, default=None, help="write the report here")
    return p.parse_args()


class Load:
    """The client threads and what became of their requests."""

    def __init__(self, port: int, concurrency: int, max_tokens: int, seed: int) -> None:
        self.port, self.max_tokens = port, max_tokens
        self.outcomes: Counter[str] = Counter()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._client, args=(random.Random(seed + i),),
                                          daemon=True) for i in range(concurrency)]

    def start(self) -> None:
        for t in self._threads:
            t.start()

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(300)

    def counts(self) -> dict[str, int]:
        with self._lock:
            return dict(self.outcomes)

    def _client(self, rng: random.Random) -> None:
        while not self._stop.is_set():
            kind = rng.choice(KINDS)
            try:
                outcome = self._one(kind, rng)
            except (OSError, http.client.HTTPException) as exc:
                outcome = f"client-error:{type(exc).__name__}"
            with self._lock:
                self.outcomes[f"{kind}:{outcome}"] += 1

    def _one(self, kind: str, rng: random.Random) -> str:
        n = rng.randint(1, self.max_tokens)
        words = " ".join(rng.choice(["sky", "sea", "tree", "stone", "light"])
                         for _ in range(rng.randint(3, 40)))
        path, body = "/v1/completions", {"model": MODEL, "prompt": words, "max_tokens": n,
                                         "temperature": rng.choice([0.0, 0.8])}
        if kind == "chat":
            path, body = "/v1/chat/completions", {
                "model": MODEL, "max_tokens": n,
                "messages": [{"role": "user", "content": words}]}
        elif kind == "long":
            body["prompt"] = words * 20
        elif kind == "shared-prefix":
            body["prompt"] = "You are a helpful assistant who answers briefly. " * 8 + words
        elif kind == "bad":
            body["max_tokens"] = -1
        stream = kind in ("stream", "disconnect", "long", "shared-prefix")
        body["stream"] = stream
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=600)
        try:
            conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
            if kind == "go-away":  # gone before the answer: the router must abort it
                time.sleep(rng.uniform(0.0, 0.5))
                return "left"
            r = conn.getresponse()
            if r.status != 200:
                r.read()
                return str(r.status)
            if not stream:
                r.read()
                return "200"
            for i, line in enumerate(r):
                if kind == "disconnect" and i >= 2:  # a token or two, then gone
                    return "left"
                if line.strip() == b"data: [DONE]":
                    return "200"
            return "no-done"
        finally:
            conn.close()


def node_pids(up: subprocess.Popen) -> list[int]:
    found = subprocess.run(["pgrep", "-P", str(up.pid)], capture_output=True, text=True)
    return [int(p) for p in found.stdout.split()]


def rss_mib(pid: int) -> float | None:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return None
    return int(status.split("VmRSS:")[1].split()[0]) / 1024


def blocks_used(url: str) -> dict[str, float]:
    text = urllib.request.urlopen(f"{url}/metrics", timeout=10).read().decode()
    return {m[1]: float(m[2]) for m in re.finditer(
        r'^tandem:kv_blocks_used\{node="([^"]+)"\} (\S+)$', text, re.M)}


def sample(started: float, url: str, up: subprocess.Popen, load: Load) -> dict[str, Any]:
    rss = {"router": rss_mib(up.pid)}
    rss.update({f"node-{pid}": rss_mib(pid) for pid in node_pids(up)})
    return {"minute": round((time.monotonic() - started) / 60, 2), "rss_mib": rss,
            "blocks_used": blocks_used(url), "requests": load.counts()}


def wait_up(up: subprocess.Popen) -> None:
    assert up.stdout is not None
    for line in up.stdout:
        if "Tandem is up" in line:
            threading.Thread(target=lambda: [None for _ in up.stdout], daemon=True).start()
            return
    raise SystemExit(f"tandem up exited with {up.wait()}")


def wait_idle(url: str, timeout_s: float = 120.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout_s
    while True:
        time.sleep(1.2)  # the router reads its nodes every second
        used = blocks_used(url)
        if not any(used.values()) or time.monotonic() > deadline:
            return used


def main() -> int:
    args = parse_args()
    url = f"http://127.0.0.1:{args.port}"
    up = subprocess.Popen([sys.executable, "-m", "tandem.cli", "up", "--port", str(args.port),
                           *shlex.split(args.up_flags)],
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          start_new_session=True)
    try:
        wait_up(up)
        load = Load(args.port, args.concurrency, args.max_tokens, args.seed)
        started = time.monotonic()
        samples = [sample(started, url, up, load)]
        load.start()
        end = started + args.duration_min * 60
        while time.monotonic() < end:
            time.sleep(min(args.sample_s, max(0.0, end - time.monotonic())))
            samples.append(sample(started, url, up, load))
            print(json.dumps(samples[-1]), flush=True)
        load.stop()
        idle = wait_idle(url)
        samples.append(sample(started, url, up, load))
    finally:
        up.send_signal(signal.SIGINT)
        up.wait(60)
    report = summarize(args, samples, idle)
    print(json.dumps(report["summary"], indent=2))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0 if report["summary"]["leaked_blocks"] == 0 else 1


def summarize(args: argparse.Namespace, samples: list[dict[str, Any]],
              idle: dict[str, float]) -> dict[str, Any]:
    """Memory growth from the first loaded minute to the last (the first minute fills the
    allocators' pools), blocks held once idle, and the requests by outcome."""
    loaded = samples[1:-1] or samples
    growth = {name: round(loaded[-1]["rss_mib"][name] - loaded[0]["rss_mib"][name], 1)
              for name in loaded[0]["rss_mib"] if name in loaded[-1]["rss_mib"]}
    requests = samples[-1]["requests"]
    return {"args": {k: str(v) for k, v in vars(args).items()}, "samples": samples,
            "summary": {"minutes": args.duration_min, "requests": sum(requests.values()),
                        "by_outcome": requests, "rss_growth_mib": growth,
                        "rss_mib_end": samples[-1]["rss_mib"],
                        "blocks_used_idle": idle, "leaked_blocks": sum(idle.values())}}


if __name__ == "__main__":
    sys.exit(main())
