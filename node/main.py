"""`tandem node`: one engine behind the node service, until interrupted."""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
from collections.abc import Callable

from tandem.engine.cli_generate import engine_config
from tandem.engine.llm_engine import LLMEngine
from tandem.kvtransfer.index import get_index
from tandem.node.auth import CLUSTER_SECRET_ENV, read_secret
from tandem.node.calls import serve_front
from tandem.node.gc_freeze import freeze_startup
from tandem.node.grpc_server import run_until_stopped
from tandem.node.server import NodeService

GIL_SWITCH_INTERVAL_S = 0.0005


def run_node(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    secret = read_secret(args.cluster_secret, args.cluster_secret_file, CLUSTER_SECRET_ENV)
    if secret is None:
        logging.getLogger("tandem.node").warning(
            "no cluster secret: anyone who reaches this node's ports can drive it "
            "(--cluster-secret or %s)", CLUSTER_SECRET_ENV)
    engine = LLMEngine(engine_config(args))
    index = get_index(args.index, engine.model_name) if args.index else None
    token = None if secret is None else secret.encode()

    def make_service(send_columns: Callable[[str, bytes], None]) -> NodeService:
        return NodeService(engine, args.role, args.connector, args.transfer_host, index,
                           engine_thread=False, secret=token,
                           transfer_port=args.transfer_port,
                           advertise_host=args.advertise_host,
                           max_requests=args.max_requests, send_columns=send_columns,
                           stream_interval_s=args.stream_interval_ms / 1000,
                           stream_chunk_rate=args.stream_chunk_rate)

    # gRPC, and the Outputs streams' per-token work, in a process of their own: they
    # would take the GIL from the engine thread here (node/calls.py).
    server, port = serve_front(make_service, args.host, args.port, args.advertise_host,
                               token)
    service = server.service
    # The engine thread runs Python most of a step and rarely waits: with the default
    # 5 ms switch interval, each hand-off of a token to a gRPC thread could wait that
    # long for the GIL. 0.5 ms bounds it well under a decode step.
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
    freeze_startup()
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    # One line a launcher waits for: the role, the model and where to reach the node.
    print(f"tandem node ready: role={args.role} model={engine.model_name} "
          f"grpc={args.advertise_host or args.host}:{port} "
          f"transfer={service.decode.address} "
          f"kv_blocks={engine.block_pool.num_blocks}", flush=True)
    # SIGTERM (a pod's termination, tandem up's stop) drains first; Ctrl-C stops at once.
    drain_s = [args.drain_timeout]
    closer = threading.Thread(target=lambda: run_until_stopped(server, service, stop,
                                                               drain_s[0]), name="node-stop")
    closer.start()
    try:
        service.loop.run()  # the engine steps on the main thread (see EngineLoop)
    except KeyboardInterrupt:
        drain_s[0] = 0.0
    finally:
        stop.set()
        closer.join(timeout=args.drain_timeout + 60)
    return 0
