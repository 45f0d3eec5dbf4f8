"""x @ W^T on the CPU for the few rows of a decode step.

MKL's GEMM repacks W on every call, and with 1-64 rows that repacking, not the
arithmetic, is the cost: SmolLM2's fused MLP GEMMs at 8 rows ran at ~40 GFLOP/s on the
2-core machine. oneDNN can pack W once into its blocked layout and reuse it for any row
count: 30 layers of the [3072, 576] gate/up GEMM at 8 rows, 21 ms -> 12 ms (fp32, 2 cores).
Prompts (many rows) keep torch's GEMM, as fast there.

For one row it depends on the machine. MKL's matrix-vector product runs on MKL's own
threads, by default one a physical core. Where it ran on one thread while torch had two,
it read SmolLM2's 540 MB at 11 GB/s, where the packed GEMM read them at 16-17 GB/s (47 ms
-> 32 ms a token). Where MKL has every thread torch has (a 2-core Xeon with AVX-512) it
beats the packed GEMM: SmolLM2's weights at one row in 20.8 ms against 28.0; at two rows
by less, at four it loses. So one row goes to MKL exactly when MKL has every thread
(`mkl_rows`).

oneDNN compiles a primitive for every row count it is given and keeps it in its primitive
cache (~0.6 MiB of JIT code each for SmolLM2's shapes; ~1,000 held). Given every count up
to 256 (prefill chunks are any length), a prefill node's RSS grew for hours, ~1 MiB a
request, towards ~0.7 GiB over its start (and each new count cost a compile). So the
packed GEMM runs only a fixed set of row counts, `packed_rows`: the rows are padded up to
the next one (at most an eighth more), and the padding's outputs are dropped.

Half the bytes (`--cpu-weights`): bf16 weights packed for oneDNN (`pack_bf16`; the inputs
are rounded to bf16 too), or fp16 weights packed for fbgemm (`pack_fp16`; the inputs stay
fp32, the weights are widened to fp32 in registers). fp16 is the faster at a decode
step's rows on the 2-core machine and keeps SmolLM2's greedy tokens; fbgemm's int8 GEMM
(activations quantized per call, one scale a row) was faster still (6.5 ms for the 30
layers at one row against fp16's 8.8) but changed SmolLM2's first token on 9 of the 20
test prompts, so it is not offered.

A GGUF checkpoint's own blocks (`--cpu-weights gguf`, `pack_gguf`): its Q4_1 and Q8_0
matrices as the file stores them, multiplied by engine/cpu_quant.py's kernel with fp32
activations, the fp32 weights' result up to summation order. Q4_1 is 20 bytes per 32
weights: a decode step of SmolLM2 reads 96 MB, where fp16 reads 270 and fp32 540.
"""

from __future__ import annotations

import functools
import logging
import re

import torch
import torch.nn.functional as F

from tandem.engine import cpu_quant
from tandem.engine.fp8 import LAYERS  # the decoder layers' linear layers, as for FP8

log = logging.getLogger(__name__)

# Up to this many rows, the packed weight; above it, torch's GEMM (equal at 512 rows).
_PACKED_MAX_ROWS = 256
# Row counts up to this run as they are (decode batches); above, rounded up (packed_rows).
_EXACT_ROWS = 16
# The attribute on a weight holding its oneDNN packing, made on first use (weights no
# longer change by then) and dropped with the weight.
_PACKED = "_tandem_onednn_packed"


def _mkl_threads() -> int:
    """The threads MKL runs on (torch reports it; 0 if it does not say). MKL takes one a
    physical core, so a machine of two hyperthreads on one core gives it one."""
    found = re.search(r"mkl_get_max_threads\(\) : (\d+)", torch.__config__.parallel_info())
    return int(found.group(1)) if found else 0


def mkl_rows() -> int:
    """Up to this many rows `linear` runs torch's GEMM (MKL): one row when MKL has every
    thread torch has, none otherwise. Decided from the machine, not timed, so every
    process on it decides alike (timings taken while two nodes start at once are noise)."""
    return _mkl_rows(torch.get_num_threads())


@functools.cache
def _mkl_rows(threads: int) -> int:
    mkl = _mkl_threads()
    log.info("cpu GEMM at one row: %s (MKL has %d threads, torch %d)",
             "MKL" if mkl >= threads else "the packed weight", mkl, threads)
    return int(mkl >= threads)


def _can_pack(x: torch.Tensor) -> bool:
    return (x.dtype == torch.float32 and mkl_rows() < x.shape[0] <= _PACKED_MAX_ROWS
            and torch.backends.mkldnn.is_available())


def packed_rows(rows: int) -> int:
    """The row count the packed GEMM runs `rows` rows as: `rows` up to _EXACT_ROWS, else
    rounded up to a multiple of an eighth of the power of two below it (18, 20, ..., 32,
    36, ..., 64, 72, ..., 240, 256): 48 counts up to 256 in all."""
    if rows <= _EXACT_ROWS:
        return rows
    step = 1 << (rows.bit_length() - 4)
    return -(-rows // step) * step


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
           ) -> torch.Tensor:  # x: [T, in], weight: [out, in] -> [T, out]
    blocks = getattr(weight, _GGUF_BLOCKS, None)
    if blocks is not None and x.shape[0] <= _GGUF_MAX_ROWS:
        return cpu_quant.linear(x, blocks, bias)
    fp16 = getattr(weight, _PACKED_FP16, None)
    if fp16 is not None and x.shape[0] <= _FP16_MAX_ROWS:  # the bias is in the packing
        return torch.ops.quantized.linear_dynamic_fp16(x, fp16)
    bf16 = getattr(weight, _PACKED_BF16, None)
    if bf16 is not None:
        return _bf16_linear(x, bf16, bias)
    always = getattr(weight, _ALWAYS_PACKED, False) and x.shape[0] <= _PACKED_MAX_ROWS
    if not (always or _can_pack(x)):
        return F.linear(x, weight, bias)
    packed = getattr(weight, _PACKED, None)
    if packed is None:
        packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 8)
        setattr(weight, _PACKED, packed)
    rows = x.shape[0]
    padded = packed_rows(rows)
    if padded != rows:  # zero rows, whose outputs are dropped: x: [padded, in]
        x = F.pad(x, (0, 0, 0, padded - rows))
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")[:rows]


# The attribute on a weight holding its bf16 oneDNN packing (`pack_bf16`), which every
# call then uses.
_PACKED_BF16 = "_tandem_onednn_bf16"
# Set on a weight whose fp32 packing serves one row too (`pack_bf16`'s logits).
_ALWAYS_PACKED = "_tandem_onednn_always"


def has_native_bf16() -> bool:
    """Whether this CPU multiplies bf16 in hardware (AVX512-BF16 or AMX), where bf16
    weights are worth it: elsewhere oneDNN refuses them or emulates them slowly."""
    return has_bf16_packing() and (
        torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())


@functools.cache
def has_bf16_packing() -> bool:
    """Whether oneDNN packs bf16 weights here (x86 with AVX-512 BW/VL/DQ or AVX-NE-CONVERT;
    an AVX2-only CPU refuses them). Tried once on a tiny layer."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.ones(8, 8, dtype=torch.bfloat16), 1)
    except RuntimeError:
        return False
    return True


@functools.cache
def has_fp16_gemm() -> bool:
    """Whether fbgemm's fp16-weight GEMM runs here (x86 with AVX2: it widens the weights
    with F16C). Tried once on a tiny layer rather than inferred from flags."""
    if "fbgemm" not in torch.backends.quantized.supported_engines:
        return False
    try:
        packed = torch.ops.quantized.linear_prepack_fp16(torch.ones(8, 8), None)
        out = torch.ops.quantized.linear_dynamic_fp16(torch.ones(1, 8), packed)
    except RuntimeError:
        return False
    return bool(torch.all(out == 8))


def weights_mode(choice: str, device: torch.device, dtype: torch.dtype,
                 gguf_types: dict[str, str] | None = None) -> str:
    """What `cpu_weights` comes to here, for a checkpoint whose GGUF matrices have
    `gguf_types` (None: not a GGUF): fp16, bf16 or gguf only for an fp32 model on the CPU,
    gguf only for a GGUF whose decoder linear layers and logits are Q4_1 or Q8_0, where the
    kernel builds (cpu_quant.unsupported). Asked for or (auto) where the CPU runs it fast:
    gguf where it runs, else fp16 wherever fbgemm's fp16 GEMM runs (the fastest of the
    others up to 8 rows, and the most accurate of the two halves), else bf16 where the CPU
    multiplies bf16 in hardware, else fp32.

    auto takes gguf over fp16 because it is faster at one row and at eight and agrees with
    fp32 as well. On the 2-core machine (Zen 4, AVX-512): SmolLM2's 30 layers and logits,
    weights from memory, 5.3 ms at one row against fp16's 13.0, 15.6 at eight against
    16.9 (benchmarks/cpu_gemm_modes.py); a decode step, the two engines in one process in
    turn, 17.4 ms at batch 1 against 22.0, 33.4 at batch 8 against 35.8; and SmolLM2's
    greedy tokens equal fp32's on all 20 test prompts for 32 tokens, as fp16's do. Its
    costs: a C++ compiler on the machine, and one build (10-14 s) on first use."""
    fits = device.type == "cpu" and dtype == torch.float32
    if choice in ("fp16", "bf16", "gguf") and not fits:
        raise ValueError(f"cpu_weights={choice!r} is for an fp32 model on the CPU "
                         f"(got {dtype} on {device})")
    if choice == "fp16" and not has_fp16_gemm():
        raise ValueError("cpu_weights='fp16' needs fbgemm's fp16 GEMM (an x86 CPU with "
                         "AVX2); choose bf16 or fp32")
    if choice == "bf16" and not has_bf16_packing():
        raise ValueError("cpu_weights='bf16' needs oneDNN's bf16 weights (an x86 CPU with "
                         "AVX-512 or AVX-NE-CONVERT); choose fp16 or fp32")
    if choice == "gguf" and (why := cpu_quant.unsupported(gguf_types)):
        raise ValueError(f"cpu_weights='gguf' {why}; choose fp16 or fp32")
    if choice != "auto":
        return choice
    if fits and gguf_types is not None:
        why = cpu_quant.unsupported(gguf_types)
        if why is None:
            return "gguf"
        log.info("cpu_weights auto: not gguf, which %s", why)
    if fits and has_fp16_gemm():
        return "fp16"
    return "bf16" if fits and has_native_bf16() else "fp32"


@torch.no_grad()
def pack_bf16(model: torch.nn.Module, logits_weight: torch.Tensor) -> int:
    """Pack the decoder layers' linear weights as bf16 for oneDNN (half the bytes a decode
    step reads); returns how many. The logits stay fp32 (bf16 logits tie: 0.125 apart
    near 20), but go through the packed fp32 weight at one row too: SmolLM2's [49152,
    576] at one row took 12.3 ms through MKL, 5.8 packed (and 3.1 in bf16) on the 2-core
    machine (benchmarks/cpu_gemm_modes.py)."""
    setattr(logits_weight, _ALWAYS_PACKED, True)
    packed = 0
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] in LAYERS and isinstance(module, torch.nn.Linear):
            w = module.weight.detach().bfloat16()
            setattr(module.weight, _PACKED_BF16,
                    torch.ops.mkldnn._reorder_linear_weight(w, 8))
            packed += 1
    return packed


def _bf16_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None
                 ) -> torch.Tensor:
    """x in bf16 through the packed bf16 weight (fp32 accumulation, a bf16 result), back
    in x's dtype; rows padded to `packed_rows` (any count up to 256, then multiples of
    128), so oneDNN compiles a bounded set of primitives."""
    rows = x.shape[0]
    padded = packed_rows(rows) if rows <= _PACKED_MAX_ROWS else -(-rows // 128) * 128
    xb = x.bfloat16()
    if padded != rows:
        xb = F.pad(xb, (0, 0, 0, padded - rows))
    out = torch.ops.mkldnn._linear_pointwise(xb, packed, None, "none", [], "")[:rows]
    out = out.to(x.dtype)
    return out if bias is None else out + bias


# The attribute on a weight holding its fbgemm fp16 packing (`pack_fp16`), bias included.
_PACKED_FP16 = "_tandem_fbgemm_fp16"
# Up to this many rows an fp16-packed weight runs fbgemm's fp16 GEMM; above, the fp32
# weight's path. On the 2-core machine, SmolLM2's 30 layers (benchmarks/cpu_gemm_modes.py):
# 1 row 8.8 ms (bf16 12.6, fp32 packed 22.4), 8 rows 12.5 (12.9, 20.3), 64 rows 71.0
# (42.5, 74.9): fp16 is widened and multiplied in fp32, as fast as fp32 once rows are many.
_FP16_MAX_ROWS = 64


@torch.no_grad()
def pack_fp16(model: torch.nn.Module, logits_weight: torch.Tensor) -> int:
    """Pack the decoder layers' linear weights and the logits' as fp16 for fbgemm (half
    the bytes a decode step reads); returns how many. Activations, accumulation and
    results stay fp32; only the weights are rounded (to 11 significant bits, where bf16
    keeps 8). The fp32 weights stay for steps of many rows (prompts)."""
    setattr(logits_weight, _PACKED_FP16,
            torch.ops.quantized.linear_prepack_fp16(logits_weight.detach(), None))
    packed = 1
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] in LAYERS and isinstance(module, torch.nn.Linear):
            bias = None if module.bias is None else module.bias.detach()
            setattr(module.weight, _PACKED_FP16,
                    torch.ops.quantized.linear_prepack_fp16(module.weight.detach(), bias))
            packed += 1
    return packed


# The attribute on a weight holding its GGUF blocks (`pack_gguf`).
_GGUF_BLOCKS = "_tandem_gguf_blocks"
# Up to this many rows a weight with GGUF blocks runs engine/cpu_quant.py's kernel; above,
# the fp32 weight's path. On the 2-core machine, SmolLM2's 30 layers and logits (Q4_1 and
# Q8_0 from memory, benchmarks/cpu_gemm_modes.py's step_head_ms), against fp32 packed and
# fp16: 1 row 6.6 ms (34.3, 14.7), 8 rows 14.9 (31.3, 19.1), 16 rows 30.8 (42.3, 31.0),
# 32 rows 62.2 (60.2, 53.9), 64 rows 125 (99.3, 106): the kernel's FMAs are the fp32
# GEMM's, plus the widening, so once rows are many it is no faster than reading fp32.
_GGUF_MAX_ROWS = 32


@torch.no_grad()
def pack_gguf(model: torch.nn.Module, logits_weight: torch.Tensor,
              blocks: dict[str, torch.Tensor], types: dict[str, str]) -> int:
    """Give the decoder layers' linear weights and the logits' their GGUF blocks (a fused
    layer's parts' rows concatenated as the model concatenates its weights), from a GGUF's
    `blocks` and matrix `types` by Hugging Face name; returns how many. The fp32 weights
    stay for steps of many rows (prompts)."""
    logits = next(name for name, p in model.named_parameters() if p is logits_weight)
    setattr(logits_weight, _GGUF_BLOCKS, cpu_quant.fused(blocks, types, logits))
    packed = 1
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] in LAYERS and isinstance(module, torch.nn.Linear):
            setattr(module.weight, _GGUF_BLOCKS,
                    cpu_quant.fused(blocks, types, f"{name}.weight"))
            packed += 1
    return packed
