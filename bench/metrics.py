"""What one serving benchmark run measured, computed the way vLLM's `vllm bench serve`
computes it, so its JSON reads the same:

- TTFT: from sending a request to its first streamed chunk;
- ITL: between consecutive chunks of a request;
- TPOT: (latency - TTFT) / (output tokens - 1), for requests of more than one token;
- E2EL: from sending a request to its last chunk;
- goodput: completed requests meeting every given SLO, per second of the run (a request
  of one token counts a TPOT of 0).
Percentiles are numpy's (linear interpolation); an empty list counts as [0].
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

METRICS = ("ttft", "tpot", "itl", "e2el")


@dataclass
class RequestRecord:
    """One request as the client saw it; times in seconds."""

    prompt_len: int = 0
    success: bool = False
    output_tokens: int = 0  # the server's usage count (0: unknown, counted from chunks)
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0
    start_time: float = 0.0  # perf_counter at send
    queue_time: float = 0.0  # waiting for a --max-concurrency slot
    generated_text: str = ""
    error: str = ""


def parse_goodput(items: Sequence[str] | None) -> dict[str, float]:
    """["ttft:500", "tpot:50"] -> {"ttft": 500.0, "tpot": 50.0} (milliseconds)."""
    slos: dict[str, float] = {}
    for item in items or ():
        name, sep, value = item.partition(":")
        if not sep or name not in ("ttft", "tpot", "e2el"):
            raise ValueError(f"--goodput takes ttft:MS, tpot:MS or e2el:MS, got {item!r}")
        try:
            ms = float(value)
        except ValueError:
            raise ValueError(f"--goodput {item!r}: {value!r} is not a number") from None
        if ms < 0:
            raise ValueError(f"--goodput {item!r}: an SLO cannot be negative")
        slos[name] = ms
    return slos


def _stats(values: list[float], percentiles: Sequence[float]) -> dict[str, Any]:
    data = values or [0.0]
    return {
        "mean": float(np.mean(data)) * 1000,
        "median": float(np.median(data)) * 1000,
        "std": float(np.std(data)) * 1000,
        "percentiles": [(p, float(np.percentile(data, p)) * 1000) for p in percentiles],
    }


def percentile_name(p: float) -> str:
    return str(int(p)) if int(p) == p else str(p)


def compute_metrics(
    records: Sequence[RequestRecord],
    duration_s: float,
    percentiles: Sequence[float] = (99.0,),
    goodput: dict[str, float] | None = None,
    selected: Sequence[str] = ("ttft", "tpot", "itl"),
) -> dict[str, Any]:
    """The run's summary under vLLM's keys: counts, throughputs, and for each selected
    metric mean_/median_/std_/pNN_{metric}_ms."""
    output_lens: list[int] = []
    total_input = completed = good = 0
    ttfts: list[float] = []
    tpots: list[float] = []  # requests of more than one token
    all_tpots: list[float] = []  # every completed request, 0 for one token (goodput)
    itls: list[float] = []
    e2els: list[float] = []
    for r in records:
        if not r.success:
            output_lens.append(0)
            continue
        n = r.output_tokens or (len(r.itl) + 1)
        output_lens.append(n)
        total_input += r.prompt_len
        tpot = 0.0
        if n > 1:
            tpot = (r.latency - r.ttft) / (n - 1)
            tpots.append(tpot)
        all_tpots.append(tpot)
        itls += r.itl
        ttfts.append(r.ttft)
        e2els.append(r.latency)
        completed += 1
    if goodput:
        per_metric = {"ttft": ttfts, "tpot": all_tpots, "e2el": e2els}
        limits = [(per_metric[name], ms / 1000) for name, ms in goodput.items()]
        good = sum(all(values[i] <= slo for values, slo in limits) for i in range(completed))
    total_output = sum(output_lens)
    result: dict[str, Any] = {
        "duration": duration_s,
        "completed": completed,
        "failed": len(records) - completed,
        "total_input_tokens": total_input,
        "total_output_tokens": total_output,
        "request_throughput": completed / duration_s,
        "request_goodput": good / duration_s if goodput else None,
        "output_throughput": total_output / duration_s,
        "total_token_throughput": (total_input + total_output) / duration_s,
        # Tandem's: the share of all requests that completed within every SLO.
        "slo_attainment": good / len(records) if goodput and records else None,
        **_peaks(records),
        "output_lens": output_lens,
    }
    values = {"ttft": ttfts, "tpot": tpots, "itl": itls, "e2el": e2els}
    for name in selected:
        if name not in values:
            raise ValueError(f"--percentile-metrics: unknown metric {name!r}; use {METRICS}")
        s = _stats(values[name], percentiles)
        for key in ("mean", "median", "std"):
            result[f"{key}_{name}_ms"] = s[key]
        for p, v in s["percentiles"]:
            result[f"p{percentile_name(p)}_{name}_ms"] = v
    return result


def _peaks(records: Sequence[RequestRecord]) -> dict[str, Any]:
    """The most output tokens in any one second of the run, and the most requests in
    flight at once (vLLM's max_output_tokens_per_s and max_concurrent_requests)."""
    done = [r for r in records if r.success]
    if not done:
        return {"max_output_tokens_per_s": 0.0, "max_concurrent_requests": 0}
    t0 = min(r.start_time for r in done)
    t1 = max(r.start_time + r.latency for r in done)
    per_second = np.zeros(int(np.ceil(t1 - t0)) + 1)
    events: list[tuple[float, int]] = []
    for r in done:
        t = r.start_time + r.ttft
        times = [t]
        for gap in r.itl:
            t += gap
            times.append(t)
        for t in times:
            per_second[int(t - t0)] += 1
        events += [(r.start_time, 1), (r.start_time + r.latency, -1)]
    in_flight = peak = 0
    for _, delta in sorted(events):  # an end before a start at the same instant
        in_flight += delta
        peak = max(peak, in_flight)
    return {"max_output_tokens_per_s": float(per_second.max()), "max_concurrent_requests": peak}
