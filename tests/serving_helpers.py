"""Tandem's serving processes for tests: nodes and routers started as `tandem` commands in
their own process groups, waited for, read through /metrics, and stopped."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field

from redis_server import free_port

from tandem.router.main import share_cpu

__all__ = ["Cluster", "cluster", "free_port", "metric_samples", "node_address", "start", "stop",
           "tandem_up", "wait_up"]

CLUSTER_SECRET_ENV = "TANDEM_CLUSTER_SECRET"


@dataclass
class Cluster:
    url: str
    prefill: list[subprocess.Popen]
    decode: list[subprocess.Popen]
    router: subprocess.Popen
    addresses: dict[int, str] = field(default_factory=dict)  # pid -> gRPC address


@contextlib.contextmanager
def cluster(prefill: int, decode: int, secret: str, engine: list[str],
            index: str | None = None, router_flags: list[str] = ()) -> Iterator[Cluster]:
    """`tandem node` processes and a `tandem router` over them, all with `secret` (from
    the environment, as a deployment would pass it), until the block ends; stopped even
    when a test left one of them SIGSTOPped."""
    before = os.environ.get(CLUSTER_SECRET_ENV)  # a cluster around this one keeps its own
    os.environ[CLUSTER_SECRET_ENV] = secret  # every process reads it from here
    indexed = ["--index", index] if index else []
    nodes = ([start(["node", "--role", "prefill", *engine, *indexed]) for _ in range(prefill)]
             + [start(["node", "--role", "decode", *engine, *indexed]) for _ in range(decode)])
    procs = list(nodes)
    try:
        addresses = {p.pid: node_address(p) for p in nodes}
        port = free_port()
        router = start(["router", "--port", str(port), *indexed, *router_flags,
                        *[f"--prefill={addresses[p.pid]}" for p in nodes[:prefill]],
                        *[f"--decode={addresses[p.pid]}" for p in nodes[prefill:]]])
        procs.append(router)
        url = f"http://127.0.0.1:{port}"
        wait_up(url, router, every_node=True)
        yield Cluster(url, nodes[:prefill], nodes[prefill:], router, addresses)
    finally:
        for p in procs:  # a stopped process cannot act on SIGTERM
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGCONT)
        stop(procs)
        if before is None:
            del os.environ[CLUSTER_SECRET_ENV]
        else:
            os.environ[CLUSTER_SECRET_ENV] = before


def start(args: list[str]) -> subprocess.Popen:
    """`tandem <args>` in a new process group; its stdout piped, for `node_address`; its
    stderr in a file (a pipe nobody reads would fill and block it), for failures."""
    log = tempfile.TemporaryFile("w+")
    # Processes sharing the CPU, as `tandem up` runs its nodes: OpenMP's idle workers
    # spin only briefly on the cores another node computes on.
    env = dict(os.environ)
    share_cpu(env)
    proc = subprocess.Popen([sys.executable, "-m", "tandem.cli", *args], stdout=subprocess.PIPE,
                            stderr=log, text=True, start_new_session=True, env=env)
    proc.stderr_log = log  # closed with the object
    return proc


def stderr_tail(proc: subprocess.Popen, chars: int = 3000) -> str:
    """The end of what a `start`ed process wrote to stderr."""
    log = proc.stderr_log
    log.seek(0)
    return log.read()[-chars:]


def node_address(proc: subprocess.Popen) -> str:
    """A starting node's gRPC address, from the line it prints once it serves."""
    assert proc.stdout is not None
    for line in proc.stdout:
        if m := re.search(r"tandem node ready: .* grpc=(\S+)", line):
            return m.group(1)
    raise AssertionError(f"the node exited with {proc.wait()} before it was ready; "
                         f"its stderr ends:\n{stderr_tail(proc)}")


def wait_up(url: str, router: subprocess.Popen, every_node: bool = False,
            timeout_s: float = 120.0) -> None:
    """Until the router's /health says ok (and, with `every_node`, each node is up)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                health = json.loads(r.read())
                if health["status"] == "ok" and (not every_node or all(health["nodes"].values())):
                    return
        except OSError:
            pass
        assert time.monotonic() < deadline and router.poll() is None, "the router is not up"
        time.sleep(0.2)


def stop(procs: list[subprocess.Popen], sig: int = signal.SIGTERM) -> None:
    """Signal each process group, then wait; SIGKILL what does not stop in 20 s."""
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, sig)
    for p in procs:
        try:
            p.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait(timeout=10)


def metric_samples(url: str) -> list[tuple[str, dict[str, str], float]]:
    """The router's /metrics as (name, labels, value), `tandem:` metrics only."""
    text = urllib.request.urlopen(f"{url}/metrics", timeout=10).read().decode()
    out = []
    for line in text.splitlines():
        if m := re.match(r"(tandem:\w+)(?:\{(.*)\})? (\S+)$", line):
            labels = dict(re.findall(r'(\w+)="([^"]*)"', m[2] or ""))
            out.append((m[1], labels, float(m[3])))
    return out


@contextlib.contextmanager
def tandem_up(flags: list[str]) -> Iterator[tuple[str, subprocess.Popen, int]]:
    """`tandem up --port P <flags>` until it says it is up; yields (url, process, port),
    then stops it with Ctrl-C (SIGINT), failing if it does not stop within 30 s or prints
    a leak report as it ends."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "tandem.cli", "up", "--port", str(port), *flags],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    lines: list[str] = []
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if "Tandem is up" in line:
                break
        else:
            raise AssertionError("tandem up exited: " + "".join(lines[-30:]))
        drain = threading.Thread(target=lines.extend, args=(proc.stdout,), daemon=True)
        drain.start()
        yield f"http://127.0.0.1:{port}", proc, port
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            raise AssertionError("tandem up did not stop on Ctrl-C") from None
    drain.join(10)
    # Its processes end quietly (node/gc_freeze.py: no extension module's leak report).
    assert not [line for line in lines if "leaked" in line], "".join(lines[-30:])


def completion_token_ids(url: str, prompt: list[int], max_tokens: int,
                         model: str = "tiny") -> list[int]:
    """A greedy completion's token ids (all `max_tokens` of them, EOS ignored) for a
    token-id prompt, from the router's /v1/completions."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True}
    req = urllib.request.Request(f"{url}/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())["choices"][0]["token_ids"]
