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
    """Run `code` (importing from the tests directory) with TRITON_INTERPRET=1. Skipped
    where CUDA is: there the kernels run for real (tests/test_gpu*.py and the kernel
    tests' CUDA cases), and the interpreter of the GPU machine's Triton (3.6) fails on
    loops over a runtime bound (`only 0-dimensional arrays can be converted to Python
    scalars`) where CI's passes."""
    import pytest
    import torch

    if torch.cuda.is_available():
        pytest.skip("CUDA is here: the kernels are tested on the device")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    run = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).parent, env=env,
                         capture_output=True, text=True, timeout=timeout)
    assert run.returncode == 0, run.stderr[-3000:]
