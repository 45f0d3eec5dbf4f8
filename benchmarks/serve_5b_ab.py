"""Issue 24's 5b burst, offline and served, for whichever tree is on the path: run it
for two trees in turn on one machine to compare them (these hosts' speed drifts by
1.5x within minutes, so only alternating passes compare).

1. An offline process steps `LLMEngine` directly over 256 prompts of 128 -> 256 (SmolLM2
   shape, dummy bf16, `--max-num-seqs 128`), `--offline-bursts` times.
2. `tandem up --colocated 1`, then 1P1D `--connector ipc`: a warm-up of 16 prompts, then
   `tandem bench serve` bursts of the same shape at rate inf.
3. The offline process again.

Each burst notes the chunks a request came in and the CPU seconds of the bench client and
of each process `tandem up` started (the router, each node's engine process, its front).
`--trace DIR` runs each `tandem up` with TANDEM_TRACE (one file per configuration, for
`burst_trace.py --timeline`).

    ln -sfn $PWD /tmp/site/tandem && python benchmarks/serve_5b_ab.py new out_new.json
    ln -sfn $PWD/.old /tmp/site/tandem && \
        (cd .old && python ../benchmarks/serve_5b_ab.py old out_old.json)
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import signal
import subprocess
import sys
from pathlib import Path

from serve_vs_engine import wait_ok

COMMON = ["--model", "smollm2-135m", "--device", "cuda", "--dtype", "bfloat16",
          "--load-format", "dummy", "--max-num-seqs", "128", "--no-prefix-caching"]
OFFLINE = r'''
import argparse, json, sys
sys.path.insert(0, "benchmarks")
from engine_loop import Burst, direct
args = argparse.Namespace(model="smollm2-135m", load_format="dummy", device="cuda",
    dtype="bfloat16", num_prompts=256, input_len=128, output_len=256, max_num_seqs=128,
    mixed_cuda_graphs=sys.argv[2] == "1")
b = Burst(args)
direct(b)
print(json.dumps([b.tokens / direct(b) for _ in range(int(sys.argv[1]))]))
'''


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("label", help="the tree's name in the output")
    p.add_argument("json", type=Path, help="write the figures here")
    p.add_argument("--offline-bursts", type=int, default=4, help="(default: %(default)s)")
    p.add_argument("--served-bursts", type=int, default=3, help="(default: %(default)s)")
    p.add_argument("--port", type=int, default=8390, help="(default: %(default)s)")
    p.add_argument("--mixed-cuda-graphs", action=argparse.BooleanOptionalAction, default=True,
                   help="the offline engine and both `tandem up`s with mixed-step graphs "
                        "(default: on, as theirs)")
    p.add_argument("--up-flags", default="", help="more flags for both `tandem up`s, one "
                   "string (e.g. \"--stream-interval-ms 5\")")
    p.add_argument("--trace", type=Path, default=None, help="trace into DIR/<config>.jsonl "
                   "(default: no trace)")
    p.add_argument("--config", action="append", default=None, metavar="NAME=FLAGS",
                   help="a served configuration: its name and its `tandem up` flags, one "
                   "string; repeat for more (default: colocated=\"--colocated 1\" and "
                   "1p1d_ipc=\"--connector ipc\")")
    p.add_argument("--py-spy", type=Path, default=None, help="record the router, each "
                   "node's engine process and its front with `py-spy record` over each "
                   "burst, into DIR/<config>_"
                   "<burst>_<process>.txt (raw, collapsed stacks; default: none)")
    p.add_argument("--py-spy-flags", default="--gil", help="py-spy record's sampling "
                   "flags, one string (default: %(default)s: the thread holding the GIL; "
                   "\"--idle --threads\": every thread, waiting or not)")
    return p.parse_args()


def offline(bursts: int, mixed: bool) -> list[float]:
    done = subprocess.run([sys.executable, "-c", OFFLINE, str(bursts), str(int(mixed))],
                          capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def _processes() -> dict[int, tuple[int, str, float]]:
    """Every process: pid -> (parent, its command line, its CPU seconds)."""
    out, tick = {}, os.sysconf("SC_CLK_TCK")
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
            cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        out[int(d.name)] = (int(fields[1]), cmd, (int(fields[11]) + int(fields[12])) / tick)
    return out


def tree_cpu(root: int) -> dict[str, float]:
    """The CPU seconds of `root` (the router: `tandem up` serves it) and of every process
    under it, each named by what it runs."""
    procs, cpu, todo = _processes(), {}, [root]
    children: dict[int, list[int]] = {}
    for pid, (parent, _, _) in procs.items():
        children.setdefault(parent, []).append(pid)
    while todo:
        pid = todo.pop()
        _, cmd, seconds = procs.get(pid, (0, "", 0.0))
        if "tandem.node.front" in cmd:
            name = "front"
        elif " node " in cmd:
            name = "node_" + cmd.split("--role ")[1].split()[0]
        else:
            name = "router" if pid == root else cmd[:40]
        cpu[f"{name}:{pid}"] = seconds
        todo += children.get(pid, [])
    return cpu


def _client_cpu() -> float:
    use = resource.getrusage(resource.RUSAGE_CHILDREN)
    return use.ru_utime + use.ru_stime


def _spy(up: int, out: Path | None, prefix: str, flags: str) -> list[subprocess.Popen]:
    """py-spy recorders of each process under `up` (none without `out`): the router, each
    node's engine process and its gRPC front."""
    if out is None:
        return []
    spies = []
    for name in tree_cpu(up):
        if name.startswith(("node_", "front", "router")):
            role, pid = name.split(":")
            role = role if role != "front" else f"front{pid}"
            # py-spy's native stacks need the process paused for each sample
            pause = [] if "--native" in flags.split() else ["--nonblocking"]
            spies.append(subprocess.Popen(
                ["py-spy", "record", *flags.split(), *pause, "-r", "200", "-f",
                 "raw", "-o",
                 str(out / f"{prefix}_{role}.txt"), "-p", pid],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    return spies


def _stop(spies: list[subprocess.Popen]) -> None:
    for spy in spies:
        spy.send_signal(signal.SIGINT)
    for spy in spies:
        spy.wait(timeout=60)


def served(flags: list[str], bursts: int, port: int, trace: Path | None = None,
           spy: Path | None = None, name: str = "", spy_flags: str = "--gil"
           ) -> list[dict[str, float]]:
    url = f"http://127.0.0.1:{port}"
    env = dict(os.environ, **({"TANDEM_TRACE": str(trace)} if trace else {}))
    up = subprocess.Popen([sys.executable, "-m", "tandem.cli", "up", "--port", str(port),
                           *COMMON, "--skip-tokenizer-init", *flags],
                          stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
                          start_new_session=True, env=env)
    try:
        wait_ok(url, up, timeout_s=300)
        rows = []
        for i in range(bursts + 1):  # the first: a warm-up of 16
            result = Path(f"/tmp/serve_5b_ab_{os.getpid()}.json")
            before, client = tree_cpu(up.pid), _client_cpu()
            spies = _spy(up.pid, spy if i else None, f"{name}_{i}", spy_flags)
            subprocess.run([sys.executable, "-m", "tandem.cli", "bench", "serve",
                            "--base-url", url, "--num-prompts", "256" if i else "16",
                            "--random-input-len", "128", "--random-output-len", "256",
                            "--seed", str(i), "--save-result", "--save-detailed", "--result-dir",
                            str(result.parent), "--result-filename", result.name,
                            "--disable-tqdm"], check=True, capture_output=True, env=env)
            _stop(spies)
            client, after = _client_cpu() - client, tree_cpu(up.pid)
            res = json.loads(result.read_text())
            result.unlink()
            if i:
                chunks = sum(len(itl) + 1 for itl in res["itls"])  # a first, then an ITL each
                rows.append({"tok_s": res["output_throughput"], "completed": res["completed"],
                             "median_ttft_ms": res["median_ttft_ms"],
                             "duration_s": res["duration"],
                             "chunks_per_request": round(chunks / res["completed"], 1),
                             "cpu_s": {"client": round(client, 3), **{
                                 k: round(v - before.get(k, 0.0), 3)
                                 for k, v in after.items()}}})
        return rows
    finally:
        os.killpg(up.pid, signal.SIGINT)
        up.wait(timeout=60)


def main() -> None:
    args = parse_args()
    for out in (args.trace, args.py_spy):
        if out:
            out.mkdir(parents=True, exist_ok=True)
    result: dict[str, object] = {"label": args.label,
                                 "offline_tok_s": offline(args.offline_bursts,
                                                          args.mixed_cuda_graphs)}
    print(args.label, "offline", [round(x) for x in result["offline_tok_s"]], flush=True)
    configs = [c.split("=", 1) for c in args.config or
               ("colocated=--colocated 1", "1p1d_ipc=--connector ipc")]
    for name, flags in ((name, flags.split()) for name, flags in configs):
        mixed = [] if args.mixed_cuda_graphs else ["--no-mixed-cuda-graphs"]
        trace = args.trace / f"{args.label}_{name}.jsonl" if args.trace else None
        rows = served(flags + mixed + args.up_flags.split(), args.served_bursts, args.port,
                      trace, args.py_spy, f"{args.label}_{name}", args.py_spy_flags)
        result[name] = rows
        print(args.label, name, [round(r["tok_s"]) for r in rows], "ttft",
              [round(r["median_ttft_ms"]) for r in rows], flush=True)
        for r in rows:
            print("  ", r["duration_s"], "s,", r["chunks_per_request"], "chunks a request,",
                  r["cpu_s"], flush=True)
    result["offline_after_tok_s"] = offline(max(1, args.offline_bursts - 1),
                                            args.mixed_cuda_graphs)
    print(args.label, "offline after", [round(x) for x in result["offline_after_tok_s"]],
          flush=True)
    args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
