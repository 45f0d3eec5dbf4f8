"""PNG plots of serving benchmark results (matplotlib, imported only when plotting):
TTFT and ITL CDFs of one run; for request-rate sweeps, throughput, p90 TTFT and TPOT,
and SLO attainment against the rate, one line per configuration."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np


def _pyplot():  # noqa: ANN202
    try:
        import matplotlib
    except ImportError:
        raise RuntimeError("--plot needs matplotlib: pip install matplotlib") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _cdf(ax: Any, values_s: list[float], label: str) -> None:
    ms = np.sort(np.asarray(values_s, dtype=float)) * 1000
    if ms.size:
        ax.plot(ms, np.arange(1, ms.size + 1) / ms.size, label=label)


def plot_cdfs(result: dict[str, Any], path: Path) -> None:
    """TTFT and ITL CDFs of one run (needs its per-request ttfts and itls)."""
    plt = _pyplot()
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    ok = [e == "" for e in result["errors"]]
    _cdf(a, [t for t, good in zip(result["ttfts"], ok) if good], "TTFT")
    _cdf(b, [x for itl, good in zip(result["itls"], ok) if good for x in itl], "ITL")
    for ax, name in ((a, "TTFT"), (b, "ITL")):
        ax.set_xlabel(f"{name} (ms)")
        ax.set_ylabel("fraction of " + ("requests" if name == "TTFT" else "tokens"))
        ax.grid(True, alpha=0.3)
    rate = result["request_rate"]
    fig.suptitle(f"{result['label'] or result['backend']}: {result['num_prompts']} requests "
                 f"at {rate} req/s, {result['output_throughput']:.0f} output tok/s")
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    print(f"wrote {path}")


def _p90(lists: list[float]) -> float:
    return float(np.percentile(lists, 90)) * 1000 if lists else float("nan")


def plot_sweep(runs: dict[str, list[dict[str, Any]]], path: Path) -> None:
    """For each configuration's runs (one per rate, with per-request lists): output
    tok/s, p90 TTFT, p90 TPOT and SLO attainment against the request rate."""
    plt = _pyplot()
    fig, axes = plt.subplots(2, 2, figsize=(10, 7))
    for name, results in runs.items():
        rates = [r["request_rate"] for r in results]
        axes[0, 0].plot(rates, [r["output_throughput"] for r in results], marker="o",
                        label=name)
        axes[0, 1].plot(rates, [_p90([t for t, e in zip(r["ttfts"], r["errors"]) if not e])
                                for r in results], marker="o", label=name)
        tpots = []
        for r in results:
            per = [(lat - ttft) / (n - 1) for lat, ttft, n, e in
                   zip(r["latencies"], r["ttfts"], r["output_lens"], r["errors"])
                   if not e and n > 1]
            tpots.append(_p90(per))
        axes[1, 0].plot(rates, tpots, marker="o", label=name)
        if all(r.get("slo_attainment") is not None for r in results):
            axes[1, 1].plot(rates, [100 * r["slo_attainment"] for r in results], marker="o",
                            label=name)
    titles = ("output tok/s", "p90 TTFT (ms)", "p90 TPOT (ms)", "SLO attainment (%)")
    for ax, title in zip(axes.flat, titles):
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel(title)
        ax.grid(True, alpha=0.3)
        ax.legend()
    axes[1, 1].axhline(90, color="k", linestyle="--", linewidth=0.8)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    print(f"wrote {path}")
