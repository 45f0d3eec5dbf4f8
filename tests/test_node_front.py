"""A node's two processes (node/calls.py, node/front.py): the engine thread's per-step
columns and the batches the front makes of them, exactly; the front loads no engine and
follows its parent out; its Health answers while the engine's process is held."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from asyncio import AbstractEventLoop
from pathlib import Path
from types import SimpleNamespace

import grpc
import pytest
from serving_helpers import completion_token_ids, tandem_up

from tandem.engine.config import EngineConfig, SchedulerConfig
from tandem.engine.llm_engine import LLMEngine
from tandem.engine.outputs import RequestOutput
from tandem.engine.sampling_params import SamplingParams
from tandem.node import outbox as outbox_module
from tandem.node.aio import Bridge, new_event_loop
from tandem.node.front import merge_columns
from tandem.node.loop import EngineLoop
from tandem.node.outbox import Chunks, ColumnOutbox
from tandem.protos import node_pb2 as pb
from tandem.protos import node_pb2_grpc as pb_grpc


def _out(rid: str, tokens: list[int], delta: str, finish: str | None = None) -> RequestOutput:
    return RequestOutput(request_id=rid, prompt_token_ids=[1, 2, 3], text="",
                         token_ids=tokens, finish_reason=finish, stop_reason=None,
                         logprobs=None, num_cached_tokens=2, delta=delta)


def test_merge_columns_makes_a_chunk_per_request_in_order() -> None:
    first = pb.OutputColumns(request_ids=["a", "b"], num_tokens=[1, 2], token_ids=[7, 8, 9],
                             texts=["x", "yz"],
                             heads=[pb.GenerateChunk(request_id="b", prefilled_by="p:1")])
    second = pb.OutputColumns(request_ids=["b", "a"], num_tokens=[1, 1], token_ids=[10, 11],
                              texts=["w", "v"],
                              ends=[pb.GenerateChunk(request_id="a", finish_reason="length",
                                                     prompt_tokens=3, completion_tokens=2)])
    batch = merge_columns([first, second])
    assert list(batch.chunks) == [
        pb.GenerateChunk(request_id="a", token_ids=[7, 11], text="xv", finish_reason="length",
                         prompt_tokens=3, completion_tokens=2),
        pb.GenerateChunk(request_id="b", token_ids=[8, 9, 10], text="yzw", prefilled_by="p:1"),
    ]


def test_a_column_outbox_sends_each_step_then_ends_its_finished_calls() -> None:
    aio = new_event_loop()
    thread = threading.Thread(target=aio.run_forever, daemon=True)
    thread.start()
    sent: list[tuple[str, pb.OutputColumns, bool]] = []
    chunks: dict[str, Chunks] = {}

    def make() -> None:
        chunks["a"] = Chunks("a", pb.GenerateChunk(queued_s=0.5))
        chunks["b"] = Chunks("b")

    asyncio.run_coroutine_threadsafe(asyncio.sleep(0), aio).result()
    aio.call_soon_threadsafe(make)
    while len(chunks) < 2:
        time.sleep(0.01)

    def send(subscriber: str, message: bytes) -> None:
        done = chunks["a"].done.is_set()
        sent.append((subscriber, pb.OutputColumns.FromString(message), done))

    outbox = ColumnOutbox("r1", Bridge(aio), send)
    on_a, on_b = outbox.listener(chunks["a"]), outbox.listener(chunks["b"])
    on_a(_out("a", [5], "he"))  # a step, on the engine thread
    on_b(_out("b", [6, 7], "lo"))
    outbox.flush()
    outbox.flush()  # nothing new: nothing sent
    on_a(_out("a", [5, 8], "y", finish="stop"))
    outbox.flush()
    asyncio.run_coroutine_threadsafe(asyncio.wait_for(chunks["a"].done.wait(), 5), aio).result()
    aio.call_soon_threadsafe(aio.stop)
    thread.join(5)
    assert [(s, done) for s, _, done in sent] == [("r1", False), ("r1", False)]
    assert sent[0][1] == pb.OutputColumns(
        request_ids=["a", "b"], num_tokens=[1, 2], token_ids=[5, 6, 7], texts=["he", "lo"],
        heads=[pb.GenerateChunk(request_id="a", queued_s=0.5)])
    assert sent[1][1] == pb.OutputColumns(
        request_ids=["a"], num_tokens=[1], token_ids=[8], texts=["y"],
        ends=[pb.GenerateChunk(request_id="a", finish_reason="stop", prompt_tokens=3,
                               completion_tokens=2, cached_tokens=2)])
    assert not chunks["b"].done.is_set()


def test_an_engine_loop_hands_a_steps_outputs_to_a_column_outbox_at_once() -> None:
    """The engine loop gives a sink's listeners their step's outputs in one `take` call;
    the columns it sends carry every request's tokens once, in order, its head first and
    its end last, the same tokens a plain listener got for the same prompt."""
    engine = LLMEngine(EngineConfig(model="tiny", load_format="dummy", device="cpu",
                                    enforce_eager=True, skip_tokenizer_init=True,
                                    scheduler=SchedulerConfig(max_num_seqs=8)))
    aio = new_event_loop()
    thread = threading.Thread(target=aio.run_forever, daemon=True)
    thread.start()
    sent: list[pb.OutputColumns] = []
    outbox = ColumnOutbox("r1", Bridge(aio), lambda _, m: sent.append(
        pb.OutputColumns.FromString(m)))
    takes: list[int] = []
    take = outbox.take
    outbox.take = lambda items: (takes.append(len(items)), take(items))[1]
    loop = EngineLoop(engine)
    loop.add_flush(outbox.flush)
    prompts = {f"r{i}": [3 + i, 40, 41 + 2 * i, 9] for i in range(5)}
    lengths = {"r0": 1, "r1": 3, "r2": 17, "r3": 17, "r4": 9}
    plain: dict[str, list[RequestOutput]] = {"plain-r2": []}
    try:
        starts = []
        for rid, prompt in [*prompts.items(), ("plain-r2", prompts["r2"])]:
            req = engine.validate_request(rid, prompt, SamplingParams(
                temperature=0.0, max_tokens=lengths.get(rid, 17), ignore_eos=True))
            listener = (plain[rid].append if rid in plain else outbox.listener(
                Chunks(rid, pb.GenerateChunk(queued_s=0.25) if rid != "r3" else None)))
            starts.append(loop.start(rid, listener, lambda e, req=req: e.add(req)))
        for started in starts:
            started.result(30)
        deadline = time.monotonic() + 60
        while not plain["plain-r2"] or not plain["plain-r2"][-1].finished:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        while sum(len(m.ends) for m in sent) < len(prompts):
            assert time.monotonic() < deadline
            time.sleep(0.01)
    finally:
        loop.close()
        aio.call_soon_threadsafe(aio.stop)
        thread.join(5)
    assert max(takes) > 1  # a step's outputs went in one call
    chunks = {c.request_id: c for c in merge_columns(sent).chunks}
    assert sorted(chunks) == sorted(prompts)
    for rid, chunk in chunks.items():
        assert len(chunk.token_ids) == lengths[rid] == chunk.completion_tokens
        assert chunk.finish_reason == "length" and chunk.prompt_tokens == 4
        assert chunk.queued_s == (0.0 if rid == "r3" else 0.25)
    assert list(chunks["r2"].token_ids) == plain["plain-r2"][-1].token_ids
    heads = [h.request_id for m in sent for h in m.heads]
    assert sorted(heads) == ["r0", "r1", "r2", "r4"]  # once each


def _interval_outbox(interval_s: float = 60.0, chunk_rate: float = 0.0
                     ) -> tuple[AbstractEventLoop, threading.Thread, list[pb.OutputColumns],
                                ColumnOutbox]:
    """A column outbox (a 60 s interval, no chunk rate) on a running loop, noting what it
    sends."""
    aio = new_event_loop()
    thread = threading.Thread(target=aio.run_forever, daemon=True)
    thread.start()
    sent: list[pb.OutputColumns] = []
    outbox = ColumnOutbox("r1", Bridge(aio), lambda _, m: sent.append(
        pb.OutputColumns.FromString(m)), interval_s, chunk_rate)
    return aio, thread, sent, outbox


def test_a_column_outbox_with_an_interval_holds_steps_but_not_first_tokens() -> None:
    aio, thread, sent, outbox = _interval_outbox()
    on_a = outbox.listener(Chunks("a", pb.GenerateChunk(queued_s=0.5)))
    on_a(_out("a", [5], "h"))
    outbox.flush(idle=False)  # a first token: at once
    on_a(_out("a", [5, 6], "e"))
    outbox.flush(idle=False)  # within the interval: held
    on_a(_out("a", [5, 6, 7], "y"))
    outbox.flush(idle=False)
    assert len(sent) == 1
    outbox.flush(idle=True)  # the engine has nothing left to step: sent now
    aio.call_soon_threadsafe(aio.stop)
    thread.join(5)
    assert len(sent) == 2
    assert list(merge_columns([sent[1]]).chunks) == [
        pb.GenerateChunk(request_id="a", token_ids=[6, 7], text="ey")]


def test_a_first_token_goes_at_once_without_the_other_requests_tokens() -> None:
    """Requests that start one after another (1P1D: each as its push lands): a request's
    first chunk goes at the end of its step, the running requests' tokens of that step
    stay held for the interval."""
    aio, thread, sent, outbox = _interval_outbox()
    on_a = outbox.listener(Chunks("a", pb.GenerateChunk(queued_s=0.5)))
    on_b = outbox.listener(Chunks("b", pb.GenerateChunk(queued_s=0.25)))
    outbox.take([(on_a, _out("a", [5], "h"))])
    outbox.flush(idle=True)
    outbox.take([(on_a, _out("a", [5, 6], "e")), (on_b, _out("b", [8], "x"))])
    outbox.flush(idle=False)  # b's first token goes; a's token waits
    outbox.take([(on_a, _out("a", [5, 6, 7], "y")), (on_b, _out("b", [8, 9], "z"))])
    outbox.flush(idle=False)
    assert len(sent) == 2
    outbox.flush(idle=True)
    aio.call_soon_threadsafe(aio.stop)
    thread.join(5)
    assert [[h.request_id for h in m.heads] for m in sent] == [["a"], ["b"], []]
    assert list(merge_columns([sent[1]]).chunks) == [
        pb.GenerateChunk(request_id="b", token_ids=[8], text="x", queued_s=0.25)]
    assert list(merge_columns([sent[2]]).chunks) == [
        pb.GenerateChunk(request_id="a", token_ids=[6, 7], text="ey"),
        pb.GenerateChunk(request_id="b", token_ids=[9], text="z")]


def test_the_chunk_rate_holds_each_stream_longer_the_more_requests_run(monkeypatch) -> None:
    """`--stream-chunk-rate`: N requests running get a chunk each at most every N / rate
    seconds (first tokens at once); the tokens held go in the next chunk, none lost."""
    now = [0.0]
    monkeypatch.setattr(outbox_module, "time", SimpleNamespace(monotonic=lambda: now[0]))
    aio, thread, sent, outbox = _interval_outbox(interval_s=0.0, chunk_rate=100.0)
    on = {r: outbox.listener(Chunks(r, pb.GenerateChunk())) for r in "abcd"}
    tokens = {r: [] for r in "abcd"}

    def step(at: float, rids: str) -> int:
        now[0] = at
        for r in rids:
            tokens[r].append(len(tokens[r]) + 10)
        outbox.take([(on[r], _out(r, list(tokens[r]), "t")) for r in rids])
        before = len(sent)
        outbox.flush(idle=False)
        return len(sent) - before

    assert step(0.0, "ab") == 1  # first tokens: at once
    assert step(0.015, "ab") == 0  # two streams at 100 a second: one each per 20 ms
    assert step(0.021, "ab") == 1
    assert step(0.022, "abcd") == 1  # c's and d's first tokens alone; a's and b's held
    assert step(0.045, "abcd") == 0  # four streams: 40 ms since the last send
    assert step(0.062, "abcd") == 1
    outbox.flush(idle=True)
    aio.call_soon_threadsafe(aio.stop)
    thread.join(5)
    assert [sorted(m.request_ids) for m in sent] == [
        ["a", "b"], ["a", "a", "b", "b"], ["c", "d"], ["a"] * 3 + ["b"] * 3 + ["c"] * 2 + ["d"] * 2]
    got = {c.request_id: list(c.token_ids) for c in merge_columns(sent).chunks}
    assert got == tokens


def test_without_a_chunk_rate_every_step_goes() -> None:
    aio, thread, sent, outbox = _interval_outbox(interval_s=0.0)
    listeners = [outbox.listener(Chunks(r, pb.GenerateChunk())) for r in "abcdefgh"]
    for n in range(1, 4):
        outbox.take([(on, _out(on.chunks.request_id, list(range(n)), "t")) for on in listeners])
        outbox.flush(idle=False)
    aio.call_soon_threadsafe(aio.stop)
    thread.join(5)
    assert len(sent) == 3


def test_a_stream_interval_sends_fewer_chunks_with_the_same_tokens() -> None:
    """`tandem up --stream-interval-ms`: a streamed completion's tokens come in a few
    chunks (the first at once), and they are the unstreamed completion's."""
    prompt = [5, 17, 99, 3, 250, 41, 7]
    with tandem_up(["--model", "tiny", "--load-format", "dummy", "--skip-tokenizer-init",
                    "--colocated", "1", "--stream-interval-ms", "300"]) as (url, _, _):
        want = completion_token_ids(url, prompt, 48)
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 48, "temperature": 0,
                "ignore_eos": True, "stream": True}
        req = urllib.request.Request(f"{url}/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        chunks = []
        with urllib.request.urlopen(req, timeout=120) as r:
            for line in r:
                if line.startswith(b"data: {"):
                    chunks.append(json.loads(line[6:])["choices"][0]["token_ids"])
    assert [t for c in chunks for t in c] == want
    assert len(chunks[0]) == 1
    assert len(chunks) < 48 // 4, [len(c) for c in chunks]


def test_the_front_loads_no_engine() -> None:
    code = ("import sys, tandem.node.front as f; f.serve = lambda *a: f.asyncio.sleep(0); "
            "sys.argv = ['front', '--host', 'h', '--port', '0', '--ipc', 'd', '--parent', '1']; "
            "f.main(); print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "False"


def _running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


def test_the_front_exits_once_its_parent_is_gone() -> None:
    with tempfile.TemporaryDirectory() as ipc:
        # A parent (as a node would be) that starts the front and lives on until killed.
        code = ("import os, subprocess, sys, time\n"
                "front = subprocess.Popen([sys.executable, '-m', 'tandem.node.front', '--host',"
                f" '127.0.0.1', '--port', '0', '--ipc', {ipc!r}, '--parent', str(os.getpid())])\n"
                "print(front.pid, flush=True)\n"
                "time.sleep(120)\n")
        parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                                  text=True)
        front = int(parent.stdout.readline())
        try:
            time.sleep(3.0)
            assert _running(front)  # its parent lives: it serves on
            parent.kill()
            parent.wait()
            deadline = time.monotonic() + 20
            while _running(front) and time.monotonic() < deadline:
                time.sleep(0.1)
            assert not _running(front)
        finally:
            parent.kill()
            if _running(front):
                os.kill(front, 9)


def test_health_answers_from_the_front_while_the_engines_process_is_held() -> None:
    """Health is forwarded; while the engine's process does not answer (stopped here, as
    a burst of calls or transfers would hold it), the front answers at once with the last
    reply it saw; after a second without one, Health waits for that process again."""
    from serving_helpers import node_address, start, stop

    node = start(["node", "--role", "decode", "--model", "tiny", "--load-format", "dummy",
                  "--skip-tokenizer-init", "--num-kv-blocks", "16"])
    try:
        with grpc.insecure_channel(node_address(node)) as channel:
            stub = pb_grpc.NodeStub(channel)
            first = stub.Health(pb.HealthRequest(), timeout=30)
            time.sleep(0.5)  # the front's own poll has a reply too
            os.kill(node.pid, signal.SIGSTOP)  # the engine's process; its front runs on
            try:
                began = time.monotonic()
                held = stub.Health(pb.HealthRequest(), timeout=5)
                took = time.monotonic() - began
                time.sleep(1.2)
                with pytest.raises(grpc.RpcError) as late:
                    stub.Health(pb.HealthRequest(), timeout=0.5)
            finally:
                os.kill(node.pid, signal.SIGCONT)
            assert took < 0.5 and held.pid == first.pid == node.pid and held.engine_alive
            assert late.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            assert stub.Health(pb.HealthRequest(), timeout=30).engine_alive
    finally:
        stop([node])
