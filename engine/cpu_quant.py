"""x @ W^T on the CPU from a GGUF's own quantized blocks (`--cpu-weights gguf`).

The kernel (csrc/cpu_quant.cpp) reads W as the GGUF stores it, Q4_1 or Q8_0 blocks of 32
weights, widens each block in registers to exactly the fp32 weights gguf's `dequantize`
gives, and multiplies it into up to 8 rows of x at once: x, products and sums in fp32, so
the fp32 weights' result up to summation order, from 20 bytes per 32 weights (Q4_1)
instead of 128.

It is compiled on first use by torch's `cpp_extension.load` (ninja and the C++ compiler,
`$CXX` or `c++`) for the ISA torch runs its own kernels with (AVX-512 or AVX2; the build's
name says which, so a shared cache never hands one CPU another's code), into
`<cache dir>/torch_extensions/`, and loaded from there by every later process: 10-14 s the
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
from dataclasses import dataclass
from pathlib import Path

import torch

log = logging.getLogger(__name__)

# ggml's type ids (gguf.GGMLQuantizationType) of the formats the kernel reads, by name.
KINDS = {"Q4_1": 3, "Q8_0": 8}
# The model's fused layers and their parts, in the order it concatenates their rows
# (models/llama.py `load_weights`).
_FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
_FUSED_INTO = {part: layer for layer, parts in _FUSED.items() for part in parts}
_SOURCE = Path(__file__).parent / "csrc" / "cpu_quant.cpp"
# torch's CPU capability -> the compiler's flags for it.
_ISA_FLAGS = {"AVX512": ["-mavx512f", "-mfma", "-mf16c"], "AVX2": ["-mavx2", "-mfma", "-mf16c"]}


@dataclass(frozen=True)
class Blocks:
    """A weight [N, K] as a GGUF stores it: `data` uint8 [N, K / 32 * block bytes], each
    row its blocks in order along K; `kind` the format's ggml type id (KINDS)."""

    kind: int
    data: torch.Tensor


def linear(x: torch.Tensor, w: Blocks, bias: torch.Tensor | None = None
           ) -> torch.Tensor:  # x: [M, K] fp32 -> [M, N]
    return _ops().linear(x, w.data, w.kind, bias)


def fused(blocks: dict[str, torch.Tensor], types: dict[str, str], name: str) -> Blocks:
    """The blocks of the model's weight `name` (a fused layer's: its parts' rows in the
    model's order) from a GGUF's `blocks` and `types` by Hugging Face name."""
    parts = _parts(name)
    return Blocks(KINDS[types[parts[0]]], torch.cat([blocks[p] for p in parts]))


def unsupported(types: dict[str, str] | None) -> str | None:
    """Why the decoder linear layers and the logits of a checkpoint whose GGUF matrices
    have `types` (None: not a GGUF) cannot run from their blocks here, or None."""
    if types is None:
        return "is for a GGUF checkpoint"
    logits = "lm_head.weight" if "lm_head.weight" in types else "model.embed_tokens.weight"
    fused_names = {_fused_name(n) for n in types if n.endswith("_proj.weight")}
    for name in sorted(fused_names | {logits}):
        kinds = {types[p] for p in _parts(name)}
        if len(kinds) > 1 or not kinds <= KINDS.keys():
            return (f"runs Q4_1 and Q8_0 blocks, one type a fused layer; this GGUF's {name} "
                    f"is {'+'.join(types[p] for p in _parts(name))}")
    return unavailable()


def _parts(name: str) -> list[str]:
    """`model.layers.0.mlp.gate_up_proj.weight` -> its gate_proj's and up_proj's names."""
    parent, layer, suffix = _split(name)
    return [f"{parent}{part}.{suffix}" for part in _FUSED.get(layer, (layer,))]


def _fused_name(name: str) -> str:
    """`model.layers.0.mlp.up_proj.weight` -> the name of the model's weight holding it."""
    parent, layer, suffix = _split(name)
    return f"{parent}{_FUSED_INTO.get(layer, layer)}.{suffix}"


def _split(name: str) -> tuple[str, str, str]:
    """`model.norm.weight` -> ("model.", "norm", "weight"); `lm_head.weight` -> ("", ...)."""
    module, _, suffix = name.rpartition(".")
    parent, dot, layer = module.rpartition(".")
    return parent + dot, layer, suffix


def unavailable() -> str | None:
    """Why the kernel cannot run here (`missing`, or a failed build), or None; builds or
    loads it the first time it is asked."""
    if why := missing():
        return why
    try:
        _ops()
    except (RuntimeError, OSError) as exc:  # the compiler's own errors are printed above
        return f"could not build engine/csrc/{_SOURCE.name}: {str(exc).splitlines()[0]}"
    return None


def missing() -> str | None:
    """What this machine lacks to build the kernel (an x86 CPU with AVX2, a C++
    compiler), or None."""
    isa = torch.backends.cpu.get_cpu_capability()
    if isa not in _ISA_FLAGS:
        return f"needs an x86 CPU with AVX2 and FMA (torch reports {isa})"
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        return f"needs a C++ compiler ({compiler!r}, or $CXX) to build engine/csrc/{_SOURCE.name}"
    return None


@functools.cache
def _ops():  # noqa: ANN202 - torch.ops' namespace object
    start = time.perf_counter()
    from torch.utils import cpp_extension

    from tandem.engine.loader import default_cache_dir  # loader -> models -> here

    isa = torch.backends.cpu.get_cpu_capability()
    name = f"tandem_cpu_quant_{isa.lower()}"
    build = default_cache_dir() / "torch_extensions" / name
    build.mkdir(parents=True, exist_ok=True)
    # -fopenmp makes at::parallel_for parallel; its GOMP symbols resolve to the libgomp
    # torch has loaded (nothing links another). No FMA contraction: a block's weights are
    # d * code, then + m, each rounded, as gguf's `dequantize` computes them.
    with _ninja_on_path(), _exclusive(build):
        cpp_extension.load(
            name, [str(_SOURCE)], build_directory=str(build), is_python_module=False,
            extra_cflags=["-O3", "-fopenmp", "-ffp-contract=off", *_ISA_FLAGS[isa]])
    log.info("cpu_quant: %s loaded in %.2f s", name, time.perf_counter() - start)
    return torch.ops.tandem_cpu_quant


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
