"""FP8 against bf16 on real weights (SmolLM2-135M-Instruct), on the GPU, teacher-forced.

The bf16 engine decodes `--steps` greedy tokens for each of the 20 prompts of the GPU
test (tests/prompts.py), keeping every step's logits; the FP8 engine (`--quantization
fp8`, and `--kv-cache-dtype fp8` if asked) then decodes the same prompts (as one batch,
or each alone with `--alone`: the single-row path), handed the bf16 tokens at every
step, so both score each position from the same prefix. Reported: how
often the FP8 engine's greedy token is bf16's, and the largest (and mean) absolute
difference of the two logit rows. One JSON.

    python benchmarks/fp8_accuracy.py --json results/fp8_accuracy_<kind>.json --kind <kind>
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

from tandem import LLM, SamplingParams
from tandem.engine.llm_engine import run_to_completion
from tandem.engine.loader import load_tokenizer, resolve_model
from tandem.engine.sampler import SamplerOutput

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from prompts import CHAT, LONG_CHAT, LONG_RAW, RAW  # noqa: E402

MODEL = "smollm2-135m-instruct"


class Recorder:
    """Wraps an engine's sampler: keeps each step's logit row per request, and hands back
    `forced` tokens where given (the run then continues from those)."""

    def __init__(self, sampler: Any, forced: dict[str, list[int]] | None = None) -> None:
        self.sampler, self.forced = sampler, forced
        self.rows: dict[str, list[torch.Tensor]] = {}
        self.picked: dict[str, list[int]] = {}

    def __call__(self, logits: torch.Tensor, requests: list) -> SamplerOutput:
        out = self.sampler(logits, requests)
        for row, req, token in zip(logits.float(), requests, out.token_ids):
            self.rows.setdefault(req.request_id, []).append(row.clone())
            self.picked.setdefault(req.request_id, []).append(token)
        if self.forced is None:
            return out
        tokens = [self.forced[r.request_id][r.num_output_tokens] for r in requests]
        return SamplerOutput(tokens, out.logprobs)


def run(args: argparse.Namespace, prompts: list[list[int]], forced: dict[str, list[int]] | None,
        alone: bool = False, **kwargs: Any) -> Recorder:
    """Decode `prompts` as one batch, or each `alone` (one row a step: FP8's single-row
    kernels and its FP8 logits)."""
    engine = LLM(MODEL, device=args.device, dtype="bfloat16", num_kv_blocks=8192,
                 async_scheduling=False, **kwargs).engine
    recorder = Recorder(engine.runner.sampler, forced)
    engine.runner.sampler = recorder
    params = SamplingParams(temperature=0.0, max_tokens=args.steps, ignore_eos=True)
    requests = [engine.make_request(f"p{i}", p, params) for i, p in enumerate(prompts)]
    for batch in ([[r] for r in requests] if alone else [requests]):
        run_to_completion(engine, batch)
    del engine
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return recorder


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=100, help="decode steps a prompt")
    p.add_argument("--kv-cache-dtype", choices=("auto", "fp8"), default="auto",
                   help="the FP8 engine's KV cache (default: %(default)s, bf16)")
    p.add_argument("--alone", action="store_true",
                   help="the FP8 engine decodes each prompt by itself (batch 1: its single-row "
                        "path, FP8 logits included); by default all 20 as one batch")
    p.add_argument("--device", default="cuda", help="(default: %(default)s)")
    p.add_argument("--kind", default=None, help="the machine's label, put in the JSON")
    p.add_argument("--json", type=Path, default=None, help="write the figures here")
    args = p.parse_args()
    tok = load_tokenizer(resolve_model(MODEL))
    prompts = ([tok.apply_chat_template([{"role": "user", "content": c}])
                for c in CHAT + [LONG_CHAT]] + [tok.encode(r) for r in RAW + [LONG_RAW]])
    base = run(args, prompts, None)
    forced = {rid: base.picked[rid] for rid in base.picked}
    fp8 = run(args, prompts, forced, args.alone, quantization="fp8",
              kv_cache_dtype=args.kv_cache_dtype)
    agree = total = 0
    largest = mean_sum = 0.0
    per_prompt = []
    for rid, want in forced.items():
        mine = fp8.picked[rid]
        same = sum(a == b for a, b in zip(mine, want))
        diffs = [float((a - b).abs().max()) for a, b in zip(fp8.rows[rid], base.rows[rid])]
        means = [float((a - b).abs().mean()) for a, b in zip(fp8.rows[rid], base.rows[rid])]
        agree, total = agree + same, total + len(want)
        largest, mean_sum = max(largest, max(diffs)), mean_sum + sum(means)
        first = next((i for i, (a, b) in enumerate(zip(mine, want)) if a != b), None)
        per_prompt.append({"request": rid, "agree": same, "steps": len(want),
                           "first_difference": first, "largest_logit_difference": max(diffs)})
    card = torch.cuda.get_device_name() if args.device.startswith("cuda") else args.device
    out = {"model": MODEL, "kind": args.kind, "device": card,
           "date": time.strftime("%Y-%m-%d"), "dtype": "bfloat16", "quantization": "fp8",
           "kv_cache_dtype": args.kv_cache_dtype, "alone": args.alone, "steps": total,
           "top1_agree": agree,
           "top1_agreement": agree / total, "largest_logit_difference": largest,
           "mean_logit_difference": mean_sum / total, "prompts": per_prompt}
    print(json.dumps({k: v for k, v in out.items() if k != "prompts"}))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
