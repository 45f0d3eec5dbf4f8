"""Kernel tests run their comparison under Triton's interpreter on the CPU, in a fresh
process: TRITON_INTERPRET is read when `triton.jit` decorates, at import."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

HAS_TRITON = importlib.util.find_spec("triton") is not None


def run_under_interpreter(code: str, timeout: int = 300) -> None:
    """Run `code` (importing from the tests directory) with TRITON_INTERPRET=1."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    run = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).parent, env=env,
                         capture_output=True, text=True, timeout=timeout)
    assert run.returncode == 0, run.stderr[-3000:]
