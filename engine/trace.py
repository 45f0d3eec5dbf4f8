"""Where one request's time goes: `mark(request_id, point)` notes the wall-clock time at a
point of the critical path (router, decode node, prefill node, transfer agent and push)
when the environment variable TANDEM_TRACE names a file, and does nothing otherwise.

Every process that has it appends one JSON line per mark to that file,

    {"t": 1764104123.123456, "pid": 4242, "rid": "cmpl-...", "at": "prefill.hook"}

with O_APPEND, so lines from the router and every node interleave whole, and on one host
their times compare (one clock). `benchmarks/ttft_trace.py` turns them into the median
time between consecutive points. A mark costs one write(2): for tracing runs, not for
serving under load. A traced process also marks its garbage collector's collections of
the older generations (`gc.start`, `gc.stop`; request id "gc").
"""

from __future__ import annotations

import gc
import json
import os
import time

PATH = os.environ.get("TANDEM_TRACE") or None
_fd: int | None = None
_pid = 0


def mark(request_id: str, point: str, n: int | None = None) -> None:
    """`n`: a count to note with the point (the requests a step ran)."""
    if PATH is None:
        return
    global _fd, _pid
    if _fd is None or _pid != os.getpid():  # opened once per process (after a fork too)
        _fd, _pid = os.open(PATH, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600), os.getpid()
        if _on_gc not in gc.callbacks:
            gc.callbacks.append(_on_gc)
    fields = {"t": time.time(), "pid": _pid, "rid": request_id, "at": point}
    if n is not None:
        fields["n"] = n
    line = json.dumps(fields)
    os.write(_fd, line.encode() + b"\n")


def _on_gc(phase: str, info: dict) -> None:
    """The older generations' collections, each a pause of its whole process: `gc.start`
    and `gc.stop` marks, `n` the generation."""
    if info["generation"] >= 1:
        mark("gc", f"gc.{phase}", info["generation"])
