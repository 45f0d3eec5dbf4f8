"""The CPU weight formats issue 28 weighs, against each other at the rows of a decode
step: one layer's GEMMs of a model shape (q/k/v, o, gate/up, down) and its LM head, each
format's time per call at 1 and 8 rows, on this machine's threads.

    .venv/bin/python benchmarks/cpu_gemm_modes.py [--model smollm2-135m] [--json out.json]

Formats: fp32 through torch's GEMM (MKL); fp32 and bf16 weights packed once by oneDNN
(`engine/cpu_linear.py`'s path; bf16 activations in and fp32 out); fp16 weights packed
by fbgemm (fp32 activations, `--cpu-weights fp16`); int8 weights with per-channel scales
(`aten._weight_int8pack_mm`, weight-only; fbgemm's, activations quantized per call); int4
in groups of 32 with scales and zero points (`aten._weight_int4pack_mm_for_cpu`); GGUF's
Q4_1 and Q8_0 blocks through engine/cpu_quant.py's kernel (fp32 activations,
`--cpu-weights gguf`, which runs a GGUF's Q4_1 layers with its Q8_0 embedding as the LM
head). Each GEMM is timed alone (its weight stays in cache), and the model's layers as a
step runs them (`step_ms`: every layer's weights distinct, read from memory, then the LM
head's, `step_head_ms` the two together; in `HEAD_FORMAT`'s format where it names one).
The weights are random: only speed is measured here. A format this CPU or this torch build
cannot run (oneDNN's bf16 packing on a CPU without AVX-512, say) is reported as
unsupported, with its error, and skipped.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
import warnings
from collections.abc import Callable

import torch
import torch.nn.functional as F

from tandem.engine import cpu_build, cpu_quant
from tandem.engine.config import NAMED_SHAPES

GROUP = 32  # int4's group of input columns per scale
# The LM head's format in a step of these formats' layers (else the layers' own).
HEAD_FORMAT = {"gguf Q4_1": "gguf Q8_0"}


def shapes(model: str) -> dict[str, tuple[int, int]]:
    c = NAMED_SHAPES[model]
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    return {"qkv": (q + 2 * kv, c.hidden_size), "o": (c.hidden_size, q),
            "gate_up": (2 * c.intermediate_size, c.hidden_size),
            "down": (c.hidden_size, c.intermediate_size), "lm_head": (c.vocab_size, c.hidden_size)}


def time_us(fn: Callable[[], object], seconds: float = 0.3) -> float:
    for _ in range(3):
        fn()
    n, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        fn()
        n += 1
    return (time.perf_counter() - start) / n * 1e6


Gemm = Callable[[torch.Tensor], torch.Tensor]


def _packed(w: torch.Tensor, rows: int, bf16: bool) -> Gemm:
    weight = torch.ops.mkldnn._reorder_linear_weight(w.bfloat16() if bf16 else w, rows)
    if bf16:
        return lambda x: torch.ops.mkldnn._linear_pointwise(
            x.bfloat16(), weight, None, "none", [], "").float()
    return lambda x: torch.ops.mkldnn._linear_pointwise(x, weight, None, "none", [], "")


def _int8(w: torch.Tensor) -> Gemm:
    scale = w.abs().amax(1) / 127
    int8 = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return lambda x: torch.ops.aten._weight_int8pack_mm(x, int8, scale)


def _int4(w: torch.Tensor) -> Gemm:
    n, k = w.shape
    groups = w.view(n, k // GROUP, GROUP)
    lo, hi = groups.amin(-1), groups.amax(-1)
    step = (hi - lo).clamp(min=1e-6) / 15
    q4 = torch.round((groups - lo[..., None]) / step[..., None]).clamp(0, 15)
    int4 = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q4.view(n, k).to(torch.int32), 1)
    scales_zeros = torch.stack([step.t(), (lo + 8 * step).t()], -1).contiguous()
    return lambda x: torch.ops.aten._weight_int4pack_mm_for_cpu(x, int4, GROUP, scales_zeros)


def _fp16(w: torch.Tensor) -> Gemm:
    packed = torch.ops.quantized.linear_prepack_fp16(w, None)
    return lambda x: torch.ops.quantized.linear_dynamic_fp16(x, packed)


def _int8_dynamic(w: torch.Tensor) -> Gemm:
    with warnings.catch_warnings():  # quantized tensors are deprecated, still here in 2.13
        warnings.simplefilter("ignore")
        q = torch.quantize_per_channel(w, (w.abs().amax(1) / 127).double(),
                                       torch.zeros(w.shape[0], dtype=torch.long), 0,
                                       torch.qint8)
    packed = torch.ops.quantized.linear_prepack(q, None)
    return lambda x: torch.ops.quantized.linear_dynamic(x, packed, False)


def _gguf(w: torch.Tensor, kind: str) -> Gemm:
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    if why := cpu_build.unavailable():
        raise RuntimeError(f"engine/cpu_quant.py {why}")
    blocks = quantize(w.numpy(), GGMLQuantizationType[kind])
    quant = cpu_quant.Blocks(cpu_quant.KINDS[kind], torch.from_numpy(blocks))
    return lambda x: cpu_quant.linear(x, quant)


def formats(w: torch.Tensor, rows: int) -> dict[str, Callable[[], Gemm]]:
    """Each format's maker: it prepares the weight (packing, quantizing) and returns the
    GEMM; either step raises where this CPU or torch build lacks the format."""
    return {
        "fp32 (MKL)": lambda: lambda x: F.linear(x, w),
        "fp32 packed": lambda: _packed(w, rows, bf16=False),
        "bf16 packed": lambda: _packed(w, rows, bf16=True),
        "fp16 fbgemm": lambda: _fp16(w),
        "int8": lambda: _int8(w),
        "int8 fbgemm dynamic": lambda: _int8_dynamic(w),
        "int4 g32": lambda: _int4(w),
        "gguf Q4_1": lambda: _gguf(w, "Q4_1"),
        "gguf Q8_0": lambda: _gguf(w, "Q8_0"),
    }


def measure(make: Callable[[], Gemm], x: torch.Tensor) -> float | str:
    """Microseconds per call, or why the format cannot run here."""
    try:
        fn = make()
        return time_us(lambda: fn(x))
    except (RuntimeError, NotImplementedError) as exc:
        return f"unsupported: {str(exc).splitlines()[0][:200]}"


def step_ms(model: str, rows: int, fmt: str) -> tuple[float, float] | str:
    """The model's layers' GEMMs at `rows` rows, each layer's weights its own (a step's
    reads come from memory, not cache), then its LM head's (in HEAD_FORMAT's format where
    it names one): the best of seven of each, in ms."""
    layers = NAMED_SHAPES[model].num_layers
    gemms = []
    try:
        for _ in range(layers):
            for name, (n, k) in shapes(model).items():
                if name != "lm_head":
                    gemm = formats(torch.randn(n, k) * 0.02, rows)[fmt]()
                    gemms.append((gemm, torch.randn(rows, k)))
        n, k = shapes(model)["lm_head"]
        head = formats(torch.randn(n, k) * 0.02, rows)[HEAD_FORMAT.get(fmt, fmt)]()
    except (RuntimeError, NotImplementedError) as exc:
        return f"unsupported: {str(exc).splitlines()[0][:200]}"
    x = torch.randn(rows, k)
    best, best_head = float("inf"), float("inf")
    for _ in range(7):
        start = time.perf_counter()
        for gemm, xi in gemms:
            gemm(xi)
        middle = time.perf_counter()
        head(x)
        best = min(best, middle - start)
        best_head = min(best_head, time.perf_counter() - middle)
    return best * 1e3, best_head * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m", choices=sorted(NAMED_SHAPES))
    p.add_argument("--rows", default="1,8", help="(default: %(default)s)")
    p.add_argument("--json", default=None)
    p.add_argument("--skip-step", default="int8,int4 g32,gguf Q8_0",
                   type=lambda v: v.split(","),
                   help="formats not timed over every layer: the slow ones, and Q8_0 layers "
                        "(a GGUF's are Q4_1 here) (default: %(default)s)")
    args = p.parse_args()
    torch.manual_seed(0)
    results: dict[str, dict[str, dict[str, float]]] = {}
    for rows in (int(r) for r in args.rows.split(",")):
        table: dict[str, dict[str, float | str]] = {}
        for name, (n, k) in shapes(args.model).items():
            w, x = torch.randn(n, k), torch.randn(rows, k)
            table[name] = {f: measure(make, x) for f, make in formats(w, rows).items()}
        ran = [f for f in table["qkv"]
               if all(isinstance(table[s][f], float) for s in table)]
        layer = {f: sum(table[s][f] for s in table if s != "lm_head") for f in ran}
        unsupported = {f: table["qkv"][f] for f in table["qkv"] if f not in ran}
        timed = {f: step_ms(args.model, rows, f) for f in ran if f not in args.skip_step}
        step = {f: t[0] for f, t in timed.items()}
        step_head = {f: t[0] + t[1] for f, t in timed.items()}
        results[str(rows)] = {"per_gemm_us": table, "layer_us": layer, "step_ms": step,
                              "step_head_ms": step_head, "unsupported": unsupported}
        print(f"{rows} rows, every layer's GEMMs, weights from memory (ms): "
              + ", ".join(f"{f} {v:,.1f}" for f, v in step.items()))
        print(f"{rows} rows, every layer's GEMMs and the LM head, from memory (ms): "
              + ", ".join(f"{f} {v:,.1f}" for f, v in step_head.items()))
        print(f"{rows} rows, one layer's GEMMs (us): "
              + ", ".join(f"{f} {v:,.0f}" for f, v in layer.items()))
        print(f"{rows} rows, LM head (us): "
              + ", ".join(f"{f} {table['lm_head'][f]:,.0f}" for f in ran))
        for f, why in unsupported.items():
            print(f"{rows} rows, {f}: {why}")
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"model": args.model, "threads": torch.get_num_threads(),
                       "torch": torch.__version__,
                       "cpu": platform.processor() or platform.machine(),
                       "capability": torch.backends.cpu.get_cpu_capability(),
                       "results": results}, out, indent=1)


if __name__ == "__main__":
    main()
