"""The engine process's end of the node's gRPC front (`node/front.py`).

A node runs in two processes: this one holds the engine, its loop thread, the roles and
the `NodeService` on its asyncio loop; the front holds the gRPC server and does the
per-token work of the Outputs streams. Python's lock (the GIL) is per process, so the
front's work no longer takes the engine thread's (SmolLM2 shape on an H100, a burst of
256: the engine's median step 1.3-2.1 ms in two processes against 2.2-3.2 in one).

Between them, three local zmq sockets (unix sockets in a private directory, bound here):

    calls    front -> here   [call id, b"call", method, request, seconds left]  a gRPC call
                             [call id, b"cancel"]                       its client left
                             [b"", b"bound", port]                      the front listens
    replies  here -> front   [call id, b"item", message]   a reply, or a stream's item
                             [call id, b"end"]             the call ended
                             [call id, b"error", code, details]
                             [b"", b"stop", grace]          stop serving, then exit
    columns  here -> front   [subscriber, OutputColumns]    a step's outputs (engine thread)

Every message is protobuf bytes or plain fields; nothing is unpickled. Each socket is
used by one thread: `calls` by the receiver thread here, `replies` by the asyncio loop,
`columns` by the engine thread.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import grpc
import zmq

from tandem.node.auth import CLUSTER_SECRET_ENV
from tandem.node.front import BOUND, CANCEL, END, ERROR, ITEM, METHODS, STOP
from tandem.node.grpc_server import stop_then_halt
from tandem.node.server import NodeService

log = logging.getLogger(__name__)

_POLL_MS = 100  # the receiver looks at `close` this often


class CallAborted(Exception):
    """A handler ended its call with `code` (`context.abort`)."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code, self.details = code, details


class CallContext:
    """What a `NodeService` handler asks of its gRPC context, for a forwarded call."""

    def __init__(self, seconds_left: float | None) -> None:
        self._deadline = None if seconds_left is None else time.monotonic() + seconds_left

    def time_remaining(self) -> float | None:
        return None if self._deadline is None else max(0.0, self._deadline - time.monotonic())

    async def abort(self, code: grpc.StatusCode, details: str) -> None:
        raise CallAborted(code, details)


class CallServer:
    """Serves the front's calls with a `NodeService`'s handlers (`serve`), each a task on
    its asyncio loop (so an Abort cancels it as it would a gRPC call's). `bound` is set
    once the front listens, `port` its port."""

    def __init__(self, directory: str) -> None:
        self.service: NodeService | None = None
        self.addresses = {name: f"ipc://{directory}/{name}"
                          for name in ("calls", "replies", "columns")}
        self._context = zmq.Context()
        self._calls = self._socket(zmq.PULL, "calls")
        self._replies = self._socket(zmq.PUSH, "replies")
        self._columns = self._socket(zmq.PUSH, "columns")
        self._tasks: dict[bytes, asyncio.Task] = {}
        self.port = 0
        self.bound = threading.Event()
        self._closing = threading.Event()
        self._receiver: threading.Thread | None = None

    def serve(self, service: NodeService) -> None:
        """Take calls for `service` (made with `send_columns=self.send_columns`)."""
        self.service = service
        self._receiver = threading.Thread(target=self._receive, name="node-calls", daemon=True)
        self._receiver.start()

    def _socket(self, kind: int, name: str) -> zmq.Socket:
        sock = self._context.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        if kind == zmq.PUSH:
            sock.setsockopt(zmq.SNDHWM, 0)  # never block a sender: the front reads on
        sock.bind(self.addresses[name])
        return sock

    def send_columns(self, subscriber: str, message: bytes) -> None:
        """On the engine thread (`NodeService(send_columns=...)`)."""
        self._columns.send_multipart((subscriber.encode(), message), copy=False)

    def stop_front(self, grace: float) -> None:
        """On the asyncio loop: the front stops serving (calls get `grace` s) and exits."""
        self._replies.send_multipart((b"", STOP, str(grace).encode()))

    def close(self) -> None:
        """Once the engine loop and the asyncio loop have stopped (the other sockets'
        threads). A zmq socket is closed by the thread that uses it: the receiver closes
        its own as it ends; the context ends once every socket is closed."""
        self._closing.set()
        if self._receiver is not None:
            self._receiver.join()
        else:
            self._calls.close(linger=0)
        self._replies.close(linger=0)
        self._columns.close(linger=0)
        self._context.term()

    def _receive(self) -> None:
        try:
            while not self._closing.is_set():
                if not self._calls.poll(_POLL_MS):
                    continue
                frames = self._calls.recv_multipart()
                if frames[:2] == [b"", BOUND]:
                    self.port = int(frames[2])
                    self.bound.set()
                else:
                    self.service.bridge.post(self._on_call, frames)
        finally:
            self._calls.close(linger=0)  # its thread's socket: closed here

    def _on_call(self, frames: list[bytes]) -> None:
        call_id, kind = frames[0], frames[1]
        if kind == CANCEL:
            task = self._tasks.get(call_id)
            if task is not None:
                task.cancel()
            return
        method, request, seconds_left = frames[2].decode(), frames[3], frames[4]
        left = float(seconds_left) if seconds_left else None
        task = asyncio.ensure_future(self._serve(call_id, method, request, left))
        self._tasks[call_id] = task

    async def _serve(self, call_id: bytes, method: str, request: bytes,
                     seconds_left: float | None) -> None:
        try:
            kind, streams = METHODS[method]
            handler = getattr(self.service, method)
            context = CallContext(seconds_left)
            if streams:
                async for item in handler(kind.FromString(request), context):
                    self._reply(call_id, ITEM, item.SerializeToString())
            else:
                reply = await handler(kind.FromString(request), context)
                self._reply(call_id, ITEM, reply.SerializeToString())
            self._reply(call_id, END)
        except CallAborted as exc:
            self._reply(call_id, ERROR, exc.code.name.encode(), exc.details.encode())
        except asyncio.CancelledError:
            pass  # its client left (the front's cancel): nobody reads a reply
        except Exception as exc:  # noqa: BLE001 - a bug: its caller gets INTERNAL, not a hang
            log.exception("%s failed", method)
            self._reply(call_id, ERROR, b"INTERNAL", f"{method} failed: {exc!r}".encode())
        finally:
            self._tasks.pop(call_id, None)

    def _reply(self, call_id: bytes, kind: bytes, *fields: bytes) -> None:
        self._replies.send_multipart((call_id, kind, *fields), copy=False)


@dataclass(eq=False)
class FrontServer:
    """A node served by its gRPC front (`node/front.py`), a child process; the same
    `stop` as `grpc_server.NodeServer`'s."""

    service: NodeService
    calls: CallServer
    front: subprocess.Popen
    directory: str
    stopped: threading.Event  # set once the asyncio loop has stopped
    stopping: bool = False

    def watch(self) -> None:
        """A front that exits unasked leaves the node unreachable: stop the node as
        Ctrl-C would (at once: nobody can reach it to drain)."""
        def wait() -> None:
            code = self.front.wait()
            if not self.stopping:
                log.error("the node's gRPC front exited (code %s); stopping the node", code)
                os.kill(os.getpid(), signal.SIGINT)

        threading.Thread(target=wait, name="front-watch", daemon=True).start()

    def stop(self, grace: float | None = None) -> threading.Event:
        """The front stops serving (calls still running get `grace` seconds) and exits;
        then the asyncio loop stops; the event is set once it has."""
        self.stopping = True

        async def stop() -> None:
            await self.service.aclose()  # the Outputs streams end: none waits the grace
            self.calls.stop_front(grace or 0.0)
            await asyncio.to_thread(_reap, self.front, (grace or 0.0) + 10)

        return stop_then_halt(self.service.aio, stop, self.stopped)

    def close(self) -> None:
        """Once stopped: the sockets and their directory."""
        _reap(self.front, 0)
        self.calls.close()
        shutil.rmtree(self.directory, ignore_errors=True)


def serve_front(make_service: Callable[[Callable[[str, bytes], None]], NodeService],
                host: str, port: int, advertise_host: str | None, secret: bytes | None,
                start_timeout_s: float = 120.0) -> tuple[FrontServer, int]:
    """Start the node's gRPC front on `host`:`port` (0: a free port) for the service
    `make_service(send_columns)` makes, its asyncio loop on a thread here; (the server,
    its port). Routers know it as `advertise_host` (default: `host`)."""
    directory = tempfile.mkdtemp(prefix="tandem-node-")  # mode 0700: this user's only
    calls = CallServer(directory)
    service = make_service(calls.send_columns)
    stopped = threading.Event()

    def run() -> None:
        asyncio.set_event_loop(service.aio)
        try:
            service.aio.run_forever()
        finally:
            stopped.set()

    threading.Thread(target=run, name="node-rpc", daemon=True).start()
    calls.serve(service)
    env = dict(os.environ)
    env.pop(CLUSTER_SECRET_ENV, None)
    if secret is not None:
        env[CLUSTER_SECRET_ENV] = secret.decode()
    front = subprocess.Popen([sys.executable, "-m", "tandem.node.front", "--host", host,
                              "--port", str(port), "--ipc", directory,
                              "--parent", str(os.getpid())], env=env,
                             start_new_session=True)  # the node takes the signals; it follows
    server = FrontServer(service, calls, front, directory, stopped)
    deadline = time.monotonic() + start_timeout_s
    while not calls.bound.wait(0.1):
        if front.poll() is not None or time.monotonic() > deadline:
            server.stop(0).wait(10)
            server.close()
            raise OSError(f"the node's gRPC front did not start on {host}:{port}")
    service.events.node_id = f"{advertise_host or host}:{calls.port}"  # as routers know it
    server.watch()
    return server, calls.port


def _reap(process: subprocess.Popen, timeout_s: float) -> None:
    try:
        process.wait(timeout_s)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
