"""What happened over the last minutes, per node and per router: latency samples with
their percentiles, and rates read off a node's counters. The admin API shows them; the
planner decides on them."""

from __future__ import annotations

import time
from collections import deque

SPAN_S = 600.0  # the longest window anyone may ask about
MAX_SAMPLES = 200_000  # per window: about 3,000 tokens/s for a minute


class Window:
    """Samples (seconds ago ≤ `SPAN_S`): how many, and their percentiles."""

    def __init__(self) -> None:
        self._samples: deque[tuple[float, float]] = deque(maxlen=MAX_SAMPLES)

    def add(self, value: float, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        self._samples.append((now, value))
        while self._samples and self._samples[0][0] < now - SPAN_S:
            self._samples.popleft()

    def values(self, span_s: float, now: float | None = None) -> list[float]:
        since = (time.monotonic() if now is None else now) - span_s
        return [v for t, v in self._samples if t >= since]

    def percentiles(self, span_s: float, now: float | None = None
                    ) -> dict[str, float] | None:
        """p50, p90 and p99 (nearest rank) of the last `span_s`; None: no samples."""
        values = sorted(self.values(span_s, now))
        if not values:
            return None
        return {f"p{p}": values[min(len(values) - 1, -(-p * len(values) // 100) - 1)]
                for p in (50, 90, 99)}


class Rates:
    """Counters read at each poll; their rate of increase over a window."""

    def __init__(self) -> None:
        self._readings: deque[tuple[float, tuple[float, ...]]] = deque()

    def read(self, counters: tuple[float, ...], now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        if self._readings and any(c < p for c, p in zip(counters, self._readings[-1][1])):
            self._readings.clear()  # the node restarted: its counters began again
        self._readings.append((now, counters))
        while len(self._readings) > 2 and self._readings[1][0] < now - SPAN_S:
            self._readings.popleft()

    def per_second(self, span_s: float, now: float | None = None) -> tuple[float, ...] | None:
        """Each counter's increase per second over the last `span_s`; None: too few
        readings."""
        since = (time.monotonic() if now is None else now) - span_s
        inside = [r for r in self._readings if r[0] >= since]
        if len(inside) < 2:
            return None
        (t0, first), (t1, last) = inside[0], inside[-1]
        return tuple((b - a) / (t1 - t0) for a, b in zip(first, last)) if t1 > t0 else None
