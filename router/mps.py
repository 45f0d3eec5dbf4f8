"""An MPS control daemon of one `tandem up`'s own, for its nodes that share a CUDA device.

Without MPS, the kernels of two processes on one GPU do not run side by side: the device
time-slices between them. On an H200 a graph of large GEMMs (a prefill step's shape) that
takes 1.36 ms alone took 3.10 ms while another process replayed small kernels back to back
(a decode loop's), and 1.48 ms under MPS, the other process unchanged; 1P1D on one card
(SmolLM2 shape, 256 prompts of 128 -> 256 at rate inf) made 54.5-56.8k output tok/s under
MPS against 50.1-52.5k without (benchmarks/results/serve_5b_wake_mps_nvidia-h200.json).

The daemon's pipe and log directories are a temporary directory of the launch, so only its
nodes are its clients (CUDA_MPS_PIPE_DIRECTORY in their environment), nobody else's
processes on the machine; it is told to quit when the launch stops. A fault that kills
one client's context kills every client of the daemon: the nodes of one launch only.
"""

from __future__ import annotations

import logging
import shutil
import subprocess
import tempfile
from collections import Counter
from collections.abc import Iterable
from pathlib import Path

log = logging.getLogger("tandem.router")

CONTROL = "nvidia-cuda-mps-control"
PIPE_ENV, LOG_ENV = "CUDA_MPS_PIPE_DIRECTORY", "CUDA_MPS_LOG_DIRECTORY"


def shared_cuda(devices: Iterable[str]) -> list[str]:
    """The CUDA devices that more than one node is placed on ("cuda" is "cuda:0")."""
    named = Counter("cuda:0" if d == "cuda" else d for d in devices if d.startswith("cuda"))
    return sorted(d for d, n in named.items() if n > 1)


class MpsDaemon:
    def __init__(self, control: str, root: Path) -> None:
        self._control, self._root = control, root
        # Where the daemon and its clients meet: directories of the launch's own.
        self.env = {PIPE_ENV: str(root / "pipe"), LOG_ENV: str(root / "log")}

    @classmethod
    def start(cls, env: dict[str, str]) -> MpsDaemon:
        """Start a daemon and point `env` (the nodes' environment) at it. RuntimeError if
        there is no daemon to start or it would not start."""
        control = shutil.which(CONTROL, path=env.get("PATH"))
        if control is None:
            raise RuntimeError(f"--mps on: {CONTROL} is not on PATH (it comes with the "
                               "NVIDIA driver)")
        daemon = cls(control, Path(tempfile.mkdtemp(prefix="tandem-mps-")))
        for path in daemon.env.values():
            Path(path).mkdir()
        done = subprocess.run([control, "-d"], env=dict(env, **daemon.env),
                              capture_output=True, text=True, timeout=30, check=False)
        if done.returncode != 0:
            shutil.rmtree(daemon._root, ignore_errors=True)
            raise RuntimeError(f"{CONTROL} -d failed ({done.returncode}): "
                               f"{(done.stderr or done.stdout).strip()}")
        env.update(daemon.env)
        log.info("nodes sharing a CUDA device run under MPS (%s)", daemon._root)
        return daemon

    def stop(self) -> None:
        """Tell the daemon to quit (its server goes once its clients have), then drop its
        directories."""
        try:
            subprocess.run([self._control], input="quit\n", env=self.env, text=True,
                           capture_output=True, timeout=30, check=False)
        except subprocess.TimeoutExpired:
            log.warning("the MPS daemon in %s did not answer quit", self._root)
        shutil.rmtree(self._root, ignore_errors=True)


def share_gpu(devices: list[str], env: dict[str, str], mode: str) -> MpsDaemon | None:
    """Under `mode` ("auto", "on", "off"), a daemon for nodes that share a CUDA device.
    "auto" starts one where nodes share a device, the daemon is on PATH and `env` does
    not already name one, and goes on without it if it will not start; "on" insists
    (RuntimeError unless it starts, or no nodes share a device)."""
    if mode == "off" or not shared_cuda(devices) or PIPE_ENV in env:
        return None
    try:
        return MpsDaemon.start(env)
    except (RuntimeError, OSError, subprocess.TimeoutExpired) as exc:
        if mode == "on":
            raise RuntimeError(str(exc)) from exc
        log.info("nodes sharing a CUDA device run time-sliced, without MPS: %s", exc)
        return None
