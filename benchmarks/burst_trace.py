"""Where a burst's time goes, from the marks a traced run left (`engine/trace.py`): run
`tandem up` with TANDEM_TRACE=FILE in its environment, send one burst (`tandem bench
serve` at rate inf), then

    python benchmarks/burst_trace.py FILE [--since T0] [--until T1]

prints the engine's side (its steps: how many, the first to the last, the median step)
and, for the requests in the order their first output was made on the decode node, how
long that output took to reach the router (`decode.first_chunk` -> `router.first_chunk`):
when the engine outruns the router, that lag grows through the burst. Times are seconds
since the engine's first step; `--since`/`--until` (epoch seconds) keep one burst's marks.

`--timeline` instead takes every burst the bench client marked (`bench.start` to
`bench.end`; an engine stepped offline under `EngineLoop` marks only steps, and its
bursts are split at the idle gaps) and prints where its time went: the requests'
arrival at the router and the node, the engine's steps by length (a step over 5 ms is
an eager one at small shapes), the time between steps, and the tail after the last.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict
from pathlib import Path
from typing import Any


def burst(path: Path, since: float = 0.0, until: float = float("inf")) -> dict[str, Any]:
    marks = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    marks = [m for m in marks if since <= m["t"] <= until]
    begins = [m["t"] for m in marks if m["rid"] == "step" and m["at"] == "step.begin"]
    ends = [m["t"] for m in marks if m["rid"] == "step" and m["at"] == "step.end"]
    start = begins[0]
    points: dict[str, dict[str, float]] = defaultdict(dict)
    for m in marks:
        if m["rid"] != "step":
            points[m["rid"]][m["at"]] = m["t"] - start
    lags = sorted((p["decode.first_chunk"], p["router.first_chunk"] - p["decode.first_chunk"])
                  for p in points.values()
                  if "decode.first_chunk" in p and "router.first_chunk" in p)
    return {"steps": len(ends), "engine_span_s": ends[-1] - start,
            "median_step_ms": 1000 * statistics.median(e - b for b, e in zip(begins, ends)),
            "first_output_made_s": [made for made, _ in lags],
            "lag_to_router_s": [lag for _, lag in lags]}


def gc_pauses(marks: list[dict[str, Any]]) -> list[tuple[int, float, float]]:
    """Each traced process's collections of the older generations: (pid, start, seconds)."""
    began: dict[int, float] = {}
    out = []
    for m in sorted((m for m in marks if m["rid"] == "gc"), key=lambda m: m["t"]):
        if m["at"] == "gc.start":
            began[m["pid"]] = m["t"]
        elif m["pid"] in began:
            start = began.pop(m["pid"])
            out.append((m["pid"], start, m["t"] - start))
    return out


EAGER_S = 0.005  # a step longer than this is counted as eager (small shapes)


def timeline(marks: list[dict[str, Any]]) -> dict[str, float]:
    """One burst's phases, in seconds from its start (the bench's, else the first step's).
    Steps are the decode node's (1P1D's prefill node marks its own steps too)."""
    decode = {m["pid"] for m in marks if m["at"] == "decode.generate"}
    at = defaultdict(list)
    for m in marks:
        if m["rid"] != "step" or not decode or m["pid"] in decode:
            at[m["at"]].append(m["t"])
    begins, ends = at["step.begin"], at["step.end"]
    start = at["bench.start"][0] if at["bench.start"] else begins[0]
    steps = [e - b for b, e in zip(begins, ends)]
    eager = [s for s in steps if s > EAGER_S]
    short = [s for s in steps if s <= EAGER_S]
    row = {"first_step": begins[0] - start, "last_step_end": ends[-1] - start,
           "steps": len(steps), "eager_steps": len(eager), "eager_s": sum(eager),
           "short_steps_s": sum(short),
           "median_short_ms": 1000 * statistics.median(short) if short else 0.0,
           "between_steps_s": sum(b - e for e, b in zip(ends, begins[1:]))}
    for point in ("router.request", "front.generate", "decode.generate"):
        if at[point]:
            row[f"first_{point}"] = min(at[point]) - start
            row[f"last_{point}"] = max(at[point]) - start
    if at["bench.end"]:
        row["end"] = at["bench.end"][-1] - start
    pauses = gc_pauses(marks)
    row["gc_pauses"] = len(pauses)
    row["gc_longest_ms"] = 1000 * max((d for _, _, d in pauses), default=0.0)
    return row


def bursts(path: Path, idle_s: float = 0.3) -> list[list[dict[str, Any]]]:
    """The trace's bursts: from each `bench.start` to its `bench.end`, or, with no bench
    marks, runs of steps split where the engine idled for `idle_s`."""
    marks = sorted((json.loads(line) for line in path.read_text().splitlines()
                    if line.strip()), key=lambda m: m["t"])
    starts = [m["t"] for m in marks if m["at"] == "bench.start"]
    if starts:
        stops = [m["t"] for m in marks if m["at"] == "bench.end"]
        return [[m for m in marks if a <= m["t"] <= b] for a, b in zip(starts, stops)]
    out: list[list[dict[str, Any]]] = []
    last = float("-inf")
    for m in marks:
        if m["t"] - last > idle_s:
            out.append([])
        out[-1].append(m)
        last = m["t"]
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("trace", type=Path)
    p.add_argument("--since", type=float, default=0.0, help="epoch seconds (default: all)")
    p.add_argument("--until", type=float, default=float("inf"), help="epoch seconds")
    p.add_argument("--timeline", action="store_true", help="every burst's phases")
    args = p.parse_args()
    if args.timeline:
        for marks in bursts(args.trace):
            if any(m["at"] == "step.end" for m in marks):
                print(json.dumps({k: round(v, 4) for k, v in timeline(marks).items()}))
        return
    b = burst(args.trace, args.since, args.until)
    print(f"{b['steps']} engine steps in {b['engine_span_s']:.3f} s, median step "
          f"{b['median_step_ms']:.2f} ms")
    made, lag = b["first_output_made_s"], b["lag_to_router_s"]
    for i in range(0, len(made), max(1, len(made) // 16)):
        print(f"  first output made at {made[i]:6.3f} s, at the router {lag[i] * 1000:7.1f} ms "
              "later")


if __name__ == "__main__":
    main()
