"""A throwaway redis-server for tests: free port, temp dir, no persistence.

Never the shared one on 6379. The server can be killed, paused and restarted on the same
port, so tests can take Redis away from a live client and give it back.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import redis


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    def __init__(self, port: int | None = None) -> None:
        self.port = port or free_port()
        self.dir = Path(tempfile.mkdtemp(prefix="tandem-redis-"))
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def client(self) -> redis.Redis:
        return redis.Redis(port=self.port, decode_responses=True, socket_timeout=2)

    def start(self, timeout_s: float = 5.0) -> RedisServer:
        assert self.proc is None, "already running"
        args = ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1"]
        args += ["--save", "", "--appendonly", "no", "--dir", str(self.dir)]
        args += ["--logfile", str(self.dir / "redis.log")]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout_s
        probe = redis.Redis(port=self.port, socket_timeout=0.2, socket_connect_timeout=0.2)
        try:
            while True:
                if self.proc.poll() is not None:
                    self.proc = None
                    raise RuntimeError(f"redis-server exited: {self._log_tail()}")
                try:
                    # Check it is our process answering, not someone who took the port.
                    if probe.info("server")["process_id"] == self.proc.pid:
                        return self
                except redis.ConnectionError:
                    pass
                if time.monotonic() > deadline:
                    self.kill()
                    raise TimeoutError(f"redis-server on {self.port} never answered PING")
                time.sleep(0.02)
        finally:
            probe.close()

    def kill(self) -> None:
        """SIGKILL: the server vanishes without closing anything cleanly."""
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait(timeout=5)
            self.proc = None

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=5)
            self.proc = None

    def restart(self) -> RedisServer:
        self.kill()
        return self.start()

    def pause(self) -> None:
        """SIGSTOP: the port still accepts connections but nothing answers (a hung Redis)."""
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGCONT)

    def close(self) -> None:
        if self.proc is not None:
            self.resume()  # a stopped process cannot act on SIGTERM
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _log_tail(self) -> str:
        log = self.dir / "redis.log"
        return log.read_text()[-2000:] if log.exists() else "(no log)"
