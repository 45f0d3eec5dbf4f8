"""One connection's two-rank torch.distributed process group (NCCL or gloo), built
directly on a store, with bounded waits. The nccl connector (nccl.py) owns the protocol;
this owns the group: payload bytes out and in, timeouts, abort."""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from tandem.kvtransfer.connector import TransferError, poll_until

log = logging.getLogger(__name__)

RECEIVER_RANK, SENDER_RANK = 0, 1
_TAG = 0
# Payloads a connection may have on their way at once (posted recvs, unfinished sends):
# enough to keep the link busy while the host runs ahead, few enough to bound memory.
MAX_IN_FLIGHT = 4
# Extra room given to the NCCL watchdog beyond our own deadlines (see nccl.py).
_WATCHDOG_SLACK_S = 300.0


def _bytes(t: torch.Tensor) -> torch.Tensor:
    # uint8 reinterpretation: every dtype (bf16 included) travels bit-exact.
    return t.reshape(-1).view(torch.uint8)


class PairGroup:
    """One connection's two-rank process group, used by one thread at a time (the
    connection's), except `abort`, which any thread may call to unblock it."""

    def __init__(
        self,
        backend: str,
        device: torch.device,
        store: dist.Store,
        rank: int,
        hostname: str,
        setup_timeout: float,
        io_timeout: float,
    ) -> None:
        self.backend, self.device = backend, device
        self.peer = SENDER_RANK if rank == RECEIVER_RANK else RECEIVER_RANK
        self._scratch: torch.Tensor | None = None
        self._pending: deque[Any] = deque()  # recvs posted by start_recv, oldest first
        # nccl: receives are posted with this stream current, so each waits only for what
        # the receiving side put there (a buffer's last reader), never for the engine's
        # or a scatter's work on other streams.
        self.stream = torch.cuda.Stream(device) if backend == "nccl" else None
        try:
            if self.backend == "gloo":
                opts = dist.ProcessGroupGloo._Options()
                opts._devices = [dist.ProcessGroupGloo.create_device(hostname=hostname)]
                opts._timeout = timedelta(seconds=setup_timeout)
                opts._threads = 1  # send/recv don't use the worker pool
                # Blocks until both ranks connected, at most setup_timeout.
                self.pg: Any = dist.ProcessGroupGloo(store, rank, 2, opts)
            else:
                opts = dist.ProcessGroupNCCL.Options()
                opts._timeout = timedelta(seconds=io_timeout + _WATCHDOG_SLACK_S)
                self.pg = dist.ProcessGroupNCCL(store, rank, 2, opts)
                self._warm_up(setup_timeout)
        except TransferError:
            raise
        except Exception as exc:  # DistStoreError, gloo/NCCL RuntimeError
            raise TransferError(f"process group setup failed: {exc}") from exc

    def _warm_up(self, timeout: float) -> None:
        one = torch.zeros(1, dtype=torch.uint8, device=self.device)
        if self.peer == RECEIVER_RANK:
            self.send(one, timeout)
        else:
            self.recv_into(one, timeout)

    def send(self, payload: torch.Tensor, timeout: float) -> None:
        """Returns once the payload's memory may be reused."""
        work = self.start_send(payload, timeout)
        if work is not None:
            self.wait(work, timeout)

    def start_send(self, payload: torch.Tensor, timeout: float) -> Any | None:
        """Enqueue the payload's send; returns its Work (None: already out). nccl: the
        send runs on the group's stream, which first waits for the current stream, so a
        gather enqueued just before is what goes out; the caller keeps the payload
        unchanged until `wait` (or `is_completed`) says so. gloo sends synchronously."""
        wire = _bytes(payload.contiguous())
        if not wire.numel():
            return None
        if wire.device != self.device:
            wire = wire.to(self.device)
        work = self._start(lambda: self.pg.send([wire], self.peer, _TAG))
        if self.backend == "gloo":
            self.wait(work, timeout)
            return None
        return work

    def receiving(self) -> AbstractContextManager[Any]:
        """Where a receiving thread allocates, posts and hands over one payload."""
        return torch.cuda.stream(self.stream) if self.stream is not None else nullcontext()

    def recv_into(self, out: torch.Tensor, timeout: float) -> None:
        """Returns once the payload is in `out`, for the host too."""
        target = _bytes(out)
        if not target.numel():
            return
        wire = target if target.device == self.device else self._staging(target.numel())
        self.wait(self._start(lambda: self.pg.recv([wire], self.peer, _TAG)), timeout)
        if wire is not target:
            target.copy_(wire)

    def start_recv(self, out: torch.Tensor, timeout: float) -> None:
        """Receive into `out` without waiting for it (nccl, `out` on our device): the
        current stream of our device is made to wait for it, so work enqueued there
        afterwards sees the bytes. At most MAX_IN_FLIGHT recvs stay outstanding; `settle`
        waits for them all. Anything else is received synchronously."""
        target = _bytes(out)
        if self.backend == "gloo" or target.device != self.device:
            self.recv_into(out, timeout)
            return
        if target.numel():
            self.landed(self.post_recv(out), timeout)

    def post_recv(self, out: torch.Tensor) -> Any:
        """nccl: enqueue a receive into `out` (on our device, non-empty) and return its Work;
        nothing waits for it until `landed`. Receives match sends in posting order."""
        target = _bytes(out)
        return self._start(lambda: self.pg.recv([target], self.peer, _TAG))

    def landed(self, work: Any, timeout: float) -> None:
        """Make the current stream wait for a receive posted by `post_recv`."""
        work.wait()  # not a host wait: the current stream waits for the recv's end
        self._pending.append(work)
        while self._pending and (
            len(self._pending) > MAX_IN_FLIGHT or self._pending[0].is_completed()
        ):
            self.wait(self._pending.popleft(), timeout)

    def settle(self, timeout: float) -> None:
        """Return once every recv posted by `start_recv` has completed."""
        while self._pending:
            self.wait(self._pending.popleft(), timeout)

    def _staging(self, nbytes: int) -> torch.Tensor:
        if self._scratch is None or self._scratch.numel() < nbytes:
            self._scratch = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        return self._scratch[:nbytes]

    def _start(self, op: Callable[[], Any]) -> Any:
        try:
            return op()
        except Exception as exc:  # closed pair, aborted communicator
            raise TransferError(f"{self.backend} transfer failed: {exc}") from exc

    def wait(self, work: Any, timeout: float) -> None:
        """Wait on the host for `work`, at most `timeout` seconds; an nccl group that
        times out is aborted (that frees its stream) and the connection is over."""
        try:
            if self.backend == "gloo":
                work.wait(timedelta(seconds=timeout))
                return
            if not poll_until(work.is_completed, time.monotonic() + timeout):
                self.abort()
                raise TransferError(f"nccl transfer timed out after {timeout:g}s")
            work.wait()  # raises if it failed; orders the current stream after it
        except TransferError:
            raise
        except Exception as exc:  # gloo timeout or closed pair, NCCL error
            raise TransferError(f"{self.backend} transfer failed: {exc}") from exc

    def abort(self) -> None:
        try:
            self.pg.abort()
        except Exception as exc:  # already gone: nothing more to free
            log.debug("abort of %s group failed: %s", self.backend, exc)
