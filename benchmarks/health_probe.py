"""How fast every node of a running cluster answers Health while a benchmark loads it:
a thread calls each node's Health rpc every `interval_s` (the nodes the router's /health
names) and records how long each answer took; a call that fails or takes past its
timeout counts as a miss. Used by serve_matrix.py (`--probe-health`), or alone, with the
cluster secret in $TANDEM_CLUSTER_SECRET:

    python benchmarks/health_probe.py --url http://127.0.0.1:8000 --seconds 60
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
import urllib.request
from typing import Any

import grpc

from tandem.node.auth import CLUSTER_SECRET_ENV, authenticated, read_secret
from tandem.protos import node_pb2 as pb
from tandem.protos import node_pb2_grpc as pb_grpc


def node_addresses(url: str) -> dict[str, str]:
    """The router's nodes, by name (`role@host:port`): their gRPC addresses."""
    with urllib.request.urlopen(f"{url}/health", timeout=10) as r:
        names = json.loads(r.read())["nodes"]
    return {name: name.partition("@")[2] for name in names}


class HealthProbe:
    """`with HealthProbe(url): ...` samples every node's Health meanwhile; `summary()`."""

    def __init__(self, url: str, secret: str | None, interval_s: float = 0.1,
                 timeout_s: float = 2.0, limit_ms: float = 50.0) -> None:
        """`secret`: the cluster secret the nodes obey (`tandem up` makes one of its own
        unless given one)."""
        self.interval_s, self.timeout_s, self.limit_ms = interval_s, timeout_s, limit_ms
        key = secret.encode() if secret else None
        self._channels = {name: grpc.insecure_channel(address)
                          for name, address in node_addresses(url).items()}
        self._stubs = {name: pb_grpc.NodeStub(authenticated(channel, key))
                       for name, channel in self._channels.items()}
        self.samples_ms: dict[str, list[float]] = {name: [] for name in self._stubs}
        self.misses: dict[str, int] = dict.fromkeys(self._stubs, 0)
        self.slow: dict[str, list[tuple[float, float]]] = {name: [] for name in self._stubs}
        self._start = time.perf_counter()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="health-probe", daemon=True)

    def __enter__(self) -> HealthProbe:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join()
        for channel in self._channels.values():
            channel.close()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            for name, stub in self._stubs.items():
                start = time.perf_counter()
                try:
                    stub.Health(pb.HealthRequest(), timeout=self.timeout_s)
                except grpc.RpcError:
                    self.misses[name] += 1
                    continue
                ms = (time.perf_counter() - start) * 1e3
                self.samples_ms[name].append(ms)
                if ms > self.limit_ms:  # when, in seconds from the start, and how slow
                    self.slow[name].append((round(start - self._start, 2), round(ms, 1)))

    def summary(self) -> dict[str, dict[str, Any]]:
        """Per node: samples, misses, median, p99 and max ms, and the first 20 answers
        past `limit_ms` (seconds from the start, ms)."""
        out = {}
        for name, ms in self.samples_ms.items():
            ms = sorted(ms)
            out[name] = {
                "samples": len(ms), "misses": self.misses[name],
                "median_ms": statistics.median(ms) if ms else None,
                "p99_ms": ms[int(0.99 * (len(ms) - 1))] if ms else None,
                "max_ms": ms[-1] if ms else None,
                f"over_{self.limit_ms:g}_ms": self.slow[name][:20],
            }
        return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", required=True, help="the router's base URL")
    p.add_argument("--seconds", type=float, default=30.0, help="how long to sample")
    p.add_argument("--interval", type=float, default=0.1, help="seconds between rounds")
    args = p.parse_args()
    secret = read_secret(None, None, CLUSTER_SECRET_ENV)
    with HealthProbe(args.url, secret, args.interval) as probe:
        time.sleep(args.seconds)
    print(json.dumps(probe.summary(), indent=1))


if __name__ == "__main__":
    main()
