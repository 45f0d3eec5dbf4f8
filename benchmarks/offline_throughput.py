"""Offline throughput: Tandem's `LLM.generate` against Hugging Face batched `generate`.

Same machine, model, dtype and prompts (seeded random token ids of mixed lengths). Both
generate exactly --output-len tokens per prompt, greedily, ignoring EOS, and both get one
small warmup before the timed run.

    python benchmarks/offline_throughput.py                  # SmolLM2-135M, fp32, cpu
    python benchmarks/offline_throughput.py --model llama-3-8b --load-format dummy \\
        --device cuda --dtype bfloat16
    python benchmarks/offline_throughput.py --batch-sizes 1,8   # one comparison per size

With --load-format dummy both sides have random weights of the same shape, but not the same
weights: the token streams differ, the work per token does not.
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import os
import platform
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from tandem import LLM, SamplingParams
from tandem.engine.config import NAMED_SHAPES, ModelConfig, parse_dtype
from tandem.engine.loader import hf_model_dir, load_model_config, resolve_model

# Prompt ids stay this far from both ends of the vocabulary, where the special tokens live.
_SPECIAL_MARGIN = 100
_WARMUP_PROMPTS = 4
_WARMUP_TOKENS = 4
_WARMUP_MAX_LEN = 32


@dataclass(frozen=True)
class Result:
    system: str
    wall_s: float
    prompt_tokens: int
    generated_tokens: int

    @property
    def generated_tok_s(self) -> float:
        return self.generated_tokens / self.wall_s

    @property
    def total_tok_s(self) -> float:
        return (self.prompt_tokens + self.generated_tokens) / self.wall_s

    def to_json(self) -> dict[str, Any]:
        return {
            **asdict(self),
            "generated_tok_s": self.generated_tok_s,
            "total_tok_s": self.total_tok_s,
        }


@dataclass
class Run:
    """One workload (a batch of prompts) and what each system made of it."""

    prompts: list[list[int]]
    results: list[Result] = field(default_factory=list)
    token_ids: dict[str, list[list[int]]] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    @property
    def num_prompts(self) -> int:
        return len(self.prompts)

    @property
    def tandem_over_hf(self) -> float | None:
        rates = {r.system: r.generated_tok_s for r in self.results}
        return rates["tandem"] / rates["hf"] if len(rates) == 2 else None

    def add(self, result: Result, token_ids: list[list[int]]) -> None:
        self.results.append(result)
        self.token_ids[result.system] = token_ids

    def to_json(self) -> dict[str, Any]:
        return {
            "num_prompts": self.num_prompts,
            "results": [r.to_json() for r in self.results],
            "tandem_over_hf_generated_tok_s": self.tandem_over_hf,
            "notes": self.notes,
        }


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--model",
        default="smollm2-135m-instruct",
        help="model name, .gguf file or HF directory; with --load-format dummy, "
        f"one of {sorted(NAMED_SHAPES)} (default: %(default)s)",
    )
    p.add_argument(
        "--load-format",
        choices=("auto", "dummy"),
        default="auto",
        help="auto: real weights; dummy: random weights of a named shape (default: %(default)s)",
    )
    p.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="device for both systems (default: %(default)s)",
    )
    p.add_argument(
        "--dtype",
        default=None,
        help="float32 | bfloat16 | float16 (default: float32 on cpu, bfloat16 on cuda)",
    )
    p.add_argument(
        "--num-prompts",
        type=int,
        default=64,
        help="prompts in the timed run (default: %(default)s)",
    )
    p.add_argument(
        "--min-len", type=int, default=16, help="shortest prompt, in tokens (default: %(default)s)"
    )
    p.add_argument(
        "--max-len",
        type=int,
        default=512,
        help="longest prompt, in tokens; lengths are uniform in [min, max] (default: %(default)s)",
    )
    p.add_argument(
        "--output-len",
        type=int,
        default=64,
        help="tokens generated per prompt, EOS ignored (default: %(default)s)",
    )
    p.add_argument(
        "--seed",
        type=int,
        default=0,
        help="seed for the prompts and the dummy weights (default: %(default)s)",
    )
    p.add_argument(
        "--hf-batch-size",
        type=int,
        default=None,
        help="prompts per Hugging Face generate call, left padded; smaller batches "
        "are formed from length-sorted prompts to cut padding "
        "(default: all prompts in one batch)",
    )
    p.add_argument(
        "--batch-sizes",
        type=parse_batch_sizes,
        default=None,
        metavar="N,N,...",
        help="run the comparison once per batch size, each with that many prompts in one "
        "generate call per system (HF: one batch unless --hf-batch-size), each model "
        "loaded once; replaces --num-prompts (e.g. 1,8)",
    )
    p.add_argument("--max-num-seqs", type=int, default=64,
                   help="Tandem's batch, as a node's flag (default: %(default)s)")
    p.add_argument("--no-prefix-caching", action="store_true",
                   help="Tandem without its prefix cache, as a node's flag")
    p.add_argument("--cpu-weights", choices=("auto", "fp32", "fp16", "bf16", "gguf"),
                   default="fp32",
                   help="Tandem's decoder linear layers on the CPU, as a node's flag "
                        "(default: %(default)s)")
    p.add_argument("--skip-hf", action="store_true", help="time Tandem only")
    p.add_argument(
        "--json",
        type=Path,
        default=None,
        metavar="PATH",
        help="also write the settings and results as JSON to PATH",
    )
    args = p.parse_args()
    args.dtype = args.dtype or ("float32" if args.device == "cpu" else "bfloat16")
    parse_dtype(args.dtype)  # fail fast on a typo, before loading anything
    if not 1 <= args.min_len <= args.max_len:
        p.error("need 1 <= --min-len <= --max-len")
    if args.num_prompts < 1 or args.output_len < 1:
        p.error("--num-prompts and --output-len must be >= 1")
    if args.hf_batch_size is not None and args.hf_batch_size < 1:
        p.error("--hf-batch-size must be >= 1")
    return args


def parse_batch_sizes(text: str) -> list[int]:
    """Parse "1,8,32" into [1, 8, 32]; an argparse type."""
    try:
        sizes = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of integers: {text!r}") from None
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"batch sizes must be >= 1: {text!r}")
    return sizes


def make_prompts(n: int, min_len: int, max_len: int, vocab_size: int, seed: int) -> list[list[int]]:
    lo, hi = _SPECIAL_MARGIN, vocab_size - _SPECIAL_MARGIN
    if hi <= lo:
        lo, hi = 0, vocab_size
    rng = random.Random(seed)
    lengths = [rng.randint(min_len, max_len) for _ in range(n)]
    return [[rng.randrange(lo, hi) for _ in range(length)] for length in lengths]


def model_config(args: argparse.Namespace) -> ModelConfig:
    return load_model_config(resolve_model(args.model, args.load_format))


def synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def free_memory(device: str) -> None:
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


# --- Tandem --------------------------------------------------------------------------


def load_tandem(args: argparse.Namespace) -> LLM:
    return LLM(
        args.model,
        dtype=args.dtype,
        device=args.device,
        load_format=args.load_format,
        seed=args.seed,
        max_num_seqs=args.max_num_seqs,
        enable_prefix_caching=not args.no_prefix_caching,
        cpu_weights=args.cpu_weights,
    )


def run_tandem(llm: LLM, args: argparse.Namespace, run: Run, warmup: list[list[int]]) -> None:
    llm.generate(warmup, tandem_params(_WARMUP_TOKENS))
    engine = llm.engine
    preemptions_before = engine.scheduler.num_preemptions

    synchronize(args.device)
    start = time.perf_counter()
    outs = llm.generate(run.prompts, tandem_params(args.output_len))
    synchronize(args.device)
    wall = time.perf_counter() - start

    token_ids = [o.token_ids for o in outs]
    check_lengths("tandem", token_ids, args.output_len)
    run.add(_result("tandem", wall, run.prompts, token_ids), token_ids)
    run.notes.append(
        f"tandem: {engine.block_pool.num_blocks} KV blocks, "
        f"{engine.scheduler.num_preemptions - preemptions_before} preemptions, "
        f"{sum(o.num_cached_tokens for o in outs)} prefix-cached prompt tokens"
    )


def tandem_params(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


# --- Hugging Face --------------------------------------------------------------------


def load_hf(args: argparse.Namespace) -> torch.nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    dtype = parse_dtype(args.dtype)
    src = resolve_model(args.model, args.load_format)
    if src.kind == "dummy":
        hf = dict(NAMED_SHAPES[src.name].to_hf())
        config = AutoConfig.for_model(hf.pop("model_type"), **hf)
        torch.manual_seed(args.seed)
        # Initialised in place on the device, in the target dtype: no fp32 copy on the host.
        with torch.device(args.device):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(hf_model_dir(src), dtype=dtype)
    return model.to(args.device).eval()


def hf_pad_token_id(model: torch.nn.Module) -> int:
    pad = model.generation_config.pad_token_id
    return pad if isinstance(pad, int) else 0


def run_hf(
    model: torch.nn.Module, args: argparse.Namespace, run: Run, warmup: list[list[int]]
) -> None:
    pad = hf_pad_token_id(model)
    hf_generate(model, warmup, _WARMUP_TOKENS, len(warmup), pad)
    batch_size = args.hf_batch_size or run.num_prompts

    synchronize(args.device)
    start = time.perf_counter()
    token_ids = hf_generate(model, run.prompts, args.output_len, batch_size, pad)
    synchronize(args.device)
    wall = time.perf_counter() - start

    check_lengths("hf", token_ids, args.output_len)
    run.add(_result("hf", wall, run.prompts, token_ids), token_ids)
    run.notes.append(f"hf: batch size {batch_size}, left padded")


@torch.inference_mode()
def hf_generate(
    model: torch.nn.Module,
    prompts: list[list[int]],
    new_tokens: int,
    batch_size: int,
    pad_token_id: int,
) -> list[list[int]]:
    """Greedy continuations in prompt order. Batches are cut from length-sorted prompts, so
    a batch smaller than all prompts pads only to its own longest prompt."""
    config = copy.deepcopy(model.generation_config)
    config.eos_token_id = []  # None falls back to the model config's EOS (transformers 5)
    config.pad_token_id = pad_token_id
    config.do_sample = False
    config.max_new_tokens = config.min_new_tokens = new_tokens
    for k in ("temperature", "top_p", "top_k"):
        setattr(config, k, None)

    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    outputs: list[list[int]] = [[] for _ in prompts]
    for b in range(0, len(order), batch_size):
        idx = order[b : b + batch_size]
        width = max(len(prompts[i]) for i in idx)
        # Left padding: every row's last prompt token sits in the same column.
        ids = [[pad_token_id] * (width - len(prompts[i])) + prompts[i] for i in idx]
        mask = [[0] * (width - len(prompts[i])) + [1] * len(prompts[i]) for i in idx]
        input_ids = torch.tensor(ids, device=model.device)
        attention_mask = torch.tensor(mask, device=model.device)
        out = model.generate(input_ids, attention_mask=attention_mask, generation_config=config)
        for row, i in enumerate(idx):
            outputs[i] = out[row, width:].tolist()
        del out, input_ids, attention_mask
    return outputs


# --- Reporting -----------------------------------------------------------------------


def check_lengths(system: str, token_ids: list[list[int]], output_len: int) -> None:
    bad = [i for i, t in enumerate(token_ids) if len(t) != output_len]
    if bad:
        raise RuntimeError(
            f"{system}: prompts {bad[:8]} generated {len(token_ids[bad[0]])} tokens, "
            f"not {output_len}"
        )


def _result(
    system: str, wall: float, prompts: list[list[int]], token_ids: list[list[int]]
) -> Result:
    return Result(system, wall, sum(map(len, prompts)), sum(map(len, token_ids)))


def machine() -> dict[str, Any]:
    info: dict[str, Any] = {
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
    }
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    for name in ("transformers", "triton"):
        try:
            info[name] = __import__(name).__version__
        except ImportError:
            pass
    return info


def print_report(
    args: argparse.Namespace, info: dict[str, Any], runs: list[Run], notes: list[str]
) -> None:
    print(
        f"machine : {info['cpu_count']} cpus ({info['torch_threads']} torch threads)"
        + (f", {info['gpu']}" if "gpu" in info else "")
        + f"; {info['platform']}"
    )
    print(f"torch   : {info['torch']}, transformers {info.get('transformers', '-')}")
    print(
        f"model   : {args.model} (load_format={args.load_format}), dtype={args.dtype}, "
        f"device={args.device}"
    )
    counts = ", ".join(str(r.num_prompts) for r in runs)
    print(
        f"workload: {counts} prompts of {args.min_len}..{args.max_len} tokens "
        f"(seed {args.seed}), {args.output_len} generated tokens each, greedy, EOS ignored"
    )
    print()
    print(f"{'system':<8} {'prompts':>7} {'wall s':>9} {'gen tok/s':>11} {'total tok/s':>12}")
    for run in runs:
        for r in run.results:
            print(
                f"{r.system:<8} {run.num_prompts:>7} {r.wall_s:>9.2f} "
                f"{r.generated_tok_s:>11.1f} {r.total_tok_s:>12.1f}"
            )
    print()
    for run in runs:
        if run.tandem_over_hf is not None:
            print(
                f"tandem/hf generated tok/s at {run.num_prompts} prompts: {run.tandem_over_hf:.2f}x"
            )
    for run in runs:
        for note in run.notes:
            print(f"note: [{run.num_prompts} prompts] {note}")
    for note in notes:
        print(f"note: {note}")


def main() -> None:
    args = parse_args()
    vocab = model_config(args).vocab_size
    # Each batch size its own seed, so no run's prompts are prefixes of another's.
    runs = [
        Run(make_prompts(n, args.min_len, args.max_len, vocab, args.seed + 100 * i))
        for i, n in enumerate(args.batch_sizes or [args.num_prompts])
    ]
    # Warmup prompts from another seed: as prefixes of the timed prompts they would seed
    # Tandem's prefix cache. Short ones: a warmup only needs to run every code path.
    warmup_len = min(args.max_len, _WARMUP_MAX_LEN)
    warmup = make_prompts(
        _WARMUP_PROMPTS, min(args.min_len, warmup_len), warmup_len, vocab, args.seed + 1
    )
    for run in runs:
        run.notes.append(
            f"prompt tokens {sum(map(len, run.prompts))}, "
            f"generated tokens {run.num_prompts * args.output_len} per system (verified)"
        )
    notes: list[str] = []

    llm = load_tandem(args)
    for run in runs:
        run_tandem(llm, args, run, warmup)
    del llm
    free_memory(args.device)

    if not args.skip_hf:
        model = load_hf(args)
        notes.append(f"hf: attention={model.config._attn_implementation}")
        for run in runs:
            run_hf(model, args, run, warmup)
        del model
        free_memory(args.device)
        if args.load_format == "dummy":
            notes.append(
                "dummy weights: same shapes, different random weights on each side, "
                "so the outputs are not compared"
            )
        else:
            for run in runs:
                same = sum(a == b for a, b in zip(run.token_ids["tandem"], run.token_ids["hf"]))
                run.notes.append(
                    f"identical greedy outputs: {same}/{run.num_prompts} "
                    "(padding and batching can flip near-ties)"
                )

    info = machine()
    print_report(args, info, runs, notes)
    if args.json is not None:
        payload: dict[str, Any] = {
            "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
            "machine": info,
        }
        if args.batch_sizes:
            payload |= {"runs": [run.to_json() for run in runs], "notes": notes}
        else:  # the single-run layout of earlier result files
            one = runs[0].to_json()
            payload |= {
                "results": one["results"],
                "tandem_over_hf_generated_tok_s": one["tandem_over_hf_generated_tok_s"],
                "notes": one["notes"] + notes,
            }
        args.json.write_text(json.dumps(payload, indent=2) + "\n")
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
