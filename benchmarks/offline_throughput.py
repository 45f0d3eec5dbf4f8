"""Offline throughput: Tandem's `LLM.generate` against Hugging Face batched `generate`.

Same machine, model, dtype and prompts (seeded random token ids of mixed lengths). Both
generate exactly --output-len tokens per prompt, greedily, ignoring EOS, and both get one
small warmup before the timed run.

    python benchmarks/offline_throughput.py                  # SmolLM2-135M, fp32, cpu
    python benchmarks/offline_throughput.py --model llama-3-8b --load-format dummy \\
        --device cuda --dtype bfloat16

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
from dataclasses import asdict, dataclass
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


def run_tandem(
    args: argparse.Namespace, prompts: list[list[int]], warmup: list[list[int]]
) -> tuple[Result, list[list[int]], dict[str, int]]:
    llm = LLM(
        args.model,
        dtype=args.dtype,
        device=args.device,
        load_format=args.load_format,
        seed=args.seed,
    )
    llm.generate(warmup, _tandem_params(_WARMUP_TOKENS))
    engine = llm.engine
    preemptions_before = engine.scheduler.num_preemptions

    synchronize(args.device)
    start = time.perf_counter()
    outs = llm.generate(prompts, _tandem_params(args.output_len))
    synchronize(args.device)
    wall = time.perf_counter() - start

    token_ids = [o.token_ids for o in outs]
    _check_lengths("tandem", token_ids, args.output_len)
    stats = {
        "kv_blocks": engine.block_pool.num_blocks,
        "preemptions": engine.scheduler.num_preemptions - preemptions_before,
        "prefix_cached_tokens": sum(o.num_cached_tokens for o in outs),
    }
    del llm, engine, outs
    free_memory(args.device)
    return _result("tandem", wall, prompts, token_ids), token_ids, stats


def _tandem_params(max_tokens: int) -> SamplingParams:
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


def run_hf(
    model: torch.nn.Module,
    args: argparse.Namespace,
    prompts: list[list[int]],
    warmup: list[list[int]],
    pad_token_id: int,
) -> tuple[Result, list[list[int]]]:
    hf_generate(model, warmup, _WARMUP_TOKENS, len(warmup), pad_token_id)
    batch_size = args.hf_batch_size or len(prompts)

    synchronize(args.device)
    start = time.perf_counter()
    token_ids = hf_generate(model, prompts, args.output_len, batch_size, pad_token_id)
    synchronize(args.device)
    wall = time.perf_counter() - start

    _check_lengths("hf", token_ids, args.output_len)
    return _result("hf", wall, prompts, token_ids), token_ids


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


def _check_lengths(system: str, token_ids: list[list[int]], output_len: int) -> None:
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
    try:
        import transformers

        info["transformers"] = transformers.__version__
    except ImportError:
        pass
    return info


def print_report(
    args: argparse.Namespace, info: dict[str, Any], results: list[Result], notes: list[str]
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
    print(
        f"workload: {args.num_prompts} prompts of {args.min_len}..{args.max_len} tokens "
        f"(seed {args.seed}), {args.output_len} generated tokens each, greedy, EOS ignored"
    )
    print()
    print(f"{'system':<8} {'wall s':>9} {'gen tok/s':>11} {'total tok/s':>12}")
    for r in results:
        print(f"{r.system:<8} {r.wall_s:>9.2f} {r.generated_tok_s:>11.1f} {r.total_tok_s:>12.1f}")
    if len(results) == 2:
        ratio = results[0].generated_tok_s / results[1].generated_tok_s
        print(f"\ntandem/hf generated tok/s: {ratio:.2f}x")
    for note in notes:
        print(f"note: {note}")


def main() -> None:
    args = parse_args()
    vocab = model_config(args).vocab_size
    prompts = make_prompts(args.num_prompts, args.min_len, args.max_len, vocab, args.seed)
    # Warmup prompts from another seed: as prefixes of the timed prompts they would seed
    # Tandem's prefix cache.
    warmup = make_prompts(
        _WARMUP_PROMPTS, args.min_len, min(args.max_len, 32), vocab, args.seed + 1
    )
    notes = [
        f"prompt tokens {sum(map(len, prompts))}, "
        f"generated tokens {args.num_prompts * args.output_len} per system (verified)"
    ]

    tandem_result, tandem_ids, stats = run_tandem(args, prompts, warmup)
    notes.append(
        f"tandem: {stats['kv_blocks']} KV blocks, {stats['preemptions']} preemptions, "
        f"{stats['prefix_cached_tokens']} prefix-cached prompt tokens"
    )
    results = [tandem_result]

    if not args.skip_hf:
        model = load_hf(args)
        pad = model.generation_config.pad_token_id
        pad = pad if isinstance(pad, int) else 0
        attn = model.config._attn_implementation
        hf_result, hf_ids = run_hf(model, args, prompts, warmup, pad)
        results.append(hf_result)
        del model
        free_memory(args.device)
        batch = args.hf_batch_size or args.num_prompts
        notes.append(f"hf: batch size {batch}, left padded, attention={attn}")
        if args.load_format == "dummy":
            notes.append(
                "dummy weights: same shapes, different random weights on each side, "
                "so the outputs are not compared"
            )
        else:
            same = sum(a == b for a, b in zip(tandem_ids, hf_ids))
            notes.append(
                f"identical greedy outputs: {same}/{len(prompts)} "
                "(padding and batching can flip near-ties)"
            )

    info = machine()
    print_report(args, info, results, notes)
    if args.json is not None:
        payload = {
            "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
            "machine": info,
            "results": [r.to_json() for r in results],
            "tandem_over_hf_generated_tok_s": (
                results[0].generated_tok_s / results[1].generated_tok_s
                if len(results) == 2
                else None
            ),
            "notes": notes,
        }
        args.json.write_text(json.dumps(payload, indent=2) + "\n")
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
