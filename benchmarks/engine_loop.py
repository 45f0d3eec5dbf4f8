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
import array
import collections
import json
import random
import subprocess
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
    p.add_argument("--mixed-cuda-graphs", action=argparse.BooleanOptionalAction, default=True,
                   help="graphs for mixed steps too (tandem up's flag; default: on)")
    p.add_argument("--repeats", type=int, default=3, help="rounds of the three (default: "
                   "%(default)s)")
    p.add_argument("--modes", default="direct,loop,outbox,drain,columns,across",
                   help="which to run, in turn (default: %(default)s)")
    p.add_argument("--json", type=Path, default=None, help="write the figures here")
    return p.parse_args()


class Burst:
    """The engine and fresh prompts for each run (random ids: no prefix is shared)."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.llm = LLM(args.model, dtype=args.dtype, device=args.device,
                       load_format=args.load_format, max_num_seqs=args.max_num_seqs,
                       enable_prefix_caching=False,
                       mixed_cuda_graphs=args.mixed_cuda_graphs)
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


def timed(burst: Burst, loop: EngineLoop, listener: Any, until: Any) -> float:
    """Seconds from handing a fresh burst to `loop` (each request's outputs to
    `listener(request_id)`) until `until()` returns; the loop is closed after."""
    reqs = burst.requests()
    began = time.perf_counter()
    for req in reqs:
        loop.start(req.request_id, listener(req.request_id), lambda e, req=req: e.add(req))
    until()
    took = time.perf_counter() - began
    loop.close()
    return took


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
    took = timed(burst, loop, lambda rid: outbox.listener(Chunks(rid)) if with_outbox
                 else count, ended.wait)
    aio.call_soon_threadsafe(outbox.close)
    thread.join(10)
    return took


def drained(burst: Burst, columnar: bool) -> float:
    """The Outbox's hand-off alone: the engine thread appends each output to a deque and
    wakes the asyncio loop once per batch, which only drains it (`columnar` False) or
    gathers it into three flat columns and packs them (True): what a per-step columnar
    batch would cost on that thread, against the Outbox's chunk per request."""
    loop = EngineLoop(burst.engine, thread=True)
    aio = new_event_loop()
    bridge = Bridge(aio)
    queued: collections.deque[RequestOutput] = collections.deque()
    waking = [False]
    ended = threading.Event()
    finished = [0]

    def wake() -> None:
        waking[0] = False
        ids, tokens, texts = [], [], []
        while queued:
            out = queued.popleft()
            if columnar:
                ids.append(out.request_id)
                tokens.append(out.token_ids[-1])
                texts.append(out.delta)
            if out.finished:
                finished[0] += 1
        if columnar:
            pack(ids, tokens, texts)
        if finished[0] == burst.args.num_prompts:
            ended.set()

    def listener(out: RequestOutput | BaseException) -> None:
        queued.append(out)
        if not waking[0]:
            waking[0] = True
            bridge.post(wake)

    thread = threading.Thread(target=aio.run_forever, daemon=True)
    thread.start()
    took = timed(burst, loop, lambda rid: listener, ended.wait)
    aio.call_soon_threadsafe(aio.stop)
    thread.join(10)
    return took


def pack(ids: list[str], tokens: list[int], texts: list[str]) -> list[bytes]:
    """Three columns as three frames (what a per-step message would carry)."""
    return ["\0".join(ids).encode(), array.array("i", tokens).tobytes(),
            "\0".join(texts).encode()]


def across(burst: Burst) -> float:
    """The engine's outputs leave the process: a stage packs each step's outputs into
    columns (`pack`) and sends them over a local zmq socket to a child process that
    makes the Outbox's chunks and serializes them; timed until the child has them all."""
    import zmq

    ctx = zmq.Context()
    out_sock = ctx.socket(zmq.PUSH)
    port = out_sock.bind_to_random_port("tcp://127.0.0.1")
    back = ctx.socket(zmq.PULL)
    back_port = back.bind_to_random_port("tcp://127.0.0.1")
    child = subprocess.Popen([sys.executable, __file__, "--chunk-maker", str(port),
                              str(back_port), str(burst.args.num_prompts)])
    back.recv()  # the child is up
    loop = EngineLoop(burst.engine, thread=True)
    ids: list[str] = []
    tokens: list[int] = []
    texts: list[str] = []
    ends: list[str] = []
    ended = [0]

    def listener(out: RequestOutput | BaseException) -> None:  # on the engine thread
        ids.append(out.request_id)
        tokens.append(out.token_ids[-1])
        texts.append(out.delta)
        if out.finished:
            ends.append(out.request_id)
            ended[0] += 1
            if ended[0] == burst.args.num_prompts:  # no step follows: flush now
                flush(None)

    def flush(engine: object) -> None:  # a stage: before each step, after the last
        if ids:
            frames = pack(ids, tokens, texts) + ["\0".join(ends).encode()]
            out_sock.send_multipart(frames, copy=False)
            ids.clear(), tokens.clear(), texts.clear(), ends.clear()

    loop.add_stage(flush)
    took = timed(burst, loop, lambda rid: listener, back.recv)
    child.wait(10)
    ctx.destroy(0)
    return took


def chunk_maker(port: int, back_port: int, num_prompts: int) -> None:
    """The child of `across`: the Outbox's work, per step's columns."""
    import zmq

    from tandem.protos import node_pb2 as pb

    ctx = zmq.Context()
    sock = ctx.socket(zmq.PULL)
    sock.connect(f"tcp://127.0.0.1:{port}")
    back = ctx.socket(zmq.PUSH)
    back.connect(f"tcp://127.0.0.1:{back_port}")
    back.send(b"up")
    done = 0
    while done < num_prompts:
        frames = sock.recv_multipart()
        ids = frames[0].decode().split("\0")
        tokens = array.array("i", frames[1])
        texts = frames[2].decode().split("\0")
        batch = pb.OutputBatch()
        for rid, token, text in zip(ids, tokens, texts):
            batch.chunks.add(request_id=rid, token_ids=[token], text=text)
        batch.SerializeToString()
        done += len(frames[3].split(b"\0")) if frames[3] else 0
    back.send(b"done")


def main() -> None:
    args = parse_args()
    burst = Burst(args)
    sys.setswitchinterval(NODE_GIL_SWITCH_S)
    modes = {"direct": lambda: direct(burst), "loop": lambda: looped(burst, False),
             "outbox": lambda: looped(burst, True), "drain": lambda: drained(burst, False),
             "columns": lambda: drained(burst, True), "across": lambda: across(burst)}
    modes = {name: modes[name] for name in args.modes.split(",")}
    runs: dict[str, list[float]] = {name: [] for name in modes}
    for _ in range(args.repeats):
        for name, run in modes.items():
            took = run()
            runs[name].append(burst.tokens / took)
            print(f"{name:>7}: {burst.tokens / took:9.0f} tok/s ({took:.3f} s)", flush=True)
    best = {name: max(v) for name, v in runs.items()}
    print("best of each: " + ", ".join(f"{k} {v:.0f}" for k, v in best.items()))
    if args.json:
        args.json.write_text(json.dumps({"date": time.strftime("%Y-%m-%d"),
                                         "args": vars(args) | {"json": str(args.json)},
                                         "tok_s": runs, "best": best}, indent=1))


if __name__ == "__main__":
    if sys.argv[1:2] == ["--chunk-maker"]:
        chunk_maker(*map(int, sys.argv[2:5]))
    else:
        main()
