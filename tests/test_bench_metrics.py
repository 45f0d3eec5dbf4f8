"""`tandem bench serve`'s arithmetic on hand-made request records, against values worked
out by hand with vLLM's definitions; its arrivals and datasets. The JSON of a real run
through `tandem up` is checked in test_serving.py."""

from __future__ import annotations

import asyncio
import math
import re

import numpy as np
import pytest

from tandem.bench.datasets import (
    multi_turn_requests,
    prefix_repetition_requests,
    random_requests,
)
from tandem.bench.metrics import RequestRecord, compute_metrics, parse_goodput
from tandem.bench.serve import _arrival_times, _data_lines, _send


def records() -> list[RequestRecord]:
    return [
        # 5 tokens: TPOT (0.3 - 0.1) / 4 = 0.05
        RequestRecord(prompt_len=10, success=True, output_tokens=5, ttft=0.1,
                      itl=[0.05] * 4, latency=0.3, start_time=0.0),
        # 1 token: no TPOT (0 for goodput)
        RequestRecord(prompt_len=20, success=True, output_tokens=1, ttft=0.6, latency=0.6,
                      start_time=0.5),
        # 3 tokens, count unknown to the server: len(itl) + 1; TPOT 0.6 / 2 = 0.3
        RequestRecord(prompt_len=30, success=True, output_tokens=0, ttft=0.2,
                      itl=[0.3, 0.3], latency=0.8, start_time=1.0),
        RequestRecord(prompt_len=40, success=False, error="HTTP 503"),
    ]


def test_counts_and_throughputs() -> None:
    m = compute_metrics(records(), duration_s=2.0)
    assert (m["completed"], m["failed"]) == (3, 1)
    assert (m["total_input_tokens"], m["total_output_tokens"]) == (60, 9)
    assert m["output_lens"] == [5, 1, 3, 0]
    assert m["request_throughput"] == pytest.approx(1.5)
    assert m["output_throughput"] == pytest.approx(4.5)
    assert m["total_token_throughput"] == pytest.approx(34.5)
    assert m["request_goodput"] is None and m["slo_attainment"] is None
    # B (0.5-1.1 s) and C (1.0-1.8 s) overlap; A's 5 tokens all land in second 0.
    assert m["max_concurrent_requests"] == 2
    assert m["max_output_tokens_per_s"] == 5


def test_percentiles_mean_median_std() -> None:
    m = compute_metrics(records(), 2.0, percentiles=[50, 90, 99],
                        selected=["ttft", "tpot", "itl", "e2el"])
    # TTFTs 0.1, 0.6, 0.2 s: linear interpolation between order statistics.
    assert m["mean_ttft_ms"] == pytest.approx(300)
    assert m["median_ttft_ms"] == pytest.approx(200) == pytest.approx(m["p50_ttft_ms"])
    assert m["p90_ttft_ms"] == pytest.approx(200 + 0.8 * 400)
    assert m["std_ttft_ms"] == pytest.approx(1000 * math.sqrt((0.04 + 0.09 + 0.01) / 3))
    # TPOT over the requests of more than one token: 0.05 and 0.3.
    assert m["mean_tpot_ms"] == pytest.approx(175) == pytest.approx(m["median_tpot_ms"])
    # ITLs 0.05 x 4, 0.3 x 2.
    assert m["median_itl_ms"] == pytest.approx(50)
    assert m["p99_itl_ms"] == pytest.approx(300)
    assert m["p90_e2el_ms"] == pytest.approx(float(np.percentile([0.3, 0.6, 0.8], 90)) * 1000)
    assert "p99_ttft_ms" in m and "p50_e2el_ms" in m


@pytest.mark.parametrize(("slos", "good"), [
    (["ttft:500", "tpot:100"], 1),  # B's TTFT and C's TPOT are over
    (["ttft:650"], 3),
    (["e2el:700"], 2),  # C's 800 ms is over
    (["tpot:0"], 1),  # only the one-token request (TPOT 0) meets it
])
def test_goodput(slos: list[str], good: int) -> None:
    m = compute_metrics(records(), 2.0, goodput=parse_goodput(slos))
    assert m["request_goodput"] == pytest.approx(good / 2.0)
    assert m["slo_attainment"] == pytest.approx(good / 4)


def test_nothing_completed_reports_zeros() -> None:
    m = compute_metrics([RequestRecord(prompt_len=5, error="refused")], 1.0,
                        goodput={"ttft": 100.0})
    assert m["completed"] == 0 and m["failed"] == 1 and m["request_goodput"] == 0
    assert m["mean_ttft_ms"] == 0 and m["p99_itl_ms"] == 0


@pytest.mark.parametrize("bad", ["ttft", "latency:5", "ttft:fast", "tpot:-1"])
def test_bad_goodput_is_named(bad: str) -> None:
    with pytest.raises(ValueError, match="goodput"):
        parse_goodput([bad])


def test_arrivals_poisson_rescaled_and_all_at_once() -> None:
    t = _arrival_times(100, 4.0, 1.0, np.random.default_rng(0))
    assert t == sorted(t) and t[-1] == pytest.approx(25.0) and t[0] > 0
    assert _arrival_times(3, math.inf, 1.0, np.random.default_rng(0)) == [0.0] * 3
    with pytest.raises(ValueError, match="burstiness"):
        _arrival_times(3, 1.0, 0.0, np.random.default_rng(0))


def test_random_and_prefix_repetition_datasets() -> None:
    reqs = random_requests(50, 100, 20, 0.5, vocab_size=1000, seed=3)
    assert reqs == random_requests(50, 100, 20, 0.5, vocab_size=1000, seed=3)
    assert all(50 <= r.prompt_len == len(r.prompt) <= 150 for r in reqs)
    assert all(10 <= r.expected_output_len <= 30 for r in reqs)
    assert all(100 <= t < 900 for r in reqs for t in r.prompt)
    reqs = prefix_repetition_requests(12, 32, 8, 3, 16, vocab_size=1000, seed=0)
    prefixes = {tuple(r.prompt[:32]) for r in reqs}
    assert len(prefixes) == 3 and len({tuple(r.prompt) for r in reqs}) == 12
    assert all(r.prompt_len == 40 and r.expected_output_len == 16 for r in reqs)


def test_multi_turn_prompts_carry_each_users_history_round_by_round() -> None:
    users, turns, question, reply = 4, 3, 10, 6
    reqs = multi_turn_requests(users, turns, question, reply, vocab_size=1000, seed=0)
    assert len(reqs) == users * turns
    rounds = [reqs[i * users:(i + 1) * users] for i in range(turns)]
    for t, round_ in enumerate(rounds):  # turn t: t earlier questions and replies
        assert all(r.prompt_len == len(r.prompt) == (t + 1) * question + t * reply
                   and r.expected_output_len == reply for r in round_)
    for earlier, later in zip(rounds, rounds[1:]):
        # Each prompt of a round extends exactly one of the round before, by a reply and
        # a question: one conversation per user, none shared.
        starts = [[i for i, e in enumerate(earlier)
                   if r.prompt[:e.prompt_len] == e.prompt] for r in later]
        assert sorted(s for (s,) in starts) == list(range(users))
    assert len({tuple(r.prompt[:question]) for r in rounds[0]}) == users
    with pytest.raises(ValueError, match="at least 1"):
        multi_turn_requests(0, 2, 4, 4, 1000, 0)


def test_sse_payloads_split_across_reads() -> None:
    """The stream is read whole reads at a time: events cut anywhere, several per read,
    CRLF or LF, comments and blank lines between."""
    stream = (b'data: {"a": 1}\n\n: keep-alive\n\ndata:{"b": 2}\r\n\r\n'
              b'data: {"c": "x\\ny"}\n\ndata: [DONE]\n\n')
    for cut in range(1, 12):
        pending, got = b"", []
        for i in range(0, len(stream), cut):
            events, pending = _data_lines(pending + stream[i:i + cut])
            got += events
        assert got == [b'{"a": 1}', b'{"b": 2}', b'{"c": "x\\ny"}', b"[DONE]"]
        assert pending == b""


def test_a_request_on_a_connection_the_server_dropped_is_sent_again() -> None:
    """A real server on loopback that serves one request per connection and drops the
    next one sent on it, as llama-server does with kept-alive connections: every request
    completes, none counts as failed."""
    import aiohttp

    body = (b'data: {"choices": [{"text": "a"}]}\n\n'
            b'data: {"choices": [], "usage": {"completion_tokens": 1}}\n\ndata: [DONE]\n\n')

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        served = 0
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = re.search(rb"content-length: *(\d+)", head, re.IGNORECASE)
                await reader.readexactly(int(length.group(1)) if length else 0)
                if served:
                    break  # the kept-alive connection's next request: dropped
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                             b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
                await writer.drain()
                served += 1
        except asyncio.IncompleteReadError:
            pass
        writer.close()

    async def main() -> list[RequestRecord]:
        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/v1/completions"
        records = [RequestRecord() for _ in range(3)]
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1)) as session:
            for rec in records:
                await _send(session, url, {"prompt": "x"}, False, rec)
        server.close()
        await server.wait_closed()
        return records

    records = asyncio.run(main())
    assert [(r.success, r.error, r.output_tokens) for r in records] == [(True, "", 1)] * 3
