"""`tandem bench serve`: load an OpenAI-compatible server the way vLLM's `vllm bench serve`
does (same main flags, same JSON keys and definitions, see bench/metrics.py), so scripts
written for one read the other.

Requests arrive as a Poisson process (gamma with --burstiness) at --request-rate, at
most --max-concurrency in flight; each streams its completion, and the client times each
chunk. Random and prefix-repetition prompts are token ids, sent with ignore_eos, so each
request makes exactly its output length.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from tandem.bench.datasets import (
    SampleRequest,
    multi_turn_requests,
    prefix_repetition_requests,
    random_requests,
    sharegpt_requests,
)
from tandem.bench.metrics import RequestRecord, compute_metrics, parse_goodput
from tandem.bench.serve_args import add_arguments
from tandem.engine import trace

# Dropped from the saved JSON unless --save-detailed (vLLM's list).
DETAILED = ("input_lens", "output_lens", "start_times", "ttfts", "itls", "generated_texts",
            "errors")


_RESENDS = 3  # a request sent on connections the server had closed, again at most this often

# --- one request -----------------------------------------------------------------------


async def _send(session: Any, url: str, payload: dict[str, Any], chat: bool,
                rec: RequestRecord) -> None:
    """Stream one completion into `rec` (vLLM's timing: a chunk with choices is a token
    arrival, even with empty text; the usage chunk gives the output token count). The
    stream is read as it comes, whole reads at a time, not a line per await: at tens of
    thousands of chunks a second a client reading line by line falls behind the server,
    and its lag would count as the server's. Chunks of one read arrive at one time."""
    import aiohttp

    st = time.perf_counter()
    rec.start_time = st
    last = st
    text: list[str] = []
    pending = b""
    try:
        async with await _post(session, url, payload) as resp:
            if resp.status != 200:
                rec.error = f"HTTP {resp.status}: {(await resp.text())[:500]}"
                return
            async for data in resp.content.iter_any():
                now = time.perf_counter()
                events, pending = _data_lines(pending + data)
                for event in events:
                    if event == b"[DONE]":
                        break
                    chunk = json.loads(event)
                    if "error" in chunk:
                        rec.error = json.dumps(chunk["error"])[:500]
                        return
                    if choices := chunk.get("choices"):
                        if rec.ttft == 0.0:
                            rec.ttft = now - st
                        else:
                            rec.itl.append(now - last)
                        last = now
                        piece = (choices[0].get("delta") or {}).get("content") if chat else (
                            choices[0].get("text"))
                        text.append(piece or "")
                    elif usage := chunk.get("usage"):
                        rec.output_tokens = usage.get("completion_tokens") or 0
        rec.generated_text = "".join(text)
        rec.latency = last - st
        rec.success = rec.ttft > 0.0
        if not rec.success:
            rec.error = "the stream ended before any token"
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
        rec.error = f"{type(exc).__name__}: {exc}"


async def _post(session: Any, url: str, payload: dict[str, Any]) -> Any:
    """The response to `payload`. A kept-alive connection that the server closed while it
    sat in the pool fails before the request reaches the server (llama-server closes
    them): the request goes again, on the pool's next connection (the failed one is
    dropped), at most `_RESENDS` times."""
    import aiohttp

    for _ in range(_RESENDS):
        try:
            return await session.post(url, json=payload)
        except (aiohttp.ClientOSError, aiohttp.ServerDisconnectedError):
            pass
    return await session.post(url, json=payload)


def _data_lines(buffer: bytes) -> tuple[list[bytes], bytes]:
    """The payloads of the complete `data:` lines in `buffer`, and the partial line left."""
    *lines, rest = buffer.split(b"\n")
    lines = [line.strip() for line in lines]
    return [line[5:].strip() for line in lines if line.startswith(b"data:")], rest


def _payload(args: argparse.Namespace, model: str, req: SampleRequest, chat: bool,
             ignore_eos: bool) -> dict[str, Any]:
    body: dict[str, Any] = {"model": model, "max_tokens": req.expected_output_len,
                            "temperature": args.temperature, "stream": True,
                            "stream_options": {"include_usage": True}, "ignore_eos": ignore_eos}
    if chat:
        if not isinstance(req.prompt, str):
            raise ValueError("the chat endpoint takes text prompts: use --dataset-name "
                             "sharegpt, or --endpoint /v1/completions")
        body["messages"] = [{"role": "user", "content": req.prompt}]
    else:
        body["prompt"] = req.prompt
    return body


def _arrival_times(n: int, rate: float, burstiness: float, rng: np.random.Generator
                   ) -> list[float]:
    """Seconds from the start at which each request is sent: gamma gaps of mean 1/rate,
    rescaled so the last arrives at n / rate (as vLLM does, to steady the throughput)."""
    if burstiness <= 0:
        raise ValueError(f"--burstiness must be positive, got {burstiness}")
    if math.isinf(rate):
        return [0.0] * n
    if rate <= 0:
        raise ValueError(f"--request-rate must be positive, got {rate}")
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n)
    times = np.cumsum(gaps)
    return list(times * (n / rate) / times[-1])


async def run_once(args: argparse.Namespace, url: str, model: str,
                   requests: list[SampleRequest], rate: float, ignore_eos: bool
                   ) -> tuple[list[RequestRecord], float]:
    import aiohttp

    chat = _is_chat(args)
    rng = np.random.default_rng(args.seed)
    arrivals = _arrival_times(len(requests), rate, args.burstiness, rng)
    limit = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
    records = [RequestRecord(prompt_len=r.prompt_len) for r in requests]
    bar = tqdm(total=len(requests), disable=args.disable_tqdm, desc=f"rate {rate:g}")
    timeout = aiohttp.ClientTimeout(total=6 * 3600)
    connector = aiohttp.TCPConnector(limit=args.max_concurrency or 0)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        start = time.perf_counter()
        trace.mark("bench", "bench.start")

        async def one(i: int) -> None:
            await asyncio.sleep(max(0.0, start + arrivals[i] - time.perf_counter()))
            payload = _payload(args, model, requests[i], chat, ignore_eos)
            queued = time.perf_counter()
            if limit is None:
                await _send(session, url, payload, chat, records[i])
            else:
                async with limit:
                    records[i].queue_time = time.perf_counter() - queued
                    await _send(session, url, payload, chat, records[i])
            bar.update(1)

        await asyncio.gather(*(one(i) for i in range(len(requests))))
        duration = time.perf_counter() - start
        trace.mark("bench", "bench.end")
    bar.close()
    return records, duration


# --- the run ---------------------------------------------------------------------------


def _is_chat(args: argparse.Namespace) -> bool:
    return args.backend == "openai-chat" or (
        args.backend is None and args.endpoint.rstrip("/").endswith("chat/completions"))


def _base_url(args: argparse.Namespace) -> str:
    return (args.base_url or f"http://{args.host}:{args.port}").rstrip("/")


async def _first_model(base: str) -> str:
    import aiohttp

    async with aiohttp.ClientSession() as session, session.get(f"{base}/v1/models") as r:
        if r.status != 200:
            raise RuntimeError(f"{base}/v1/models answered HTTP {r.status}")
        return (await r.json())["data"][0]["id"]


def _model_source(model: str):  # noqa: ANN202 - a loader.ModelSource, imported lazily
    from tandem.engine.config import NAMED_SHAPES
    from tandem.engine.loader import resolve_model

    if model.lower() in NAMED_SHAPES:
        return resolve_model(model, "dummy")
    return resolve_model(model, "auto")


def _vocab_size(args: argparse.Namespace, model: str) -> int:
    if args.vocab_size:
        return args.vocab_size
    from tandem.engine.loader import load_model_config

    try:
        return load_model_config(_model_source(model)).vocab_size
    except ValueError as exc:
        raise ValueError(f"cannot tell {model!r}'s vocabulary size ({exc}); pass --vocab-size"
                         ) from None


def make_requests(args: argparse.Namespace, model: str) -> tuple[list[SampleRequest], bool]:
    """The workload, and whether it is sent with ignore_eos."""
    name = args.dataset_name.replace("_", "-")
    if name == "random":
        reqs = random_requests(args.num_prompts, args.random_input_len,
                               args.random_output_len, args.random_range_ratio,
                               _vocab_size(args, model), args.seed)
        return reqs, True
    if name == "prefix-repetition":
        reqs = prefix_repetition_requests(
            args.num_prompts, args.prefix_repetition_prefix_len,
            args.prefix_repetition_suffix_len, args.prefix_repetition_num_prefixes,
            args.prefix_repetition_output_len, _vocab_size(args, model), args.seed)
        return reqs, True
    if name == "multi-turn":
        reqs = multi_turn_requests(args.multi_turn_users, args.multi_turn_turns,
                                   args.multi_turn_question_len, args.multi_turn_output_len,
                                   _vocab_size(args, model), args.seed)
        return reqs, True
    if args.dataset_path is None:
        raise ValueError("--dataset-name sharegpt needs --dataset-path")
    from tandem.engine.loader import load_tokenizer

    tokenizer = load_tokenizer(_model_source(model))
    if tokenizer is None:
        raise ValueError(f"{model!r} has no tokenizer to count ShareGPT prompt tokens")
    reqs = sharegpt_requests(args.dataset_path, args.num_prompts,
                             lambda s: len(tokenizer.encode(s)), args.seed,
                             args.sharegpt_output_len)
    return reqs, args.ignore_eos


def summarize(args: argparse.Namespace, model: str, records: list[RequestRecord],
              duration: float, rate: float) -> dict[str, Any]:
    """The result under vLLM's keys (per-request lists dropped unless --save-detailed)."""
    percentiles = [float(p) for p in args.metric_percentiles.split(",")]
    selected = [m.strip() for m in args.percentile_metrics.split(",") if m.strip()]
    metrics = compute_metrics(records, duration, percentiles, parse_goodput(args.goodput),
                              selected)
    backend = args.backend or ("openai-chat" if _is_chat(args) else "openai")
    result: dict[str, Any] = {
        "date": datetime.now().strftime("%Y%m%d-%H%M%S"),
        "endpoint_type": backend, "backend": backend, "label": args.label,
        "model_id": model, "tokenizer_id": model, "num_prompts": len(records),
        "request_rate": rate if not math.isinf(rate) else "inf",
        "burstiness": args.burstiness, "max_concurrency": args.max_concurrency,
        "goodput_slos_ms": parse_goodput(args.goodput) or None,
        **metrics,
        "input_lens": [r.prompt_len for r in records],
        "ttfts": [r.ttft for r in records],
        "itls": [r.itl for r in records],
        "latencies": [r.latency for r in records],
        "start_times": [r.start_time for r in records],
        "queue_times": [r.queue_time for r in records],
        "generated_texts": [r.generated_text for r in records],
        "errors": [r.error for r in records],
        "rtfx": 0.0,
    }
    return result


def print_result(result: dict[str, Any]) -> None:
    rows = [("Successful requests:", result["completed"]),
            ("Failed requests:", result["failed"]),
            ("Benchmark duration (s):", f"{result['duration']:.2f}"),
            ("Total input tokens:", result["total_input_tokens"]),
            ("Total generated tokens:", result["total_output_tokens"]),
            ("Request throughput (req/s):", f"{result['request_throughput']:.2f}")]
    if result["request_goodput"] is not None:
        rows.append(("Request goodput (req/s):", f"{result['request_goodput']:.2f}"))
        rows.append(("SLO attainment (%):", f"{100 * result['slo_attainment']:.1f}"))
    rows += [("Output token throughput (tok/s):", f"{result['output_throughput']:.2f}"),
             ("Peak output token throughput (tok/s):",
              f"{result['max_output_tokens_per_s']:.2f}"),
             ("Total token throughput (tok/s):", f"{result['total_token_throughput']:.2f}")]
    print(f"{' Serving Benchmark Result ':=^50}")
    for name, value in rows:
        print(f"{name:<40} {value:<10}")
    for metric in ("ttft", "tpot", "itl", "e2el"):
        keys = [k for k in result if k.endswith(f"_{metric}_ms")]
        if keys:
            print(f"{' ' + metric.upper() + ' ':-^50}")
            for k in keys:
                print(f"{k.split('_')[0].capitalize() + ' ' + metric.upper() + ' (ms):':<40} "
                      f"{result[k]:<10.2f}")
    print("=" * 50)
    errors = [e for e in result["errors"] if e]
    for e in errors[:5]:
        print(f"error: {e}")


def _file_name(args: argparse.Namespace, model: str, rate: float, date: str) -> Path:
    if args.result_filename:
        return args.result_dir / args.result_filename
    conc = f"-concurrency{args.max_concurrency}" if args.max_concurrency else ""
    rate_s = "inf" if math.isinf(rate) else f"{rate:g}"
    label = args.label or (args.backend or "openai")
    return args.result_dir / f"{label}-{rate_s}qps{conc}-{model.split('/')[-1]}-{date}.json"


def save(args: argparse.Namespace, result: dict[str, Any], path: Path) -> None:
    out = dict(result)
    if not args.save_detailed:
        for key in DETAILED:
            out.pop(key, None)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out))
    print(f"wrote {path}")


def _run(main: Any) -> Any:
    """`main` on uvloop where installed (it is with tandem): at tens of thousands of
    events a second the client's own loop would otherwise be what is measured."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    return uvloop.run(main)


def main(args: argparse.Namespace) -> int:
    base = _base_url(args)
    url = base + args.endpoint
    try:
        parse_goodput(args.goodput)
        model = args.model or asyncio.run(_first_model(base))
        requests, ignore_eos = make_requests(args, model)
        ignore_eos = ignore_eos or args.ignore_eos
        rates = ([float(r) for r in args.sweep_rates.split(",")] if args.sweep_rates
                 else [args.request_rate])
    except (ValueError, RuntimeError, OSError) as exc:
        print(f"tandem bench serve: {exc}")
        return 2
    results = []
    for rate in rates:
        records, duration = _run(run_once(args, url, model, requests, rate, ignore_eos))
        result = summarize(args, model, records, duration, rate)
        print_result(result)
        results.append(result)
        path = _file_name(args, model, rate, result["date"])
        if args.save_result:
            save(args, result, path)
        if args.plot:
            from tandem.bench.plots import plot_cdfs

            plot_cdfs(result, path.with_suffix(".png"))
    if args.sweep_rates and (args.save_result or args.plot):
        path = _file_name(replace_label(args, "sweep"), model, math.inf, results[-1]["date"])
        summary = [{k: v for k, v in r.items() if k not in DETAILED} for r in results]
        if args.save_result:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(summary))
            print(f"wrote {path}")
        if args.plot:
            from tandem.bench.plots import plot_sweep

            plot_sweep({args.label or "tandem": results}, path.with_suffix(".png"))
    return 0 if all(r["completed"] for r in results) else 1


def replace_label(args: argparse.Namespace, suffix: str) -> argparse.Namespace:
    ns = argparse.Namespace(**vars(args))
    ns.label = f"{args.label or args.backend or 'openai'}-{suffix}"
    ns.result_filename = None
    return ns


__all__ = ["add_arguments", "main", "run_once", "summarize"]
