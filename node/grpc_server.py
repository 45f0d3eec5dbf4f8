"""The node's gRPC server: `serve` runs a `NodeService` on its asyncio loop's thread,
beside the standard `grpc.health.v1` service for Kubernetes' probes; `run_until_stopped`
serves until told to stop, then drains (`drain`)."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from tandem.node import auth
from tandem.node.front import SERVER_OPTIONS

if TYPE_CHECKING:
    from tandem.node.calls import FrontServer
from tandem.node.server import NodeService
from tandem.protos import node_pb2_grpc as pb_grpc


@dataclass(eq=False)
class NodeServer:
    """The node's gRPC server on its asyncio loop's thread."""

    service: NodeService
    server: grpc.aio.Server
    stopped: threading.Event  # set once the asyncio loop has stopped

    def stop(self, grace: float | None = None) -> threading.Event:
        """Stop serving (calls still running get `grace` seconds), then the asyncio loop;
        the event is set once it has."""
        async def stop() -> None:
            await self.server.stop(grace)
            await self.service.aclose()

        return stop_then_halt(self.service.aio, stop, self.stopped)

    def close(self) -> None:
        """Once stopped: nothing more to release (a `FrontServer` has its front's)."""


def stop_then_halt(aio: asyncio.AbstractEventLoop, stop: Callable[[], Awaitable[None]],
                   stopped: threading.Event) -> threading.Event:
    """Run `stop()` on the asyncio loop `aio`, then stop the loop (even if `stop` failed);
    `stopped` is set once the loop has stopped."""
    async def run() -> None:
        try:
            await stop()
        finally:
            aio.stop()

    if aio.is_running():
        asyncio.run_coroutine_threadsafe(run(), aio)
    return stopped


def serve(service: NodeService, host: str = "127.0.0.1", port: int = 0,
          advertise_host: str | None = None) -> tuple[NodeServer, int]:
    """Start the gRPC server for `service` on a thread running its asyncio loop; (the
    server, its port). Routers know it as `advertise_host` (default: `host`) and that
    port. `grpc.health.v1` says SERVING while the node takes new requests."""
    aio = service.aio
    started: dict[str, Any] = {}
    ready, stopped = threading.Event(), threading.Event()

    async def start() -> tuple[grpc.aio.Server, int]:
        server = grpc.aio.server(interceptors=auth.aio_server_interceptors(service.secret),
                                 options=SERVER_OPTIONS)
        pb_grpc.add_NodeServicer_to_server(service, server)
        health_pb2_grpc.add_HealthServicer_to_server(_health(service), server)
        bound = server.add_insecure_port(f"{host}:{port}")
        if bound == 0:
            raise OSError(f"cannot listen on {host}:{port}")
        service.events.node_id = f"{advertise_host or host}:{bound}"  # as routers know it
        await server.start()
        return server, bound

    def run() -> None:
        asyncio.set_event_loop(aio)
        try:
            started["server"] = aio.run_until_complete(start())
        except BaseException as exc:  # noqa: BLE001 - raised in the caller
            started["error"] = exc
            stopped.set()
            return
        finally:
            ready.set()
        try:
            aio.run_forever()
        finally:
            stopped.set()

    thread = threading.Thread(target=run, name="node-rpc", daemon=True)
    thread.start()
    ready.wait()
    if "error" in started:
        raise started["error"]
    server, bound = started["server"]
    return NodeServer(service, server, stopped), bound


def _health(service: NodeService) -> health_pb2_grpc.HealthServicer:
    """The standard health service, for Kubernetes' probes: "" serves while the engine
    loop is alive (liveness), "tandem.Node" while the node also takes new requests
    (readiness: not while it drains)."""
    servicer = health.aio.HealthServicer()
    serving = health_pb2.HealthCheckResponse.SERVING
    not_serving = health_pb2.HealthCheckResponse.NOT_SERVING

    async def watch() -> None:
        while True:
            alive = service.loop.liveness(service.timeouts.engine_stall_s).alive
            await servicer.set("", serving if alive else not_serving)
            ready = alive and service.accepting
            await servicer.set("tandem.Node", serving if ready else not_serving)
            await asyncio.sleep(1.0)

    service.aio.create_task(watch())
    return servicer


def run_until_stopped(server: NodeServer | FrontServer, service: NodeService,
                      stop: threading.Event | None = None, drain_timeout_s: float = 0.0
                      ) -> None:
    """Serve until `stop` is set; then drain: take no new work (Health says draining, so
    routers send none) and let what runs finish, for up to `drain_timeout_s`, before the
    server stops and the rest is cut."""
    try:
        (stop or threading.Event()).wait()
        if drain_timeout_s > 0:
            drain(service, drain_timeout_s)
    finally:
        server.stop(grace=5).wait(30)
        service.close()
        server.close()


def drain(service: NodeService, timeout_s: float) -> bool:
    """Stop taking work and wait until no request is left, or `timeout_s` passed;
    True when none is left. From any thread but the asyncio loop's."""
    service.draining = True
    log = logging.getLogger("tandem.node")
    deadline = time.monotonic() + timeout_s

    def left() -> int:
        return asyncio.run_coroutine_threadsafe(service.num_requests(), service.aio).result(30)

    while (n := left()) and time.monotonic() < deadline:
        log.info("draining: %d request(s) left", n)
        time.sleep(min(1.0, max(0.0, deadline - time.monotonic())))
    n = left()
    if n:
        log.warning("drain timed out: %d request(s) cut", n)
    return not n
