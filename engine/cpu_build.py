"""The engine's C++ CPU kernels, engine/csrc/*.cpp, built into one library: cpu_quant.cpp
(`torch.ops.tandem_cpu_quant`, GGUF blocks' GEMM) and cpu_ops.cpp (`torch.ops.tandem_cpu_ops`,
the fused small ops of a decode step).

It is compiled on first use by torch's `cpp_extension.load` (ninja and the C++ compiler,
`$CXX` or `c++`) for the ISA torch runs its own kernels with (AVX-512 or AVX2; the build's
name says which, so a shared cache never hands one CPU another's code), into
`<cache dir>/torch_extensions/`, and loaded from there by every later process: 12-20 s the
first time on the 2-core machine, 0.2-0.3 s after. Builds and loads are serialized across
processes by an flock, so two nodes starting at once build it once; torch's own lock file
alone, left behind by a builder killed midway, would hold every later start waiting.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import logging
import os
import shutil
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import torch

log = logging.getLogger(__name__)

_CSRC = Path(__file__).parent / "csrc"
SOURCES = (_CSRC / "cpu_quant.cpp", _CSRC / "cpu_ops.cpp")
# torch's CPU capability -> the compiler's flags for it.
_ISA_FLAGS = {"AVX512": ["-mavx512f", "-mfma", "-mf16c"], "AVX2": ["-mavx2", "-mfma", "-mf16c"]}


def unavailable() -> str | None:
    """Why the kernels cannot run here (`missing`, or a failed build), or None; builds or
    loads them the first time it is asked."""
    if why := missing():
        return why
    try:
        load()
    except (RuntimeError, OSError) as exc:  # the compiler's own errors are printed above
        names = " and ".join(f"engine/csrc/{s.name}" for s in SOURCES)
        return f"could not build {names}: {str(exc).splitlines()[0]}"
    return None


def missing() -> str | None:
    """What this machine lacks to build the kernels (an x86 CPU with AVX2, a C++
    compiler), or None."""
    isa = torch.backends.cpu.get_cpu_capability()
    if isa not in _ISA_FLAGS:
        return f"needs an x86 CPU with AVX2 and FMA (torch reports {isa})"
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        return f"needs a C++ compiler ({compiler!r}, or $CXX) to build engine/csrc"
    return None


@functools.cache
def load() -> None:
    """Build (once per machine) and load the library; its ops are torch.ops' from then."""
    start = time.perf_counter()
    from torch.utils import cpp_extension

    from tandem.engine.loader import default_cache_dir  # loader -> models -> here

    isa = torch.backends.cpu.get_cpu_capability()
    name = f"tandem_cpu_{isa.lower()}"
    build = default_cache_dir() / "torch_extensions" / name
    build.mkdir(parents=True, exist_ok=True)
    # -fopenmp makes at::parallel_for parallel; its GOMP symbols resolve to the libgomp
    # torch has loaded (nothing links another). No FMA contraction: a GGUF block's
    # weights are d * code, then + m, each rounded, as gguf's `dequantize` computes them,
    # and the fused ops round each product as torch's references do.
    with _ninja_on_path(), _exclusive(build):
        cpp_extension.load(
            name, [str(s) for s in SOURCES], build_directory=str(build), is_python_module=False,
            extra_cflags=["-O3", "-fopenmp", "-ffp-contract=off", *_ISA_FLAGS[isa]])
    log.info("cpu_build: %s loaded in %.2f s", name, time.perf_counter() - start)


@contextlib.contextmanager
def _exclusive(build: Path) -> Iterator[None]:
    """Hold an flock on `build`/tandem.lock (the kernel drops it when the process dies).
    Inside it no other process is in torch's build, so a `lock` file of torch's found
    there is a dead builder's, and is removed."""
    fd = os.open(build / "tandem.lock", os.O_CREAT | os.O_RDWR, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        (build / "lock").unlink(missing_ok=True)
        yield
    finally:
        os.close(fd)


@contextlib.contextmanager
def _ninja_on_path() -> Iterator[None]:
    """torch runs `ninja` from PATH; pip's ninja sits beside this Python, on PATH only in
    an activated virtual environment."""
    path = os.environ.get("PATH", "")
    if shutil.which("ninja") is None:
        os.environ["PATH"] = os.path.dirname(sys.executable) + os.pathsep + path
    try:
        yield
    finally:
        os.environ["PATH"] = path
