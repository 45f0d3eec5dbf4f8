"""`tandem bench serve`'s flags, vLLM's names (kept free of heavy imports: `--help` is
instant)."""

from __future__ import annotations

import argparse
import math
from pathlib import Path


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("server")
    g.add_argument("--base-url", default=None,
                   help="the server, e.g. http://127.0.0.1:8000 (default: from --host/--port)")
    g.add_argument("--host", default="127.0.0.1", help="(default: %(default)s)")
    g.add_argument("--port", type=int, default=8000, help="(default: %(default)s)")
    g.add_argument("--endpoint", default="/v1/completions",
                   help="/v1/completions or /v1/chat/completions (default: %(default)s)")
    g.add_argument("--backend", default=None, choices=["openai", "openai-chat", "vllm"],
                   help="the request format (default: from --endpoint)")
    g.add_argument("--model", default=None,
                   help="model id sent with each request (default: the server's first)")
    g.add_argument("--vocab-size", type=int, default=None,
                   help="for token-id prompts (default: from the model's config)")
    g.add_argument("--label", default=None, help="names the run in its JSON and file name")
    g = p.add_argument_group("workload")
    g.add_argument("--dataset-name", default="random",
                   choices=["random", "sharegpt", "prefix-repetition", "prefix_repetition",
                            "multi-turn", "multi_turn"],
                   help="(default: %(default)s)")
    g.add_argument("--dataset-path", type=Path, default=None, help="ShareGPT JSON file")
    g.add_argument("--num-prompts", type=int, default=1000, help="(default: %(default)s)")
    g.add_argument("--random-input-len", type=int, default=1024, help="(default: %(default)s)")
    g.add_argument("--random-output-len", type=int, default=128, help="(default: %(default)s)")
    g.add_argument("--random-range-ratio", type=float, default=0.0,
                   help="lengths uniform in len x [1 - r, 1 + r] (default: %(default)s)")
    g.add_argument("--sharegpt-output-len", type=int, default=None,
                   help="output length of every ShareGPT request (default: its reply's)")
    g.add_argument("--prefix-repetition-prefix-len", type=int, default=256,
                   help="(default: %(default)s)")
    g.add_argument("--prefix-repetition-suffix-len", type=int, default=256,
                   help="(default: %(default)s)")
    g.add_argument("--prefix-repetition-num-prefixes", type=int, default=10,
                   help="(default: %(default)s)")
    g.add_argument("--prefix-repetition-output-len", type=int, default=128,
                   help="(default: %(default)s)")
    g.add_argument("--multi-turn-users", type=int, default=16,
                   help="multi-turn: conversations, interleaved round by round; they make "
                        "users x turns requests (--num-prompts is not used) "
                        "(default: %(default)s)")
    g.add_argument("--multi-turn-turns", type=int, default=8, help="(default: %(default)s)")
    g.add_argument("--multi-turn-question-len", type=int, default=256,
                   help="multi-turn: new tokens each turn adds to the history "
                        "(default: %(default)s)")
    g.add_argument("--multi-turn-output-len", type=int, default=128,
                   help="multi-turn: each turn's reply, in tokens (default: %(default)s)")
    g.add_argument("--temperature", type=float, default=0.0,
                   help="sent with each request (default: %(default)s, greedy)")
    g.add_argument("--ignore-eos", action="store_true",
                   help="generate every output to its length (always on for random prompts)")
    g.add_argument("--seed", type=int, default=0, help="(default: %(default)s)")
    g = p.add_argument_group("traffic")
    g.add_argument("--request-rate", type=float, default=math.inf,
                   help="requests per second, Poisson arrivals (default: inf, all at once)")
    g.add_argument("--burstiness", type=float, default=1.0,
                   help="gamma shape of the gaps: 1 is Poisson, < 1 burstier (default: 1)")
    g.add_argument("--max-concurrency", type=int, default=None,
                   help="most requests in flight at once (default: no limit)")
    g.add_argument("--sweep-rates", default=None, metavar="R1,R2,...",
                   help="one run per request rate; --save-result then also writes the sweep")
    g = p.add_argument_group("results")
    g.add_argument("--goodput", nargs="+", default=None, metavar="METRIC:MS",
                   help="SLOs for goodput, e.g. ttft:500 tpot:50 (e2el too)")
    g.add_argument("--percentile-metrics", default="ttft,tpot,itl",
                   help="metrics to report percentiles of (default: %(default)s; e2el too)")
    g.add_argument("--metric-percentiles", default="99", help="(default: %(default)s)")
    g.add_argument("--save-result", action="store_true", help="write the result JSON")
    g.add_argument("--save-detailed", action="store_true",
                   help="keep per-request lists in the JSON (ttfts, itls, input_lens, ...)")
    g.add_argument("--result-dir", type=Path, default=Path("."), help="(default: .)")
    g.add_argument("--result-filename", default=None, help="(default: derived from the run)")
    g.add_argument("--plot", action="store_true",
                   help="write PNGs beside the JSON: TTFT and ITL CDFs; for a sweep, throughput, "
                        "p90 TTFT/TPOT and SLO attainment against the rate")
    g.add_argument("--disable-tqdm", action="store_true", help="no progress bar")
