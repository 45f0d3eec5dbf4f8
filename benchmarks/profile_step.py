"""Where one engine step's host time goes: Python's profiler over the steps of a single
prompt (prefill, then a few decodes), printed by own time. A prefill step that takes
longer on the host than its kernels take on the device is launch-bound: this says which
calls make it so.

    python benchmarks/profile_step.py --model llama-3.2-1b --device cuda --dtype bfloat16 \\
        --prompt-len 128 [--repeat 5] [--top 30]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time

import torch

from tandem import LLM, SamplingParams


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="llama-3.2-1b")
    p.add_argument("--load-format", default="dummy")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=4)
    p.add_argument("--repeat", type=int, default=5, help="prompts profiled, one at a time")
    p.add_argument("--top", type=int, default=30, help="functions printed")
    args = p.parse_args()

    llm = LLM(args.model, dtype=args.dtype, device=args.device, load_format=args.load_format,
              enable_prefix_caching=False)
    engine = llm.engine
    params = SamplingParams(max_tokens=args.output_len, ignore_eos=True, temperature=0.0)
    vocab = engine.model_config.vocab_size if hasattr(engine, "model_config") else 1000
    prompt = [int(i) for i in torch.randint(0, min(vocab, 30000), (args.prompt_len,))]
    llm.generate([prompt] * 3, params)  # warm-up: compiles, graphs

    def one(i: int, profiler: cProfile.Profile | None) -> list[float]:
        engine.add(engine.make_request(f"p{i}", prompt, params))
        times = []
        while engine.has_unfinished:
            start = time.perf_counter()
            if profiler is not None:
                profiler.enable()
            engine.step()
            if profiler is not None:
                profiler.disable()
            times.append((time.perf_counter() - start) * 1e3)
        return times

    plain = [one(i, None) for i in range(args.repeat)]
    profiler = cProfile.Profile()
    for i in range(args.repeat):
        one(100 + i, profiler)
    firsts = sorted(t[0] for t in plain)
    print(f"{args.model} {args.prompt_len} tokens: step ms (unprofiled) prefill median "
          f"{firsts[len(firsts) // 2]:.2f}, steps of one prompt {[round(x, 2) for x in plain[-1]]}")
    out = io.StringIO()
    pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(args.top)
    print(out.getvalue())


if __name__ == "__main__":
    main()
