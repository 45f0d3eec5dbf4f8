"""The per-token path out of a node and through the router: outputs that queue while a
stream is busy leave as one chunk (node: `Outbox`; router: `Flow._generate`), with every
token and all their text; and the critical-path trace (`engine/trace.py`)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

from tandem.engine import trace
from tandem.engine.outputs import RequestOutput
from tandem.node.aio import Bridge
from tandem.node.outbox import Chunks, Outbox
from tandem.protos import node_pb2 as pb
from tandem.router.flow import _merged

ROOT = Path(__file__).resolve().parents[1]


def _out(rid: str, tokens: list[int], delta: str, finish: str | None = None) -> RequestOutput:
    return RequestOutput(rid, [7, 8], "", list(tokens), finish, None, None, 0, delta)


def test_outbox_sends_a_requests_queued_outputs_as_one_chunk() -> None:
    async def run() -> list[pb.OutputBatch]:
        outbox = Outbox("router-1", Bridge(asyncio.get_running_loop()))
        batches = outbox.batches()
        assert not (await anext(batches)).chunks  # the stream's opening message
        a, b = Chunks("a", pb.GenerateChunk(prefilled_by="p:1")), Chunks("b")
        on_a, on_b = outbox.listener(a), outbox.listener(b)
        # One engine step's outputs, then two more steps, all before the stream reads:
        on_a(_out("a", [1], "x"))
        on_b(_out("b", [5], "u"))
        on_a(_out("a", [1, 2], "y"))
        on_a(_out("a", [1, 2, 3], "z", "length"))
        first = await anext(batches)
        on_b(_out("b", [5, 6], "v", "stop"))  # after the read: a batch of its own
        second = await anext(batches)
        outbox.close()
        return [first, second]

    first, second = asyncio.run(run())
    by_id = {c.request_id: c for c in first.chunks}
    assert list(by_id) == ["a", "b"]  # in the order the requests first queued
    a = by_id["a"]
    assert (list(a.token_ids), a.text, a.finish_reason) == ([1, 2, 3], "xyz", "length")
    assert a.prefilled_by == "p:1" and a.completion_tokens == 3  # head and end kept
    assert (list(by_id["b"].token_ids), by_id["b"].text) == ([5], "u")
    [b] = second.chunks
    assert (list(b.token_ids), b.text, b.finish_reason) == ([6], "v", "stop")


def test_outbox_from_another_thread_delivers_every_token_once_in_order() -> None:
    """The engine thread appends outputs and wakes the loop once per batch while the
    loop drains them: every token of every request arrives once, in order, and each
    request's last chunk ends it."""
    steps, n = 300, 16

    async def run() -> dict[str, list[int]]:
        outbox = Outbox("router-1", Bridge(asyncio.get_running_loop()))
        batches = outbox.batches()
        await anext(batches)
        listeners = [outbox.listener(Chunks(f"r{i}")) for i in range(n)]

        def engine() -> None:
            for step in range(1, steps + 1):
                finish = "length" if step == steps else None
                for i, on in enumerate(listeners):
                    on(_out(f"r{i}", list(range(step)), str(step - 1), finish))

        thread = threading.Thread(target=engine)
        thread.start()
        got: dict[str, list[int]] = {f"r{i}": [] for i in range(n)}
        ended = 0
        while ended < n:
            for chunk in (await anext(batches)).chunks:
                got[chunk.request_id] += chunk.token_ids
                ended += bool(chunk.finish_reason)
        thread.join()
        outbox.close()
        return got

    got = asyncio.run(run())
    assert got == {f"r{i}": list(range(steps)) for i in range(n)}


def test_router_merges_consecutive_chunks_keeping_the_head_and_the_end() -> None:
    first = pb.GenerateChunk(token_ids=[1], text="Hel", prefilled_by="p:1", queued_s=0.5)
    then = pb.GenerateChunk(token_ids=[2, 3], text="lo!", finish_reason="stop",
                            prompt_tokens=4, completion_tokens=3)
    merged = _merged(first, then)
    assert list(merged.token_ids) == [1, 2, 3] and merged.text == "Hello!"
    assert (merged.prefilled_by, merged.queued_s) == ("p:1", 0.5)
    assert (merged.finish_reason, merged.prompt_tokens, merged.completion_tokens) == (
        "stop", 4, 3)


def test_trace_marks_go_to_the_named_file_from_every_process(tmp_path: Path) -> None:
    path = tmp_path / "trace.jsonl"
    code = ("import gc, sys; from tandem.engine import trace; rid = sys.argv[1]; "
            "trace.mark(rid, 'router.request'); gc.collect(); "
            "trace.mark(rid, 'decode.generate')")
    env = {**os.environ, "TANDEM_TRACE": str(path)}
    for rid in ("r1", "r2"):  # two processes append to one file
        subprocess.run([sys.executable, "-c", code, rid], env=env, check=True, timeout=60)
    every = [json.loads(line) for line in path.read_text().splitlines()]
    # Each process's full collection, between its two marks, is marked too.
    collections = [(m["at"], m["n"]) for m in every if m["rid"] == "gc"]
    assert collections[:2] == [("gc.start", 2), ("gc.stop", 2)], collections
    assert every[1]["rid"] == "gc" and every[2]["rid"] == "gc"
    marks = [m for m in every if m["rid"] != "gc"]
    assert [m["at"] for m in marks] == ["router.request", "decode.generate"] * 2
    assert len({m["pid"] for m in marks}) == 2
    assert [m["rid"] for m in marks] == ["r1", "r1", "r2", "r2"]
    assert marks[0]["t"] <= marks[1]["t"] <= marks[2]["t"]
    report = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "trace_report.py"), str(path)],
        capture_output=True, text=True, check=True, timeout=60).stdout
    assert "2 requests" in report and "decode.generate" in report


def test_trace_is_off_without_the_variable(tmp_path: Path, monkeypatch) -> None:  # noqa: ANN001
    monkeypatch.chdir(tmp_path)
    assert trace.PATH is None or "TANDEM_TRACE" in os.environ
    monkeypatch.setattr(trace, "PATH", None)
    trace.mark("r1", "router.request")  # no file, no error
    assert list(tmp_path.iterdir()) == []
