"""Where a request's time goes, from the marks a traced run left (`engine/trace.py`):
run `tandem up` with TANDEM_TRACE=FILE in its environment, send requests one at a time
(`tandem bench serve --max-concurrency 1`), then

    python benchmarks/trace_report.py FILE [--skip 11] [--take 20] [--json out.json]

For every request the router saw, each point's time since the router took it
(`router.request`), and the engine steps of every process in that window; printed as the
median over requests of each point, in the order the points came. `--skip` drops the first
requests (a bench's warm-up), `--take` keeps the next N (one workload of several).
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict
from pathlib import Path
from typing import Any


def load(path: Path) -> tuple[dict[str, list[dict]], dict[int, list[tuple[float, str]]]]:
    """The marks by request id, and each process's step marks, in time order."""
    by_rid: dict[str, list[dict]] = defaultdict(list)
    steps: dict[int, list[tuple[float, str]]] = defaultdict(list)
    for line in path.read_text().splitlines():
        try:
            mark = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut short by a killed process
        if mark["rid"] == "step":
            steps[mark["pid"]].append((mark["t"], mark["at"]))
        elif mark["rid"] != "gc":  # a process's collections (burst_trace.py reports them)
            by_rid[mark["rid"]].append(mark)
    for marks in by_rid.values():
        marks.sort(key=lambda m: m["t"])
    return by_rid, steps


def timeline(marks: list[dict], steps: dict[int, list[tuple[float, str]]],
             names: dict[int, str]) -> list[tuple[str, float]]:
    """(point, ms since router.request) for one request, its window's steps included
    (named by the process whose marks come first for that pid)."""
    start = next(m["t"] for m in marks if m["at"] == "router.request")
    end = max(m["t"] for m in marks)
    points = [(m["at"], m["t"]) for m in marks]
    for pid, marks_of_pid in steps.items():
        for t, at in marks_of_pid:
            if start <= t <= end:
                points.append((f"{names.get(pid, pid)}.{at}", t))
    points.sort(key=lambda p: p[1])
    seen: dict[str, int] = defaultdict(int)
    out = []
    for at, t in points:  # a point met twice (two steps) is numbered
        seen[at] += 1
        out.append((at if seen[at] == 1 else f"{at}#{seen[at]}", (t - start) * 1e3))
    return out


def report(path: Path, skip: int, take: int | None = None) -> dict[str, Any]:
    by_rid, steps = load(path)
    names: dict[int, str] = {}
    for marks in by_rid.values():
        for m in marks:
            names.setdefault(m["pid"], m["at"].split(".")[0])
    traced = sorted((marks for marks in by_rid.values()
                     if any(m["at"] == "router.request" for m in marks)),
                    key=lambda marks: marks[0]["t"])[skip:]
    traced = traced if take is None else traced[:take]
    lines = [timeline(marks, steps, names) for marks in traced]
    order: dict[str, float] = {}
    values: dict[str, list[float]] = defaultdict(list)
    for line in lines:
        for at, ms in line:
            values[at].append(ms)
            order.setdefault(at, ms)
    points = sorted(values, key=lambda at: statistics.median(values[at]))
    return {"requests": len(lines),
            "median_ms": {at: round(statistics.median(values[at]), 3) for at in points},
            "seen_in": {at: len(values[at]) for at in points}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("trace", type=Path, help="the TANDEM_TRACE file")
    p.add_argument("--skip", type=int, default=0, help="drop the first N requests")
    p.add_argument("--take", type=int, default=None, help="then keep the next N")
    p.add_argument("--json", type=Path, default=None, help="write the report here too")
    args = p.parse_args()
    out = report(args.trace, args.skip, args.take)
    print(f"{out['requests']} requests; median ms since the router took each:")
    previous = 0.0
    for at, ms in out["median_ms"].items():
        print(f"  {ms:9.3f}  (+{ms - previous:7.3f})  {at}  [{out['seen_in'][at]}]")
        previous = ms
    if args.json is not None:
        args.json.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
