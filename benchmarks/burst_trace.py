"""Where a burst's time goes, from the marks a traced run left (`engine/trace.py`): run
`tandem up` with TANDEM_TRACE=FILE in its environment, send one burst (`tandem bench
serve` at rate inf), then

    python benchmarks/burst_trace.py FILE [--since T0] [--until T1]

prints the engine's side (its steps: how many, the first to the last, the median step)
and, for the requests in the order their first output was made on the decode node, how
long that output took to reach the router (`decode.first_chunk` -> `router.first_chunk`):
when the engine outruns the router, that lag grows through the burst. Times are seconds
since the engine's first step; `--since`/`--until` (epoch seconds) keep one burst's marks.
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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("trace", type=Path)
    p.add_argument("--since", type=float, default=0.0, help="epoch seconds (default: all)")
    p.add_argument("--until", type=float, default=float("inf"), help="epoch seconds")
    args = p.parse_args()
    b = burst(args.trace, args.since, args.until)
    print(f"{b['steps']} engine steps in {b['engine_span_s']:.3f} s, median step "
          f"{b['median_step_ms']:.2f} ms")
    made, lag = b["first_output_made_s"], b["lag_to_router_s"]
    for i in range(0, len(made), max(1, len(made) // 16)):
        print(f"  first output made at {made[i]:6.3f} s, at the router {lag[i] * 1000:7.1f} ms "
              "later")


if __name__ == "__main__":
    main()
