"""Where the engine's rate goes inside a node's process: the same engine and the same
burst, stepped three ways in one process, in turn, so the host's noise falls on all three.

- `direct`: `LLMEngine.step()` in a loop, as the offline `LLM` runs it;
- `loop`: driven by `node/loop.py`'s `EngineLoop` on its own thread, each output handed
  to a listener that only counts;
- `outbox`: the same, with the listeners of `node/outbox.py`'s `Outbox`, whose batches an
  asyncio loop on another thread makes and serializes, as a decode node's Outputs stream
  does (no gRPC, no router).

The gap between `direct` and `outbox` is what the node's second thread costs the engine
(the GIL); between `outbox` and a served run, what gRPC, the router and the client cost.

    python benchmarks/engine_loop.py --model smollm2-135m --load-format dummy \\
        --device cuda --dtype bfloat16 --repeats 3 --json out.json
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import threading
import time
from pathlib import Path
from typing import Any

from tandem import LLM, SamplingParams
from tandem.engine.outputs import RequestOutput
from tandem.node.aio import Bridge, new_event_loop
from tandem.node.loop import EngineLoop
from tandem.node.outbox import Chunks, Outbox

NODE_GIL_SWITCH_S = 0.0005  # node/main.py's


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m", help="(default: %(default)s)")
    p.add_argument("--load-format", default="dummy", help="(default: %(default)s)")
    p.add_argument("--device", default="cuda", help="(default: %(default)s)")
    p.add_argument("--dtype", default="bfloat16", help="(default: %(default)s)")
    p.add_argument("--num-prompts", type=int, default=256, help="(default: %(default)s)")
    p.add_argument("--input-len", type=int, default=128, help="(default: %(default)s)")
    p.add_argument("--output-len", type=int, default=256, help="(default: %(default)s)")
    p.add_argument("--max-num-seqs", type=int, default=128, help="(default: %(default)s)")
    p.add_argument("--repeats", type=int, default=3, help="rounds of the three (default: "
                   "%(default)s)")
    p.add_argument("--json", type=Path, default=None, help="write the figures here")
    return p.parse_args()


class Burst:
    """The engine and fresh prompts for each run (random ids: no prefix is shared)."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.llm = LLM(args.model, dtype=args.dtype, device=args.device,
                       load_format=args.load_format, max_num_seqs=args.max_num_seqs,
                       enable_prefix_caching=False)
        self.engine = self.llm.engine
        self.params = SamplingParams(temperature=0.0, max_tokens=args.output_len,
                                     ignore_eos=True)
        self._rng = random.Random(0)
        self._runs = 0
        vocab = self.engine.runner.model.config.vocab_size
        self._ids = range(100, vocab - 100)
        warm = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
        self.llm.generate([self._prompt() for _ in range(16)], warm)

    def _prompt(self) -> list[int]:
        return [self._rng.choice(self._ids) for _ in range(self.args.input_len)]

    def requests(self) -> list[Any]:
        self._runs += 1
        return [self.engine.make_request(f"r{self._runs}-{i}", self._prompt(), self.params)
                for i in range(self.args.num_prompts)]

    @property
    def tokens(self) -> int:
        return self.args.num_prompts * self.args.output_len


def direct(burst: Burst) -> float:
    for req in burst.requests():
        burst.engine.add(req)
    began = time.perf_counter()
    while burst.engine.has_unfinished:
        burst.engine.step()
    return time.perf_counter() - began


def looped(burst: Burst, with_outbox: bool) -> float:
    loop = EngineLoop(burst.engine, thread=True)
    aio = new_event_loop()
    outbox = Outbox("bench", Bridge(aio))
    ended = threading.Event()
    finished = 0

    def one_ended() -> None:  # on one thread only: the engine's, or the sender's
        nonlocal finished
        finished += 1
        if finished == burst.args.num_prompts:
            ended.set()

    def count(out: RequestOutput | BaseException) -> None:
        if isinstance(out, BaseException) or out.finished:
            one_ended()

    async def send() -> None:
        async for batch in outbox.batches():
            batch.SerializeToString()  # what gRPC would do with it
            for chunk in batch.chunks:
                if chunk.finish_reason:
                    one_ended()

    thread = threading.Thread(target=aio.run_until_complete, args=(send(),), daemon=True)
    thread.start()
    time.sleep(0.1)
    reqs = burst.requests()
    began = time.perf_counter()
    for req in reqs:
        listener = outbox.listener(Chunks(req.request_id)) if with_outbox else count
        loop.start(req.request_id, listener, lambda e, req=req: e.add(req))
    ended.wait()
    took = time.perf_counter() - began
    loop.close()
    aio.call_soon_threadsafe(outbox.close)
    thread.join(10)
    return took


def main() -> None:
    args = parse_args()
    burst = Burst(args)
    sys.setswitchinterval(NODE_GIL_SWITCH_S)
    runs: dict[str, list[float]] = {"direct": [], "loop": [], "outbox": []}
    for _ in range(args.repeats):
        for name, run in (("direct", lambda: direct(burst)),
                          ("loop", lambda: looped(burst, False)),
                          ("outbox", lambda: looped(burst, True))):
            took = run()
            runs[name].append(burst.tokens / took)
            print(f"{name:>7}: {burst.tokens / took:9.0f} tok/s ({took:.3f} s)", flush=True)
    best = {name: max(v) for name, v in runs.items()}
    print("best of each: " + ", ".join(f"{k} {v:.0f}" for k, v in best.items())
          + f"; outbox / direct {best['outbox'] / best['direct']:.0%}")
    if args.json:
        args.json.write_text(json.dumps({"date": time.strftime("%Y-%m-%d"),
                                         "args": vars(args) | {"json": str(args.json)},
                                         "tok_s": runs, "best": best}, indent=1))


if __name__ == "__main__":
    main()
