"""The GPU engine benchmark of record: Tandem's offline engine and Hugging Face transformers
in one run, same shapes, one after the other, against limits measured on the same device.

    python benchmarks/engine_gpu.py --kind nvidia-h200 --json r.json --plot r.png
    python benchmarks/engine_gpu.py --model tiny --device cpu --dtype float32 --quick

Figures (seeded random token-id prompts, fresh ones for every call so Tandem's prefix cache
stays cold; greedy, EOS ignored; every timed call after a warmup of its shape):
  1. decode ms/step, batch 1: 128-token prompt, (t(1 + 256 tokens) - t(1 token)) / 256
  2. decode ms/step, batch 128, 512-token prompts: (t(1 + 64) - t(1)) / 64
  3. decode tok/s against batch size, 512-token prompts, 64 steps, as in 2
  4. prefill ms of one 2,048-token prompt: Tandem t(1 token); HF one forward
  5. end to end: 128 requests of 512 -> 128 tokens in one generate call, generated tok/s
Limits, from the copy bandwidth and matmul rate measured first:
  memory-bound decode step = (weight bytes + B * C * kv bytes per token) / copy bandwidth
  compute-bound prefill = (2 * params * S + 2 * layers * heads * head_dim * S^2) / matmul rate
A mixture-of-experts model reads and multiplies only the experts its tokens are routed to:
a decode step of batch B reads each expert's weights with probability 1 - (1 - k/E)^B (k
of E experts per token, routed uniformly: what random weights give), and a prefill
multiplies each token by k of the E experts, so the limits count those params only.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from functools import partial
from pathlib import Path
from typing import Any, Protocol

import torch
from offline_throughput import (
    check_lengths,
    free_memory,
    hf_generate,
    hf_pad_token_id,
    load_hf,
    machine,
    make_prompts,
    parse_batch_sizes,
    synchronize,
    tandem_params,
)

from tandem import LLM
from tandem.engine.config import NAMED_SHAPES, ModelConfig, parse_dtype
from tandem.engine.loader import load_model_config, resolve_model

_BLOCK_SIZE = 16
_GIB = 1 << 30

# The issue's targets, for llama-3-8b bf16 on nvidia-h200.
_H200_DECODE_B1_MS = 5.0  # 1.3x its roofline; elsewhere 1.3x the measured roofline
_ROOFLINE_SLACK = 1.3
_DECODE_BIG_FRACTION = 0.75  # of the memory-bound step rate
_H200_PREFILL_MS = 55.0  # elsewhere scaled by the measured matmul rate's ratio to:
_H200_MATMUL_TFLOP_S = 793.0
_E2E_TOK_S = 5000.0


@dataclass(frozen=True)
class Sizes:
    short_prompt: int = 128  # figure 1
    short_steps: int = 256
    context: int = 512  # figures 2 and 3
    steps: int = 64
    big_batch: int = 128  # figure 2
    prefill: int = 2048  # figure 4
    e2e_requests: int = 128  # figure 5
    e2e_prompt: int = 512
    e2e_output: int = 128
    repeats: int = 3  # timed calls per long measurement (median)
    short_repeats: int = 5  # per short one: t(1 token), a prefill
    profile_steps: int = 8
    batch_sizes: tuple[int, ...] = (1, 8, 32, 64, 128)

    @property
    def decode_batches(self) -> list[int]:
        return sorted({*self.batch_sizes, self.big_batch})

    @property
    def longest(self) -> int:
        """Tokens of the longest sequence any figure runs."""
        return max(
            self.short_prompt + self.short_steps + 1,
            self.context + self.steps + 1,
            self.prefill + 1,
            self.e2e_prompt + self.e2e_output,
        )

    @property
    def kv_tokens(self) -> int:
        """KV slots the largest batch needs at once."""
        return max(
            self.short_prompt + self.short_steps + 1,
            max(self.decode_batches) * (self.context + self.steps + 1),
            self.prefill + 1,
            self.e2e_requests * (self.e2e_prompt + self.e2e_output),
        )


QUICK = Sizes(
    short_prompt=16,
    short_steps=16,
    context=32,
    steps=8,
    big_batch=8,
    prefill=128,
    e2e_requests=8,
    e2e_prompt=32,
    e2e_output=16,
    repeats=1,
    short_repeats=3,
    profile_steps=4,
    batch_sizes=(1, 4, 8),
)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--model",
        default="llama-3-8b",
        help="model name, .gguf file or HF directory; with --load-format dummy, "
        f"one of {sorted(NAMED_SHAPES)} (default: %(default)s)",
    )
    p.add_argument(
        "--load-format",
        choices=("auto", "dummy"),
        default="dummy",
        help="auto: real weights; dummy: random weights of a named shape (default: %(default)s)",
    )
    p.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cuda",
        help="device for both systems and the limits (default: %(default)s)",
    )
    p.add_argument(
        "--dtype",
        default="bfloat16",
        help="float32 | bfloat16 | float16, for both models and the matmul rate "
        "(default: %(default)s)",
    )
    p.add_argument("--seed", type=int, default=0, help="prompts and dummy weights (default: 0)")
    p.add_argument(
        "--batch-sizes",
        type=parse_batch_sizes,
        default=None,
        metavar="N,N,...",
        help="decode tok/s sweep, 512-token prompts (default: 1,8,32,64,128; "
        "--quick: 1,4,8); figure 2's batch is always measured too",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="small sizes for a smoke run (prompts of 16..128 tokens, batches up to 8, "
        "one timed call per long figure); the targets then mean nothing",
    )
    p.add_argument(
        "--attention-backend",
        choices=("torch", "triton"),
        default=None,
        help="Tandem's attention backend (default: the engine's choice)",
    )
    p.add_argument("--enforce-eager", action="store_true", help="Tandem without CUDA graphs")
    p.add_argument("--quantization", choices=("fp8",), default=None,
                   help="Tandem's linear layers in FP8 (quantized at load)")
    p.add_argument("--kv-cache-dtype", choices=("auto", "fp8"), default="auto",
                   help="Tandem's KV cache dtype (default: %(default)s, the model's)")
    p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                   help="Tandem launches each step before reading the last one's tokens "
                        "(default: the engine's, on for CUDA)")
    p.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=None,
        help="Tandem's token budget per step (default: enough to prefill the largest "
        "batch in one step, as HF does, so the decode steps after it all run at that "
        "batch size; a smaller budget mixes prefill chunks into decode steps)",
    )
    p.add_argument(
        "--kv-cache-memory-fraction",
        type=float,
        default=None,
        help="size Tandem's KV cache from free memory like the engine's default "
        "(default: sized to the largest batch here, with 25%% to spare)",
    )
    p.add_argument("--skip-hf", action="store_true", help="measure Tandem only")
    p.add_argument("--skip-tandem", action="store_true", help="measure HF only")
    p.add_argument(
        "--kind", default=None, help="a label for the machine, e.g. nvidia-h200, put in the JSON"
    )
    p.add_argument(
        "--json",
        type=Path,
        default=None,
        metavar="PATH",
        help="write every figure, the limits, targets, machine, args and date to PATH",
    )
    p.add_argument(
        "--plot",
        type=Path,
        default=None,
        metavar="PATH.png",
        help="plot decode tok/s against batch size (log x) with the memory-bound line",
    )
    p.add_argument(
        "--profile",
        type=Path,
        default=None,
        metavar="DIR",
        help="profile Tandem's decode (a few steps at batch 1 and at figure 2's batch) "
        "and its prefill with torch.profiler; op tables written to DIR",
    )
    args = p.parse_args()
    parse_dtype(args.dtype)  # fail fast on a typo, before loading anything
    if args.skip_tandem and args.skip_hf:
        p.error("--skip-tandem and --skip-hf: nothing to measure")
    if args.skip_tandem and args.profile:
        p.error("--profile profiles Tandem; drop --skip-tandem")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda, but no CUDA device is available")
    return args


def make_sizes(args: argparse.Namespace) -> Sizes:
    sizes = QUICK if args.quick else Sizes()
    if args.batch_sizes:
        sizes = Sizes(**{**asdict(sizes), "batch_sizes": tuple(args.batch_sizes)})
    return sizes


def log(msg: str) -> None:
    print(msg, flush=True)


# --- Limits --------------------------------------------------------------------------


def timed(fn: Callable[[], object], device: str) -> float:
    synchronize(device)
    start = time.perf_counter()
    fn()
    synchronize(device)
    return time.perf_counter() - start


def copy_bandwidth(device: str, nbytes: int, repeats: int = 10) -> float:
    """Bytes read + written per second by one device-to-device copy, median of `repeats`."""
    src = torch.ones(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)  # warmup, and the host pages of dst touched
    times = [timed(partial(dst.copy_, src), device) for _ in range(repeats)]
    del src, dst
    free_memory(device)
    return 2 * nbytes / statistics.median(times)


def matmul_rate(device: str, dtype: torch.dtype, n: int, repeats: int = 10) -> float:
    """FLOP/s of one n x n x n matmul, median of `repeats`."""
    a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
    c = torch.mm(a, b)  # warmup
    times = [timed(partial(torch.mm, a, b, out=c), device) for _ in range(repeats)]
    del a, b, c
    free_memory(device)
    return 2 * n**3 / statistics.median(times)


@dataclass(frozen=True)
class Limits:
    copy_bytes_per_s: float
    matmul_flop_s: float
    params: int
    weight_bytes: int
    kv_bytes_per_token: int  # 2 * layers * kv_heads * head_dim * elem
    layers: int
    heads: int
    head_dim: int
    expert_params: int = 0  # of `params`, in the experts of mixture-of-experts layers
    experts: int = 0  # per layer (0: a dense model)
    experts_per_token: int = 0

    def read_bytes(self, batch: int) -> float:
        """The weight bytes a decode step of `batch` tokens reads: every weight, but of
        the experts only those some token is routed to (expected, uniform routing)."""
        if not self.experts:
            return float(self.weight_bytes)
        elem = self.weight_bytes / self.params
        touched = 1 - (1 - self.experts_per_token / self.experts) ** batch
        return elem * (self.params - self.expert_params + self.expert_params * touched)

    @property
    def active_params(self) -> float:
        """The params each token is multiplied by (of the experts, its k of E)."""
        if not self.experts:
            return float(self.params)
        share = self.experts_per_token / self.experts
        return self.params - self.expert_params + self.expert_params * share

    def decode_step_s(self, batch: int, context: float) -> float:
        """Memory-bound: every weight read (`read_bytes`) and every KV byte of the batch
        read once."""
        return (self.read_bytes(batch) + batch * context * self.kv_bytes_per_token) / (
            self.copy_bytes_per_s
        )

    def prefill_s(self, tokens: int) -> float:
        """Compute-bound: the matmuls (2 flops per active param and token) and causal
        attention."""
        attention = 2 * self.layers * self.heads * self.head_dim * tokens**2
        return (2 * self.active_params * tokens + attention) / self.matmul_flop_s

    def to_json(self) -> dict[str, Any]:
        return {
            **asdict(self),
            "copy_gb_s": self.copy_bytes_per_s / 1e9,
            "matmul_tflop_s": self.matmul_flop_s / 1e12,
        }


def measure_rates(args: argparse.Namespace) -> tuple[float, float, dict[str, int]]:
    on_gpu = args.device == "cuda"
    copy_bytes = 4 * _GIB if on_gpu else (64 << 20 if args.quick else 256 << 20)
    n = 8192 if on_gpu else (512 if args.quick else 1024)
    bandwidth = copy_bandwidth(args.device, copy_bytes)
    rate = matmul_rate(args.device, parse_dtype(args.dtype), n)
    log(
        f"limits: copy {bandwidth / 1e9:,.1f} GB/s ({copy_bytes / _GIB:.2f} GiB copied), "
        f"matmul {rate / 1e12:,.2f} TFLOP/s ({n}^3 {args.dtype})"
    )
    return bandwidth, rate, {"copy_bytes": copy_bytes, "matmul_n": n}


def make_limits(
    bandwidth: float, rate: float, model: torch.nn.Module, config: ModelConfig
) -> Limits:
    params = list(model.parameters())  # tied weights appear once
    elem = params[0].element_size()
    # Both systems name their expert weights "...experts..." (the router is the gate).
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts" in f".{n}")
    return Limits(
        copy_bytes_per_s=bandwidth,
        matmul_flop_s=rate,
        params=sum(p.numel() for p in params),
        weight_bytes=sum(p.numel() * p.element_size() for p in params),
        kv_bytes_per_token=2 * config.num_layers * config.num_kv_heads * config.head_dim * elem,
        layers=config.num_layers,
        heads=config.num_heads,
        head_dim=config.head_dim,
        expert_params=experts,
        experts=config.num_experts if experts else 0,
        experts_per_token=config.num_experts_per_tok if experts else 0,
    )


# --- The two systems -------------------------------------------------------------------


class System(Protocol):
    name: str

    def generate(self, prompts: list[list[int]], tokens: int) -> None: ...

    def prefill(self, prompt: list[int]) -> None: ...


class Tandem:
    name = "tandem"

    def __init__(self, args: argparse.Namespace, sizes: Sizes) -> None:
        budget = args.max_num_batched_tokens or max(
            sizes.prefill,
            max(sizes.decode_batches) * sizes.context,
            sizes.e2e_requests * sizes.e2e_prompt,
        )
        kv: dict[str, Any] = (
            {"kv_cache_memory_fraction": args.kv_cache_memory_fraction}
            if args.kv_cache_memory_fraction is not None
            else {"num_kv_blocks": math.ceil(1.25 * sizes.kv_tokens / _BLOCK_SIZE)}
        )
        self.llm = LLM(
            args.model,
            dtype=args.dtype,
            device=args.device,
            load_format=args.load_format,
            seed=args.seed,
            block_size=_BLOCK_SIZE,
            max_num_seqs=max(256, max(sizes.decode_batches), sizes.e2e_requests),
            max_num_batched_tokens=budget,
            max_model_len=sizes.longest,
            attention_backend=args.attention_backend,
            enforce_eager=args.enforce_eager,
            async_scheduling=args.async_scheduling,
            quantization=args.quantization,
            kv_cache_dtype=args.kv_cache_dtype,
            **kv,
        )

    @property
    def model(self) -> torch.nn.Module:
        return self.llm.engine.runner.model

    def settings(self) -> dict[str, Any]:
        engine = self.llm.engine
        sched = engine.scheduler.config
        return {
            "num_kv_blocks": engine.block_pool.num_blocks,
            "block_size": _BLOCK_SIZE,
            "max_num_seqs": sched.max_num_seqs,
            "max_num_batched_tokens": sched.max_num_batched_tokens,
            "max_model_len": engine.max_model_len,
            # What the engine chose; read leniently, so a renamed attribute costs a
            # field of the JSON, not the run.
            "attention_backend": getattr(getattr(engine.runner, "attention", None), "name", None),
            "cuda_graphs": getattr(engine, "cuda_graphs", None),
            "enforce_eager": engine.config.enforce_eager,
            "quantization": engine.config.quantization,
            "kv_cache_dtype": engine.config.cache.kv_cache_dtype,
            "async_scheduling": getattr(engine, "async_scheduling", None),
            "preemptions": engine.scheduler.num_preemptions,
        }

    def generate(self, prompts: list[list[int]], tokens: int) -> None:
        outs = self.llm.generate(prompts, tandem_params(tokens))
        check_lengths(self.name, [o.token_ids for o in outs], tokens)

    def prefill(self, prompt: list[int]) -> None:
        self.generate([prompt], 1)


class HuggingFace:
    name = "hf"

    def __init__(self, args: argparse.Namespace) -> None:
        self.model = load_hf(args)
        self.pad = hf_pad_token_id(self.model)

    def settings(self) -> dict[str, Any]:
        return {"attention": self.model.config._attn_implementation}

    def generate(self, prompts: list[list[int]], tokens: int) -> None:
        # Equal-length prompts in one batch: no padding.
        token_ids = hf_generate(self.model, prompts, tokens, len(prompts), self.pad)
        check_lengths(self.name, token_ids, tokens)

    @torch.inference_mode()
    def prefill(self, prompt: list[int]) -> None:
        ids = torch.tensor([prompt], device=self.model.device)
        # Logits of the last position only, as generate and Tandem compute them.
        self.model(ids, use_cache=True, logits_to_keep=1)


# --- Measuring -------------------------------------------------------------------------


class Prompts:
    """Fresh seeded prompts for every call, the same sequence for each system."""

    def __init__(self, vocab_size: int, seed: int) -> None:
        self.vocab_size, self.seed = vocab_size, seed

    def take(self, n: int, length: int) -> list[list[int]]:
        self.seed += 1
        return make_prompts(n, length, length, self.vocab_size, self.seed)


def median_s(make_call: Callable[[], Callable[[], object]], repeats: int, device: str) -> float:
    """Median seconds of `repeats` calls, each made by `make_call()` (fresh prompts) outside
    the timing, after one warmup call."""
    times = [timed(make_call(), device) for _ in range(repeats + 1)]
    return statistics.median(times[1:])


def median_generate_s(
    system: System,
    prompts: Prompts,
    batch: int,
    length: int,
    tokens: int,
    repeats: int,
    device: str,
) -> float:
    return median_s(
        lambda: partial(system.generate, prompts.take(batch, length), tokens), repeats, device
    )


def mean_context(prompt_len: int, steps: int) -> float:
    """Tokens attended per sequence, averaged over the decode steps that follow a prompt."""
    return prompt_len + (steps + 1) / 2


@dataclass(frozen=True)
class Decode:
    """The steps that follow a prefill: t(1 + steps tokens) - t(1 token)."""

    batch: int
    prompt_len: int
    steps: int
    first_s: float  # t(1 token): setup, prefill, first sample
    all_s: float  # t(1 + steps tokens)

    @property
    def ms_per_step(self) -> float:
        return (self.all_s - self.first_s) / self.steps * 1e3

    @property
    def tok_s(self) -> float:
        return self.batch / self.ms_per_step * 1e3 if self.ms_per_step > 0 else math.nan

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "ms_per_step": self.ms_per_step, "tok_s": self.tok_s}


def measure_decode(
    system: System,
    prompts: Prompts,
    batch: int,
    length: int,
    steps: int,
    sizes: Sizes,
    device: str,
) -> Decode:
    all_s = median_generate_s(system, prompts, batch, length, 1 + steps, sizes.repeats, device)
    first_s = median_generate_s(system, prompts, batch, length, 1, sizes.short_repeats, device)
    d = Decode(batch, length, steps, first_s, all_s)
    log(f"{system.name}: decode batch {batch}, {length}-token prompts: {d.ms_per_step:.3f} ms/step")
    return d


@dataclass(frozen=True)
class Figures:
    decode_short: Decode  # figure 1
    decode: dict[int, Decode]  # figures 2 and 3, by batch size
    prefill_s: float  # figure 4
    e2e_s: float  # figure 5
    e2e_tokens: int

    @property
    def e2e_tok_s(self) -> float:
        return self.e2e_tokens / self.e2e_s

    def to_json(self) -> dict[str, Any]:
        return {
            "decode_batch1": self.decode_short.to_json(),
            "decode": [d.to_json() for d in self.decode.values()],
            "prefill_ms": self.prefill_s * 1e3,
            "e2e_s": self.e2e_s,
            "e2e_generated_tok_s": self.e2e_tok_s,
        }


def measure(system: System, sizes: Sizes, vocab_size: int, seed: int, device: str) -> Figures:
    prompts = Prompts(vocab_size, seed)
    short = measure_decode(system, prompts, 1, sizes.short_prompt, sizes.short_steps, sizes, device)
    decode = {
        b: measure_decode(system, prompts, b, sizes.context, sizes.steps, sizes, device)
        for b in sizes.decode_batches
    }
    prefill = median_s(
        lambda: partial(system.prefill, prompts.take(1, sizes.prefill)[0]),
        sizes.short_repeats,
        device,
    )
    log(f"{system.name}: prefill {sizes.prefill} tokens: {prefill * 1e3:.2f} ms")
    e2e = median_generate_s(
        system, prompts, sizes.e2e_requests, sizes.e2e_prompt, sizes.e2e_output, 1, device
    )
    figures = Figures(short, decode, prefill, e2e, sizes.e2e_requests * sizes.e2e_output)
    log(f"{system.name}: end to end: {figures.e2e_tok_s:,.1f} generated tok/s")
    return figures


# --- Profile ---------------------------------------------------------------------------


def _profiler(device: str) -> torch.profiler.profile:
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    return torch.profiler.profile(activities=activities)


def profile_decode(llm: LLM, prompts: list[list[int]], steps: int, device: str) -> Any:
    """Prefill every prompt, then profile the `steps` decode steps that finish them."""
    engine = llm.engine
    params = tandem_params(1 + steps)
    waiting = {
        engine.add_request(f"profile-{i}", p, params).request_id for i, p in enumerate(prompts)
    }
    while waiting:
        waiting -= {out.request_id for out in engine.step()}
    with _profiler(device) as prof:
        while engine.has_unfinished:
            engine.step()
        synchronize(device)
    return prof


def profile_prefill(llm: LLM, prompt: list[int], device: str) -> Any:
    with _profiler(device) as prof:
        llm.generate([prompt], tandem_params(1))
        synchronize(device)
    return prof


def profile_tandem(tandem: Tandem, sizes: Sizes, prompts: Prompts, out: Path, device: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    steps, big = sizes.profile_steps, sizes.big_batch
    windows = {
        f"decode_b1_{steps}steps": lambda: profile_decode(
            tandem.llm, prompts.take(1, sizes.short_prompt), steps, device
        ),
        f"decode_b{big}_{steps}steps": lambda: profile_decode(
            tandem.llm, prompts.take(big, sizes.context), steps, device
        ),
        f"prefill_{sizes.prefill}": lambda: profile_prefill(
            tandem.llm, prompts.take(1, sizes.prefill)[0], device
        ),
    }
    sort_by = "device_time_total" if device == "cuda" else "cpu_time_total"  # cuda time
    for name, run in windows.items():
        table = run().key_averages().table(sort_by=sort_by, row_limit=25)
        path = out / f"tandem_{name}.txt"
        path.write_text(f"Tandem {name}, sorted by {sort_by}\n\n{table}\n")
        log(f"wrote {path}")


# --- Report ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Row:
    figure: str
    unit: str  # "ms": lower is better; "tok/s": higher is better
    tandem: float | None
    hf: float | None
    limit: float
    target: str = ""
    met: bool | None = None

    @property
    def of_roofline(self) -> float | None:
        """Tandem's rate as a fraction of the limit's."""
        if self.tandem is None or self.tandem <= 0:
            return None
        return self.tandem / self.limit if self.unit == "tok/s" else self.limit / self.tandem

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "of_roofline": self.of_roofline}


def build_rows(figs: dict[str, Figures], limits: Limits, sizes: Sizes, gpu: str) -> list[Row]:
    def row(
        figure: str,
        unit: str,
        get: Callable[[Figures], float],
        limit: float,
        target: str = "",
        ok: Callable[[float], bool] | None = None,
    ) -> Row:
        tandem, hf = (get(figs[s]) if s in figs else None for s in ("tandem", "hf"))
        met = None if ok is None or tandem is None else ok(tandem)
        return Row(figure, unit, tandem, hf, limit, target, met)

    h200 = "H200" in gpu
    big, ctx = sizes.big_batch, mean_context(sizes.context, sizes.steps)
    limit1 = limits.decode_step_s(1, mean_context(sizes.short_prompt, sizes.short_steps)) * 1e3
    limit2 = limits.decode_step_s(big, ctx) * 1e3
    limit4 = limits.prefill_s(sizes.prefill) * 1e3
    e2e_limit_s = sizes.e2e_requests * limits.prefill_s(sizes.e2e_prompt) + (
        sizes.e2e_output
        * limits.decode_step_s(sizes.e2e_requests, mean_context(sizes.e2e_prompt, sizes.e2e_output))
    )
    target1 = _H200_DECODE_B1_MS if h200 else _ROOFLINE_SLACK * limit1
    target4 = _H200_PREFILL_MS * (
        1.0 if h200 else _H200_MATMUL_TFLOP_S * 1e12 / limits.matmul_flop_s
    )
    shape = f"{sizes.context}+{sizes.steps}"
    return [
        row(
            f"decode b=1, {sizes.short_prompt}+{sizes.short_steps} (ms/step)",
            "ms",
            lambda f: f.decode_short.ms_per_step,
            limit1,
            f"<= {target1:.2f} ms",
            lambda t: t <= target1,
        ),
        row(
            f"decode b={big}, {shape} (ms/step)",
            "ms",
            lambda f: f.decode[big].ms_per_step,
            limit2,
            f">= {_DECODE_BIG_FRACTION:.0%} of roofline",
            lambda t: 0 < t <= limit2 / _DECODE_BIG_FRACTION,
        ),
        *(
            row(
                f"decode b={b}, {shape} (tok/s)",
                "tok/s",
                lambda f, b=b: f.decode[b].tok_s,
                b / limits.decode_step_s(b, ctx),
            )
            for b in sizes.decode_batches
        ),
        row(
            f"prefill {sizes.prefill} (ms)",
            "ms",
            lambda f: f.prefill_s * 1e3,
            limit4,
            f"<= {target4:,.1f} ms",
            lambda t: t <= target4,
        ),
        row(
            f"e2e {sizes.e2e_requests} x {sizes.e2e_prompt}->{sizes.e2e_output} (gen tok/s)",
            "tok/s",
            lambda f: f.e2e_tok_s,
            sizes.e2e_requests * sizes.e2e_output / e2e_limit_s,
            f">= {_E2E_TOK_S:,.0f} tok/s",
            lambda t: t >= _E2E_TOK_S,
        ),
    ]


def _fmt(v: float | None, unit: str) -> str:
    if v is None:
        return "-"
    return f"{v:,.2f}" if unit == "ms" else f"{v:,.0f}"


def print_report(
    args: argparse.Namespace,
    info: dict[str, Any],
    limits: Limits,
    rows: list[Row],
    notes: list[str],
) -> None:
    print()
    print(
        f"machine : {info.get('gpu', 'no gpu')}, {info['cpu_count']} cpus; "
        f"torch {info['torch']}, triton {info.get('triton', '-')}, "
        f"transformers {info.get('transformers', '-')}"
    )
    print(
        f"model   : {args.model} (load_format={args.load_format}), {args.dtype}, {args.device}; "
        f"{limits.params:,} params, {limits.weight_bytes / 1e9:.4g} GB, "
        + (f"{limits.active_params:,.0f} active per token ({limits.experts_per_token} of "
           f"{limits.experts} experts), " if limits.experts else "")
        + f"KV {limits.kv_bytes_per_token / 1024:.1f} KiB/token"
    )
    print(
        f"limits  : copy {limits.copy_bytes_per_s / 1e9:,.1f} GB/s (read + written), "
        f"matmul {limits.matmul_flop_s / 1e12:,.2f} TFLOP/s"
    )
    print()
    head = f"{'figure':<34} {'tandem':>9} {'hf':>9} {'limit':>9} {'of roof':>8}  {'target':<36}"
    print(head)
    print("-" * (len(head) + 7))
    for r in rows:
        roof = "-" if r.of_roofline is None else f"{r.of_roofline:.0%}"
        met = "" if r.met is None else ("met" if r.met else "MISSED")
        print(
            f"{r.figure:<34} {_fmt(r.tandem, r.unit):>9} {_fmt(r.hf, r.unit):>9} "
            f"{_fmt(r.limit, r.unit):>9} {roof:>8}  {r.target:<36} {met}"
        )
    print()
    print("of roof: Tandem's rate / the limit's (limit ms / Tandem ms, or Tandem tok/s / limit)")
    for note in notes:
        print(f"note: {note}")


def write_plot(
    path: Path, figs: dict[str, Figures], limits: Limits, sizes: Sizes, title: str
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    batches = sizes.decode_batches
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, f in figs.items():
        ax.plot(batches, [f.decode[b].tok_s for b in batches], marker="o", label=name)
    ctx = mean_context(sizes.context, sizes.steps)
    lo, hi = math.log(batches[0]), math.log(batches[-1])
    grid = [math.exp(lo + (hi - lo) * i / 64) for i in range(65)]
    ax.plot(grid, [b / limits.decode_step_s(b, ctx) for b in grid], "k--", label="memory-bound")
    # Log y too: tok/s spans two orders of magnitude from batch 1 to 128.
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.minorticks_off()
    ax.set_xticks(batches, [str(b) for b in batches])
    ax.set_xlabel(f"batch size ({sizes.context}-token prompts, {sizes.steps} decode steps)")
    ax.set_ylabel("decode tok/s")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    log(f"wrote {path}")


# --- Main ------------------------------------------------------------------------------


def main() -> None:
    args = parse_args()
    sizes = make_sizes(args)
    config = load_model_config(resolve_model(args.model, args.load_format))
    if sizes.longest > config.max_position_embeddings:
        raise SystemExit(
            f"{args.model} holds {config.max_position_embeddings} positions; the figures need "
            f"{sizes.longest} (try --quick)"
        )
    info = {**machine(), "kind": args.kind}
    bandwidth, rate, rate_sizes = measure_rates(args)
    figs: dict[str, Figures] = {}
    settings: dict[str, dict[str, Any]] = {}
    limits: Limits | None = None
    notes: list[str] = []

    if not args.skip_tandem:
        tandem = Tandem(args, sizes)
        limits = make_limits(bandwidth, rate, tandem.model, config)
        figs["tandem"] = measure(tandem, sizes, config.vocab_size, args.seed, args.device)
        settings["tandem"] = tandem.settings()
        if args.profile is not None:
            profile_tandem(
                tandem,
                sizes,
                Prompts(config.vocab_size, args.seed + 10_000),
                args.profile,
                args.device,
            )
        if settings["tandem"]["preemptions"]:
            notes.append(f"tandem preempted {settings['tandem']['preemptions']} times")
        del tandem
        free_memory(args.device)

    if not args.skip_hf:
        hf = HuggingFace(args)
        limits = limits or make_limits(bandwidth, rate, hf.model, config)
        figs["hf"] = measure(hf, sizes, config.vocab_size, args.seed, args.device)
        settings["hf"] = hf.settings()
        del hf
        free_memory(args.device)

    assert limits is not None  # parse_args: not both skipped
    gpu = info.get("gpu", "")
    rows = build_rows(figs, limits, sizes, gpu)
    notes.append(
        "weight bytes count every parameter, the input embedding's too (decode reads a row)"
    )
    if "H200" not in gpu:
        notes.append(
            f"not an H200: decode b=1 target {_ROOFLINE_SLACK}x the roofline measured here, "
            f"prefill target {_H200_PREFILL_MS:.0f} ms x {_H200_MATMUL_TFLOP_S:.0f} TFLOP/s / "
            "the matmul rate measured here, e2e target unscaled"
        )
    if args.quick or args.model != "llama-3-8b" or args.dtype not in ("bfloat16", "bf16"):
        notes.append("the targets are the issue's, for llama-3-8b bf16 at full sizes")
    print_report(args, info, limits, rows, notes)

    if args.json is not None:
        payload = {
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "kind": args.kind,
            "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
            "machine": info,
            "sizes": asdict(sizes),
            "limits": {**limits.to_json(), **rate_sizes},
            "settings": settings,
            "figures": {name: f.to_json() for name, f in figs.items()},
            "table": [r.to_json() for r in rows],
            "notes": notes,
        }
        args.json.write_text(json.dumps(payload, indent=2) + "\n")
        log(f"wrote {args.json}")
    if args.plot is not None:
        title = f"{args.model} {args.dtype}, {info.get('gpu', args.device)}"
        write_plot(args.plot, figs, limits, sizes, title)


if __name__ == "__main__":
    main()
