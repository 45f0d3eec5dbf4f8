"""`tandem` command line. Subcommands import their part lazily, so `--help` is instant."""

from __future__ import annotations

import argparse
import sys

DEFAULT_MODEL = "smollm2-135m-instruct"

# `tandem node` and `tandem up` (for its decode or colocated nodes) take the same flag.
STREAM_INTERVAL_HELP = (
    "while the engine steps, send the Outputs streams at most once per this many "
    "milliseconds: a request's tokens of the steps between go as one chunk, so the router "
    "and the client pay per chunk, not per token, where steps are short (a small model); "
    "a first token goes at once (default: 0, every step)")
STREAM_CHUNK_RATE = 10_000  # node/outbox.CHUNK_RATE, not imported: --help stays instant
STREAM_CHUNK_RATE_HELP = (
    "while the engine steps, send each router at most this many chunks a second: N "
    "requests running get a chunk each at most every N/RATE seconds (128 streams at the "
    "default: every 12.8 ms), so under load a request's tokens go a few to a chunk and "
    "the router keeps up; with few streams every step still goes at once (0: no cap; "
    "default: %(default)s)")


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--model", default=DEFAULT_MODEL,
                   help="model name (e.g. smollm2-135m-instruct), a .gguf file, a Hugging Face "
                        "directory (config.json + safetensors), or with --load-format dummy a "
                        "shape name (llama-3-8b, smollm2-135m, tiny) (default: %(default)s)")
    g.add_argument("--load-format", default="auto", choices=["auto", "gguf", "hf", "dummy"],
                   help="how to read --model; dummy gives random weights (default: %(default)s)")
    g.add_argument("--dtype", default="float32",
                   choices=["float32", "bfloat16", "float16"],
                   help="weight and KV cache dtype (default: %(default)s)")
    g.add_argument("--quantization", default=None, choices=["fp8"],
                   help="fp8: quantize the decoder layers' linear layers to FP8 at load (one "
                        "scale per output row; Hopper GPUs: decode streams half the bytes, "
                        "prefill runs on FP8 tensor cores; on the CPU it is correct but slow). "
                        "A checkpoint stored in FP8 loads as FP8 without it (default: the "
                        "checkpoint's dtype)")
    g.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8"],
                   help="auto: the KV cache in --dtype; fp8: in FP8 (e4m3, a scale per layer), "
                        "twice the blocks of bf16 in the same memory (default: %(default)s)")
    g.add_argument("--cpu-weights", default="fp32",
                   choices=["auto", "fp32", "fp16", "bf16", "gguf"],
                   help="on the CPU, an fp32 model's decoder linear layers: fp32 (token-exact "
                        "against transformers), fp16 (those and the logits packed once for "
                        "fbgemm: half the bytes a decode step reads, activations kept fp32; "
                        "x86 with AVX2), bf16 (packed once for oneDNN, activations rounded to "
                        "bf16), gguf (a GGUF checkpoint's own Q4_1/Q8_0 blocks, those and the "
                        "logits, at a decode step's rows, activations kept fp32: Q4_1 is a "
                        "sixth of fp32's bytes; x86 with AVX2 and a C++ compiler, which builds "
                        "the kernel once), auto (gguf where it runs, else fp16 where it runs, "
                        "else bf16 where the CPU has AVX512-BF16 or AMX, else fp32) "
                        "(default: %(default)s)")
    g.add_argument("--device", default="cpu", help="cpu or cuda[:N] (default: %(default)s)")
    g.add_argument("--block-size", type=int, default=16,
                   help="tokens per KV block (default: %(default)s)")
    g.add_argument("--num-kv-blocks", type=int, default=None,
                   help="KV cache size in blocks (default: sized from memory)")
    g.add_argument("--kv-host-gib", type=float, default=0.0, metavar="GIB",
                   help="host memory (GiB) for KV blocks evicted from the device cache: a "
                        "prompt that meets them again copies them back instead of computing "
                        "them (pinned on CUDA; 0: no host tier) (default: %(default)s)")
    g.add_argument("--gpu-memory-fraction", type=float, default=0.85,
                   help="on CUDA, the share of the GPU's memory the engine may hold: weights, "
                        "KV cache and activations; the KV cache takes what the weights leave "
                        "of it (default: %(default)s)")
    g.add_argument("--attention-backend", default=None, choices=["torch", "triton"],
                   help="torch: the reference, any device; triton: paged Triton kernels on "
                        "CUDA (default: triton on CUDA, torch on the CPU)")
    g.add_argument("--enforce-eager", action="store_true",
                   help="on CUDA, run every step eagerly instead of replaying CUDA graphs for "
                        "decode-only steps (slower; saves start-up time and graph memory)")
    g.add_argument("--mixed-cuda-graphs", action=argparse.BooleanOptionalAction, default=True,
                   help="on CUDA, also replay CUDA graphs for steps that admit prompts beside "
                        "running decodes (one per token bucket, each for every sequence a "
                        "step may hold): a burst's admission steps are replays, not launches; "
                        "SmolLM2's shape on an H200: +0.6 s of start-up, +0.6 GiB "
                        "(default: on)")
    g.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                   help="launch each step before reading the previous step's tokens, so the "
                        "host prepares the next step while the GPU computes (default: on for "
                        "CUDA, off on the CPU)")
    g.add_argument("--skip-tokenizer-init", action="store_true",
                   help="load no tokenizer: prompts are token ids and outputs carry token ids "
                        "with empty text (needed for dummy weights, which have none)")
    g.add_argument("--max-num-seqs", type=int, default=64,
                   help="most requests running at once (default: %(default)s)")
    g.add_argument("--max-num-batched-tokens", type=int, default=2048,
                   help="token budget per step; longer prompts are prefilled in chunks "
                        "(default: %(default)s)")
    g.add_argument("--max-model-len", type=int, default=8192,
                   help="context length cap, prompt plus output (default: %(default)s)")
    g.add_argument("--no-prefix-caching", action="store_true",
                   help="do not reuse KV blocks across requests with shared prefixes")
    g.add_argument("--seed", type=int, default=0,
                   help="seed for dummy weights and unseeded sampling (default: %(default)s)")


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=128,
                   help="most tokens to generate (default: %(default)s)")
    g.add_argument("--temperature", type=float, default=0.0,
                   help="0 is greedy (default: %(default)s)")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass, in (0, 1]")
    g.add_argument("--top-k", type=int, default=None, help="keep the k most likely tokens")
    g.add_argument("--min-p", type=float, default=0.0,
                   help="drop tokens below min-p times the top probability")
    g.add_argument("--repetition-penalty", type=float, default=1.0,
                   help="> 1 discourages tokens already in prompt or output")
    g.add_argument("--presence-penalty", type=float, default=0.0, help="in [-2, 2]")
    g.add_argument("--frequency-penalty", type=float, default=0.0, help="in [-2, 2]")
    g.add_argument("--stop", action="append", default=None,
                   help="stop string; repeat for several")
    g.add_argument("--sampling-seed", type=int, default=None,
                   help="per-request seed for reproducible sampling")
    g.add_argument("--ignore-eos", action="store_true", help="keep generating past EOS")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tandem", description="Tandem: prefill/decode disaggregated LLM serving."
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    gen = sub.add_parser(
        "generate", help="generate text for one or more prompts offline",
        description="Load a model and generate text for each --prompt, streaming to stdout.",
    )
    gen.add_argument("--prompt", action="append", default=None,
                     help="prompt text; repeat for several (default: a sample question)")
    gen.add_argument("--raw", action="store_true",
                     help="send the prompt as is instead of through the model's chat template")
    _add_engine_args(gen)
    _add_sampling_args(gen)
    gen.set_defaults(func=_generate)

    node = sub.add_parser(
        "node", help="run one prefill or decode node (a gRPC server over one engine)",
        description="Serve the node service (protos/node.proto) over one engine, in the "
                    "prefill or the decode role, until interrupted.",
    )
    node.add_argument("--role", required=True, choices=["prefill", "decode"],
                      help="prefill: compute prompts and push their KV to decode nodes; "
                           "decode: receive KV and generate (and prefill short prompts)")
    node.add_argument("--host", default="127.0.0.1",
                      help="address the gRPC server listens on (default: %(default)s)")
    node.add_argument("--port", type=int, default=0,
                      help="gRPC port; 0 picks a free one, printed at start (default: 0)")
    node.add_argument("--connector", default="tcp", choices=["tcp", "ucx", "nccl", "ipc"],
                      help="how KV moves between nodes (default: %(default)s)")
    node.add_argument("--transfer-host", default="127.0.0.1",
                      help="address the KV transfer agent listens on, as prefill nodes "
                           "reach it (default: %(default)s)")
    node.add_argument("--transfer-port", type=int, default=0,
                      help="port of the KV transfer agent, fixed for a Service or a "
                           "firewall (the nccl connector's store takes the next one too); "
                           "0 picks a free one (default: 0)")
    node.add_argument("--advertise-host", default=None,
                      help="the host routers and other nodes reach this node at (its gRPC "
                           "and transfer ports), when it differs from --host and "
                           "--transfer-host (a pod IP behind 0.0.0.0, say); printed in the "
                           "ready line (default: --host, and --transfer-host for transfers)")
    node.add_argument("--drain-timeout", type=float, default=30.0, metavar="SECONDS",
                      help="on SIGTERM, take no new requests and let running ones finish "
                           "for up to this long before stopping (give a pod's "
                           "terminationGracePeriodSeconds more); 0 stops at once "
                           "(default: 30)")
    node.add_argument("--max-requests", type=int, default=8192, metavar="N",
                      help="Generate (decode) or Prefill calls held at once, waiting for "
                           "KV blocks or running; more are refused with RESOURCE_EXHAUSTED "
                           "and wait in the router's queue (default: %(default)s)")
    node.add_argument("--stream-interval-ms", type=float, default=0.0, metavar="MS",
                      help=STREAM_INTERVAL_HELP)
    node.add_argument("--stream-chunk-rate", type=float, default=STREAM_CHUNK_RATE,
                      metavar="RATE", help=STREAM_CHUNK_RATE_HELP)
    node.add_argument("--index", default=None, metavar="URL",
                      help="a shared block-hash index (redis://host:port/db) this node "
                           "publishes its KV blocks to; without it, routers follow the "
                           "node's block events themselves (default: none)")
    _add_cluster_secret_args(node)
    _add_engine_args(node)
    node.set_defaults(func=_node)

    router = sub.add_parser(
        "router", help="run the OpenAI-compatible router over running nodes",
        description="Serve the OpenAI API (/v1/completions, /v1/chat/completions, "
                    "/v1/models, /health, /metrics) and send each request through the "
                    "given prefill and decode nodes.",
    )
    router.add_argument("--prefill", action="append", metavar="HOST:PORT",
                        help="a prefill node's gRPC address; repeat for several")
    router.add_argument("--decode", action="append", metavar="HOST:PORT",
                        help="a decode node's gRPC address; repeat for several")
    router.add_argument("--node", action="append", metavar="HOST:PORT",
                        help="a node whose role is read from the node itself; repeat for "
                             "several (one decode node at least, given by any of the three "
                             "flags; more can be added later with `tandem ctl nodes add`)")
    router.add_argument("--reuse-port", action="store_true",
                        help="bind --port with SO_REUSEPORT, so that several routers serve "
                             "one port, the kernel spreading the connections among them "
                             "(`tandem up --routers`)")
    _add_router_args(router)
    g = router.add_argument_group("model (for the tokenizer and the chat template)")
    g.add_argument("--model", default=DEFAULT_MODEL,
                   help="the model the nodes serve, as `tandem node --model` names it "
                        "(default: %(default)s)")
    g.add_argument("--load-format", default="auto", choices=["auto", "gguf", "hf", "dummy"],
                   help="how to read --model (default: %(default)s)")
    g.add_argument("--max-model-len", type=int, default=8192,
                   help="context length, for chat's default max_tokens (default: %(default)s)")
    g.add_argument("--skip-tokenizer-init", action="store_true",
                   help="serve token ids only (prompts as token ids; no chat endpoint, no "
                        "stop strings; outputs carry token_ids and empty text)")
    router.set_defaults(func=_router)

    up = sub.add_parser(
        "up", help="start a router and its prefill and decode nodes on this machine",
        description="Start the nodes (child processes) and the router, wait until they are "
                    "healthy, print the URL, and stop all of them on Ctrl-C. Nodes that "
                    "share a CUDA device split --gpu-memory-fraction between them.",
    )
    up.add_argument("--prefill-share", type=float, default=0.3, metavar="FRACTION",
                    help="on a CUDA device that holds prefill and decode nodes, the part "
                         "of --gpu-memory-fraction the prefill nodes take (weights and a "
                         "KV cache for the prompts being computed); the decode nodes take "
                         "the rest, for every running request's context "
                         "(default: %(default)s)")
    up.add_argument("--mps", default="off", choices=["auto", "on", "off"],
                    help="run the nodes that share a CUDA device under an MPS daemon of this "
                         "launch's own, so their kernels run side by side rather than "
                         "time-sliced (an H200, 1P1D on one card: +9%% output tok/s): auto "
                         "where nvidia-cuda-mps-control is on PATH (without it if it will "
                         "not start), on insists, off never (default: %(default)s)")
    up.add_argument("--routers", type=int, default=1, metavar="N",
                    help="router processes on --port (SO_REUSEPORT: the kernel spreads the "
                         "connections among them), each with the nodes' streams of its own, "
                         "as router replicas behind a Service; one process writes every "
                         "token of its streams, so many streams at short steps want more. "
                         "The planner runs in the first alone, and /metrics is the "
                         "answering router's (default: %(default)s)")
    up.add_argument("--connector", default="tcp", choices=["tcp", "ucx", "nccl", "ipc"],
                    help="how KV moves from the prefill to the decode node "
                         "(default: %(default)s)")
    g = up.add_argument_group("nodes")
    g.add_argument("--prefill", type=int, default=1, metavar="N",
                   help="prefill nodes (default: %(default)s)")
    g.add_argument("--decode", type=int, default=1, metavar="M",
                   help="decode nodes (default: %(default)s)")
    g.add_argument("--colocated", type=int, default=None, metavar="N",
                   help="instead: N nodes that each prefill and decode their own requests "
                        "(no prefill pool), to compare against disaggregation")
    g.add_argument("--prefill-devices", default=None, metavar="DEV[,DEV...]",
                   help="device of each prefill node, or one for all (default: --device)")
    g.add_argument("--decode-devices", default=None, metavar="DEV[,DEV...]",
                   help="device of each decode (or colocated) node, or one for all "
                        "(default: --device)")
    g.add_argument("--stream-interval-ms", type=float, default=0.0, metavar="MS",
                   help=STREAM_INTERVAL_HELP)
    g.add_argument("--stream-chunk-rate", type=float, default=STREAM_CHUNK_RATE,
                   metavar="RATE", help=STREAM_CHUNK_RATE_HELP)
    g.add_argument("--decode-max-num-batched-tokens", type=int, default=None, metavar="N",
                   help="the decode (or colocated) nodes' token budget per step: smaller "
                        "than the prefill nodes', the prompts a decode node computes "
                        "itself (--prefill-overflow-ms, a failed transfer) go in smaller "
                        "chunks beside its running decodes, whose steps stay short "
                        "(default: --max-num-batched-tokens)")
    _add_router_args(up)
    _add_engine_args(up)
    up.set_defaults(func=_up)

    bench = sub.add_parser("bench", help="benchmark a running server",
                           description="Benchmarks against a running server.")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True, metavar="BENCHMARK")
    serve = bench_sub.add_parser(
        "serve", help="load an OpenAI-compatible server, vLLM bench serve style",
        description="Send a workload (random, sharegpt or prefix-repetition prompts) to a "
                    "running server at a request rate and concurrency, time every streamed "
                    "token, and report TTFT, TPOT, ITL, E2EL, throughput and goodput under "
                    "vLLM's `vllm bench serve` names and definitions.",
    )
    from tandem.bench.serve_args import add_arguments

    add_arguments(serve)
    serve.set_defaults(func=_bench_serve)
    from tandem.ctl.main import add_parser as add_ctl

    add_ctl(sub)
    return parser


def _add_router_args(p: argparse.ArgumentParser) -> None:
    from tandem.router.limits import Limits

    g = p.add_argument_group("router")
    g.add_argument("--host", default="127.0.0.1",
                   help="address the HTTP API listens on (default: %(default)s)")
    g.add_argument("--port", type=int, default=8000,
                   help="HTTP port of the API (default: %(default)s)")
    g.add_argument("--served-model-name", default=None,
                   help="the model id clients send (default: the --model value)")
    g.add_argument("--http-loop", default="auto", choices=["auto", "asyncio", "uvloop"],
                   help="the router's event loop: uvloop (installed with tandem), asyncio, or "
                        "auto: uvloop where installed (default: %(default)s)")
    g.add_argument("--http-parser", default="auto", choices=["auto", "h11", "httptools"],
                   help="the router's HTTP/1.1 parser: httptools (installed with tandem), "
                        "h11, or auto: httptools where installed (default: %(default)s)")
    g.add_argument("--generation-config", default="auto", choices=["auto", "none"],
                   help="auto: sampling fields a request leaves unset (temperature, top_p, "
                        "top_k, min_p, repetition_penalty) come from the model directory's "
                        "generation_config.json, as vLLM does; none: Tandem's own defaults "
                        "(default: %(default)s)")
    g.add_argument("--local-prefill-threshold", type=int, default=0,
                   help="a prompt whose tokens missing from the decode node's cache are "
                        "fewer than this is prefilled on the decode node, skipping the "
                        "prefill pool (default: %(default)s, always use the prefill pool)")
    g.add_argument("--prefill-overflow-ms", type=float, default=0.0, metavar="MS",
                   help="a prompt that would be computed later than this on the prefill "
                        "node (after the prompts this router sent it before, at the rate "
                        "it computes them) is computed by its decode node instead, "
                        "where it would start sooner: the decode GPU takes the prefill "
                        "pool's overflow, at some cost to its decodes' pace (default: "
                        "%(default)s, never)")
    g.add_argument("--early-prefill", action=argparse.BooleanOptionalAction, default=True,
                   help="have the prefill node start computing a prompt as the request "
                        "comes, while the decode node reserves its blocks, rather than when "
                        "the decode node calls it: the first token comes a hop and a "
                        "reservation sooner (default: on)")
    g.add_argument("--prefix-pull", default="auto", choices=["auto", "always", "never"],
                   help="a prefill node that holds less of a prompt's prefix than another "
                        "node's device cache pulls those blocks from there before computing "
                        "the rest: auto, where its measured pull rate beats its measured "
                        "prefill rate (and until both are measured); always; never "
                        "(default: %(default)s)")
    g.add_argument("--index", default="memory", metavar="memory|URL",
                   help="block-hash index for prefix-aware routing: memory (held by the "
                        "router, fed by the nodes' block events) or redis://host:port/db "
                        "(shared; tandem up passes it to its nodes, which publish to it) "
                        "(default: %(default)s)")
    g.add_argument("--on-transfer-failure", default="recompute",
                   choices=["recompute", "fail"],
                   help="when a prefill node or its KV transfer fails: compute the prompt on "
                        "the decode node, or fail the request (default: %(default)s)")
    g = p.add_argument_group("planner (moves nodes between the pools; see the README's "
                             "operator page; change it at run time with `tandem ctl planner`)")
    g.add_argument("--planner", default="off", choices=["off", "slo", "load"],
                   help="slo: switch a node's role when the prefill pool misses the TTFT "
                        "target while decode has headroom, or the reverse for ITL; load: the "
                        "same from queues and KV usage; off (default)")
    g.add_argument("--planner-advisory", action="store_true",
                   help="log and list the planner's decisions but switch nothing")
    g.add_argument("--ttft-target-ms", type=float, default=500.0,
                   help="the planner's TTFT target, p90 over its window "
                        "(default: %(default)s)")
    g.add_argument("--itl-target-ms", type=float, default=50.0,
                   help="the planner's ITL target, p90 over its window (default: %(default)s)")
    g = p.add_argument_group("limits (each answered with the OpenAI error JSON)")
    g.add_argument("--max-body-bytes", type=int, default=Limits.max_body_bytes,
                   help="a larger request body gets 413 (default: %(default)s)")
    g.add_argument("--max-stop-strings", type=int, default=Limits.max_stop_strings,
                   help="more stop strings than this get 400 (default: %(default)s)")
    g.add_argument("--max-stop-length", type=int, default=Limits.max_stop_chars,
                   help="a longer stop string (characters) gets 400 (default: %(default)s)")
    g.add_argument("--default-chat-max-tokens", type=int,
                   default=Limits.default_chat_max_tokens,
                   help="tokens a chat request without max_tokens may generate, or fewer if "
                        "the context has less room (default: %(default)s)")
    g.add_argument("--max-queued-requests", type=int, default=Limits.max_queued_requests,
                   help="requests that wait in the router's queue while every decode node "
                        "is at its limit (--max-requests); more get 429 with Retry-After "
                        "(default: %(default)s)")
    g.add_argument("--queue-timeout", type=float, default=Limits.queue_timeout_s,
                   metavar="SECONDS",
                   help="a request still queued after this long gets 503 with code "
                        "queue_timeout (default: %(default)s)")
    g.add_argument("--max-concurrent-requests", type=int,
                   default=Limits.max_concurrent_requests,
                   help="completion requests in flight at once, queued or streaming; more "
                        "get 429 with Retry-After; 0: no limit but the queue's "
                        "(default: %(default)s)")
    g = p.add_argument_group("authentication (prefer the environment variables or files: "
                             "flags show in the process list)")
    g.add_argument("--api-key", default=None,
                   help="clients must send Authorization: Bearer KEY on every route but "
                        "/health (and /metrics, see --protect-metrics); else TANDEM_API_KEY; "
                        "unset: the API is open (default)")
    g.add_argument("--api-key-file", default=None, metavar="PATH",
                   help="read the API key from this file")
    g.add_argument("--admin-token", default=None,
                   help="the bearer token of the /admin/v1 routes (never the API key); else "
                        "TANDEM_ADMIN_TOKEN; unset: the admin API is closed (default)")
    g.add_argument("--admin-token-file", default=None, metavar="PATH",
                   help="read the admin token from this file")
    g.add_argument("--protect-metrics", action="store_true",
                   help="/metrics needs the API key too (default: open, for scrapers)")
    _add_cluster_secret_args(p)


def _add_cluster_secret_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("cluster secret")
    g.add_argument("--cluster-secret", default=None,
                   help="nodes obey only gRPC calls and KV transfers that prove this secret; "
                        "the router and every node of a cluster need the same one; else "
                        "TANDEM_CLUSTER_SECRET; unset: nodes obey anyone who reaches their "
                        "ports (default)")
    g.add_argument("--cluster-secret-file", default=None, metavar="PATH",
                   help="read the cluster secret from this file")


def _router(args: argparse.Namespace) -> int:
    from tandem.router.main import run_router

    return run_router(args)


def _up(args: argparse.Namespace) -> int:
    from tandem.router.main import run_up

    return run_up(args)


def _node(args: argparse.Namespace) -> int:
    from tandem.node.main import run_node

    return run_node(args)


def _bench_serve(args: argparse.Namespace) -> int:
    from tandem.bench.serve import main as bench_serve

    return bench_serve(args)


def _generate(args: argparse.Namespace) -> int:
    from tandem.engine.cli_generate import run_generate

    return run_generate(args)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ValueError as e:
        print(f"tandem: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
