"""deploy/build.sh for the compose stack's test, started as soon as that test is collected
(conftest.py): a cold build takes about two minutes, mostly on one core, so it runs while
the tests before it do, and the test waits for what is left of it."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def can_build() -> bool:
    """podman is here, or root may install it (deploy/build.sh's first step)."""
    return shutil.which("podman") is not None or os.geteuid() == 0


class Build:
    """One `deploy/build.sh all`, in its own process group, its output in a file."""

    def __init__(self) -> None:
        self.log = tempfile.TemporaryFile("w+")
        self.proc = subprocess.Popen(
            ["bash", "deploy/build.sh", "all"], cwd=ROOT, stdout=self.log,
            stderr=subprocess.STDOUT, text=True, start_new_session=True,
            env={**os.environ, "PYTHON": sys.executable})

    def wait(self, timeout_s: float) -> None:
        """Until it ends; AssertionError with its output's end if it failed."""
        try:
            code = self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.stop()
            raise AssertionError(
                f"deploy/build.sh took over {timeout_s:g}s:\n{self._tail()}") from None
        assert code == 0, f"deploy/build.sh: exit {code}\n{self._tail()}"

    def stop(self) -> None:
        """End it if it still runs (the session ended first)."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()

    def _tail(self) -> str:
        self.log.seek(0)
        return self.log.read()[-3000:]


_build: Build | None = None


def start() -> None:
    global _build
    if _build is None:
        _build = Build()


def wait(timeout_s: float) -> None:
    """The build started at collection (or one started now) has ended well."""
    start()
    assert _build is not None
    _build.wait(timeout_s)


def stop() -> None:
    if _build is not None:
        _build.stop()
