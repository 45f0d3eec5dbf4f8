"""`tandem router` (the OpenAI API over running nodes) and `tandem up` (a router and its
nodes on this machine, disaggregated or colocated, stopped together on Ctrl-C)."""

from __future__ import annotations

import argparse
import logging
import os
import queue
import re
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

import uvicorn

from tandem.engine.loader import (
    load_generation_defaults,
    load_model_config,
    load_tokenizer,
    resolve_model,
)
from tandem.node.auth import CLUSTER_SECRET_ENV, read_secret
from tandem.node.gc_freeze import freeze_startup
from tandem.router.app import RouterSettings, create_app
from tandem.router.flow import FlowConfig
from tandem.router.guard import Credentials
from tandem.router.limits import Limits
from tandem.router.mps import share_gpu
from tandem.router.planner import PlannerSettings

log = logging.getLogger("tandem.router")

NODE_START_TIMEOUT_S = 600  # loading (and on first use converting) the weights
ROUTER_BACKLOG = 2048  # connections waiting for their accept (uvicorn's default)
_READY = re.compile(r"tandem node ready: .* grpc=(\S+)")
_ROUTER_READY = re.compile(r"tandem router ready: pid (\d+)")


def flow_config(args: argparse.Namespace) -> FlowConfig:
    if args.local_prefill_threshold < 0:
        raise ValueError("--local-prefill-threshold must be 0 or more")
    if args.prefill_overflow_ms < 0:
        raise ValueError("--prefill-overflow-ms must be 0 or more")
    if args.max_queued_requests < 0 or args.queue_timeout <= 0:
        raise ValueError("--max-queued-requests must be 0 or more, --queue-timeout above 0")
    return FlowConfig(local_prefill_threshold=args.local_prefill_threshold,
                      overflow_wait_s=args.prefill_overflow_ms / 1e3,
                      on_transfer_failure=args.on_transfer_failure,
                      early_prefill=args.early_prefill, prefix_pull=args.prefix_pull,
                      max_queued_requests=args.max_queued_requests,
                      queue_timeout_s=args.queue_timeout)


def router_settings(args: argparse.Namespace, prefill: Sequence[str],
                    decode: Sequence[str], nodes: Sequence[str] = ()) -> RouterSettings:
    if not decode and not nodes:
        raise ValueError("at least one --decode node (or --node) is needed")
    src = resolve_model(args.model, args.load_format)
    tokenizer = None if args.skip_tokenizer_init else load_tokenizer(src)
    if tokenizer is None and not args.skip_tokenizer_init:
        raise ValueError(f"model {args.model!r} has no tokenizer; start with "
                         f"--skip-tokenizer-init to serve token ids")
    limits = Limits(max_body_bytes=args.max_body_bytes, max_stop_strings=args.max_stop_strings,
                    max_stop_chars=args.max_stop_length,
                    default_chat_max_tokens=args.default_chat_max_tokens,
                    max_concurrent_requests=args.max_concurrent_requests)
    credentials = Credentials(
        api_key=read_secret(args.api_key, args.api_key_file, "TANDEM_API_KEY"),
        admin_token=read_secret(args.admin_token, args.admin_token_file, "TANDEM_ADMIN_TOKEN"),
        protect_metrics=args.protect_metrics)
    defaults = load_generation_defaults(src) if args.generation_config == "auto" else {}
    if defaults:
        log.info("sampling fields a request leaves unset come from the model's "
                 "generation_config.json: %s (--generation-config none: Tandem's defaults)",
                 defaults)
    return RouterSettings(args.served_model_name or args.model, tokenizer, list(prefill),
                          list(decode), flow_config(args), args.max_model_len, args.index,
                          load_model_config(src).vocab_size, limits, credentials,
                          cluster_secret(args), list(nodes), planner_settings(args),
                          defaults)


def planner_settings(args: argparse.Namespace) -> PlannerSettings:
    return PlannerSettings().updated({
        "mode": args.planner, "advisory": args.planner_advisory,
        "ttft_target_ms": args.ttft_target_ms, "itl_target_ms": args.itl_target_ms})


def cluster_secret(args: argparse.Namespace) -> bytes | None:
    secret = read_secret(args.cluster_secret, args.cluster_secret_file, CLUSTER_SECRET_ENV)
    return None if secret is None else secret.encode()


def run_router(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    app = create_app(router_settings(args, args.prefill or [], args.decode or [],
                                     args.node or []))
    sockets = [listen(args.host, args.port)] if args.reuse_port else None
    server = _server(app, args)
    freeze_startup()
    threading.Thread(target=_say_ready, args=(server,), daemon=True).start()
    server.run(sockets=sockets)
    return 0


def _say_ready(server: uvicorn.Server) -> None:
    """The line `tandem up` waits for from a router it started, once it serves."""
    while not server.started:
        time.sleep(0.05)
    print(f"tandem router ready: pid {os.getpid()}", flush=True)


def _server(app: object, args: argparse.Namespace) -> uvicorn.Server:
    # No access log: below the warning level it is never shown, yet uvicorn would still
    # make each request's line.
    return uvicorn.Server(uvicorn.Config(
        app, host=args.host, port=args.port, log_level="warning", loop=args.http_loop,
        http=args.http_parser, access_log=False))


def listen(host: str, port: int) -> socket.socket:
    """A listening TCP socket on `host`:`port` that other processes may bind too
    (SO_REUSEPORT): the kernel spreads the connections over every router bound there."""
    family, kind, proto, _, address = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind(address)
    sock.listen(ROUTER_BACKLOG)
    return sock


# The flags of `tandem up` that `tandem router` takes too, by their dest, except these:
# the pools (given as addresses), the port (the first router's), the planner (the first
# router's alone) and the secrets (by the environment: argv is public).
_NOT_PASSED = {"help", "func", "prefill", "decode", "node", "port", "reuse_port", "planner",
               "api_key", "api_key_file", "admin_token", "admin_token_file",
               "cluster_secret", "cluster_secret_file"}


def router_argv(args: argparse.Namespace, addresses: dict[str, list[str]], port: int
                ) -> list[str]:
    """`tandem router` flags for another router of this `tandem up`: the same settings,
    the nodes it started, the first router's port."""
    from tandem.cli import build_parser

    router = build_parser()._subparsers._group_actions[0].choices["router"]  # noqa: SLF001
    argv = ["--port", str(port), "--reuse-port", "--planner", "off"]
    for role in ("prefill", "decode"):
        for address in addresses[role]:
            argv += [f"--{role}", address]
    for action in router._actions:  # noqa: SLF001
        if not action.option_strings or action.dest in _NOT_PASSED:
            continue
        value, flag = getattr(args, action.dest), action.option_strings[0]
        if isinstance(action, argparse.BooleanOptionalAction):
            argv.append(flag if value else f"--no-{flag[2:]}")
        elif action.nargs == 0:  # store_true
            argv += [flag] if value else []
        elif value is not None:
            argv += [flag, str(value)]
    return argv


def _secrets_env(args: argparse.Namespace, env: dict[str, str]) -> dict[str, str]:
    """`env` with the router's API key and admin token, for another router to read."""
    env = dict(env)
    for flag, file, name in ((args.api_key, args.api_key_file, "TANDEM_API_KEY"),
                             (args.admin_token, args.admin_token_file, "TANDEM_ADMIN_TOKEN")):
        value = read_secret(flag, file, name)
        if value is not None:
            env[name] = value
    return env


@dataclass(frozen=True)
class NodePlan:
    role: str  # "prefill" or "decode"
    device: str
    memory_fraction: float  # of its device, shared with the nodes placed beside it


def plan_nodes(args: argparse.Namespace) -> list[NodePlan]:
    """Which nodes `tandem up` starts, where: --prefill N --decode M (or --colocated N
    decode nodes that prefill their own prompts), each role's devices from its
    --*-devices list (one per node, or one for all). Nodes on one CUDA device split
    --gpu-memory-fraction (`_shares`). Raises ValueError for inconsistent flags."""
    if args.decode_max_num_batched_tokens is not None and args.decode_max_num_batched_tokens < 1:
        raise ValueError("--decode-max-num-batched-tokens must be 1 or more")
    if args.colocated is not None:
        if args.colocated < 1:
            raise ValueError("--colocated needs at least 1 node")
        if args.prefill_devices:
            raise ValueError("--colocated has no prefill nodes: drop --prefill-devices")
        counts = {"prefill": 0, "decode": args.colocated}
    else:
        if args.prefill < 0 or args.decode < 1:
            raise ValueError("--decode needs at least 1 node and --prefill 0 or more")
        counts = {"prefill": args.prefill, "decode": args.decode}
    devices: dict[str, list[str]] = {}
    for role, n in counts.items():
        given = getattr(args, f"{role}_devices")
        names = [d.strip() for d in given.split(",") if d.strip()] if given else [args.device]
        if len(names) not in (1, n) and n:
            raise ValueError(f"--{role}-devices names {len(names)} devices for {n} "
                             f"{role} nodes: give one per node, or one for all")
        devices[role] = names * n if len(names) == 1 else names
    if not 0 < args.prefill_share < 1:
        raise ValueError("--prefill-share must be in (0, 1)")
    roles = [(role, devices[role][i]) for role, n in counts.items() for i in range(n)]
    return [NodePlan(role, d, args.gpu_memory_fraction * share)
            for (role, d), share in zip(roles, _shares(roles, args.prefill_share))]


def _shares(roles: list[tuple[str, str]], prefill_share: float) -> list[float]:
    """Each node's share of its CUDA device's --gpu-memory-fraction. On a device with
    both roles, the prefill nodes split `prefill_share` of it and the decode nodes the
    rest: a prefill node's KV only holds the prompts it computes now, a decode node's
    every running request's whole context. Nodes of one role split a device evenly; a
    CPU node's share is 1."""
    shares = []
    for role, device in roles:
        if "cuda" not in device:
            shares.append(1.0)
            continue
        here = [r for r, d in roles if d == device]
        same = here.count(role)
        if len(set(here)) == 1:
            shares.append(1.0 / same)
        else:
            part = prefill_share if role == "prefill" else 1.0 - prefill_share
            shares.append(part / same)
    return shares


# How long (libgomp's spins, ~10 ns each) a CPU node's idle OpenMP workers wait for the
# next op before they sleep, where nodes share the machine's cores. libgomp's default
# (300,000) starves the other node's compute: a burst of 64 through 1P1D on 2 cores
# took 50 s, against 8-9 s. Sleeping at once (OMP_WAIT_POLICY=PASSIVE) makes each op
# of a lone stream wait for a wake-up: 1P1D fp16 on 2 cores, 1 / 8 streams 18.6-20.7 /
# 92-103 tok/s, against 28.7-29.5 / 123 at 10,000 (results/omp_spin_cpu-2core.json).
SHARED_CPU_SPIN = 10_000


def share_cpu(env: dict[str, str]) -> None:
    """`env` for nodes that share the CPU's cores, unless it says how OpenMP waits."""
    if "OMP_WAIT_POLICY" not in env and "GOMP_SPINCOUNT" not in env:
        env["GOMP_SPINCOUNT"] = str(SHARED_CPU_SPIN)


def run_up(args: argparse.Namespace) -> int:
    """Start the planned nodes as child processes, then the router here; Ctrl-C (or
    SIGTERM) stops them all."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    flow_config(args)  # bad flags fail before anything starts
    if args.routers < 1:
        raise ValueError("--routers must be 1 or more")
    plan = plan_nodes(args)
    env = dict(os.environ)
    # Without one given, a secret of this launch's own: its nodes obey only this router
    # (and each other), whoever else can reach their ports. To the nodes by their
    # environment: argv is public.
    secret = cluster_secret(args) or secrets.token_hex(32).encode()
    env[CLUSTER_SECRET_ENV] = secret.decode()
    args.cluster_secret, args.cluster_secret_file = secret.decode(), None  # the router's
    if sum(n.device == "cpu" for n in plan) > 1:
        share_cpu(env)
    try:
        mps = share_gpu([n.device for n in plan], env, args.mps)
    except RuntimeError as exc:
        print(f"tandem: error: {exc}", file=sys.stderr, flush=True)
        return 1
    children: list[subprocess.Popen] = []
    signal.signal(signal.SIGTERM, _interrupt)  # until uvicorn takes it over
    try:
        for node in plan:
            flags = _engine_flags(args, node)
            child = subprocess.Popen(
                [sys.executable, "-m", "tandem.cli", "node", "--role", node.role,
                 "--port", "0", "--connector", args.connector, *flags,
                 *(["--index", args.index] if args.index != "memory" else [])],
                stdout=subprocess.PIPE, stderr=None, text=True, start_new_session=True,
                env=env)
            children.append(child)
        addresses: dict[str, list[str]] = {"prefill": [], "decode": []}
        watched: list[tuple[str, subprocess.Popen]] = []
        for node, child in zip(plan, children):
            try:
                address = _wait_ready(child, f"{node.role} node")
            except RuntimeError as exc:  # its own error is above, on the shared stderr
                print(f"tandem: error: {exc}", file=sys.stderr, flush=True)
                return 1
            addresses[node.role].append(address)
            watched.append((f"{node.role} node at {address}", child))
            print(f"{node.role} node ready at {address} on {node.device}", flush=True)
        app = create_app(router_settings(args, addresses["prefill"], addresses["decode"]))
        sockets = [listen(args.host, args.port)] if args.routers > 1 else None
        if sockets:  # the others bind the port this one has (a free one if --port 0)
            port, routers_env = sockets[0].getsockname()[1], _secrets_env(args, env)
            for i in range(1, args.routers):
                child = subprocess.Popen(
                    [sys.executable, "-m", "tandem.cli", "router",
                     *router_argv(args, addresses, port)],
                    stdout=subprocess.PIPE, text=True, start_new_session=True,
                    env=routers_env)
                children.append(child)
                watched.append((f"router {i} on port {port}", child))
            for what, child in watched[-(args.routers - 1):]:  # serving before "up"
                try:
                    _wait_ready(child, what, _ROUTER_READY)
                except RuntimeError as exc:
                    print(f"tandem: error: {exc}", file=sys.stderr, flush=True)
                    return 1
        server = _server(app, args)
        freeze_startup()
        threading.Thread(target=_announce, args=(server, args), daemon=True).start()
        threading.Thread(target=_watch, args=(watched,), daemon=True,
                         name="watch-nodes").start()
        server.run(sockets=sockets)
    except KeyboardInterrupt:
        pass
    finally:
        for child in children:
            _stop(child)
        if mps is not None:
            mps.stop()
    return 0


def _interrupt(*_: object) -> None:
    raise KeyboardInterrupt


def _engine_flags(args: argparse.Namespace, node: NodePlan) -> list[str]:
    budget = args.max_num_batched_tokens
    if node.role == "decode" and args.decode_max_num_batched_tokens is not None:
        budget = args.decode_max_num_batched_tokens
    flags = ["--model", args.model, "--load-format", args.load_format, "--dtype", args.dtype,
             "--device", node.device, "--block-size", str(args.block_size),
             "--max-num-seqs", str(args.max_num_seqs),
             "--max-num-batched-tokens", str(budget),
             "--max-model-len", str(args.max_model_len), "--seed", str(args.seed),
             "--gpu-memory-fraction", str(node.memory_fraction)]
    if args.skip_tokenizer_init:
        flags.append("--skip-tokenizer-init")
    if args.attention_backend is not None:
        flags += ["--attention-backend", args.attention_backend]
    if args.enforce_eager:
        flags.append("--enforce-eager")
    if not args.mixed_cuda_graphs:
        flags.append("--no-mixed-cuda-graphs")
    if args.async_scheduling is not None:
        flags.append("--async-scheduling" if args.async_scheduling else "--no-async-scheduling")
    if args.num_kv_blocks is not None:
        flags += ["--num-kv-blocks", str(args.num_kv_blocks)]
    if args.kv_host_gib:
        flags += ["--kv-host-gib", str(args.kv_host_gib)]
    if args.no_prefix_caching:
        flags.append("--no-prefix-caching")
    if args.quantization is not None:
        flags += ["--quantization", args.quantization]
    if args.kv_cache_dtype != "auto":
        flags += ["--kv-cache-dtype", args.kv_cache_dtype]
    if args.cpu_weights != "fp32":
        flags += ["--cpu-weights", args.cpu_weights]
    if args.stream_interval_ms:
        flags += ["--stream-interval-ms", str(args.stream_interval_ms)]
    flags += ["--stream-chunk-rate", str(args.stream_chunk_rate)]
    return flags


def _wait_ready(child: subprocess.Popen, what: str, ready: re.Pattern = _READY) -> str:
    """The node's gRPC address, from its ready line (or what `ready`'s group matches, for
    another process); its other output is passed on."""
    lines: queue.SimpleQueue[str | None] = queue.SimpleQueue()

    def pump() -> None:
        assert child.stdout is not None
        for line in child.stdout:
            lines.put(line)
            sys.stdout.write(line)
        lines.put(None)

    threading.Thread(target=pump, daemon=True).start()
    deadline = time.monotonic() + NODE_START_TIMEOUT_S
    while time.monotonic() < deadline:
        try:
            line = lines.get(timeout=1)
        except queue.Empty:
            continue
        if line is None:
            raise RuntimeError(f"the {what} exited with code {child.wait()} before it "
                               f"was ready")
        if m := ready.search(line):
            return m.group(1)
    raise RuntimeError(f"the {what} was not ready within {NODE_START_TIMEOUT_S}s")


def _announce(server: uvicorn.Server, args: argparse.Namespace) -> None:
    while not server.started:
        time.sleep(0.05)
    print(f"Tandem is up: http://{args.host}:{args.port}/v1 (model "
          f"{args.served_model_name or args.model}); Ctrl-C stops it", flush=True)


def _watch(children: list[tuple[str, subprocess.Popen]]) -> None:
    """Say when a node process (or another router) ends on its own, and reap it (the
    router marks the node down at its next poll and stops reporting its figures)."""
    alive = list(children)
    while alive:
        time.sleep(1.0)
        for entry in list(alive):
            what, child = entry
            code = child.poll()  # reaps it
            if code is not None:
                alive.remove(entry)
                log.error("the %s (pid %d) exited with code %d", what, child.pid, code)


def _stop(child: subprocess.Popen) -> None:
    if child.poll() is not None:
        return
    try:
        os.killpg(child.pid, signal.SIGTERM)
        child.wait(timeout=15)
    except (subprocess.TimeoutExpired, ProcessLookupError):
        try:
            os.killpg(child.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
