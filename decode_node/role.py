"""The decode role over one engine: reserve a prompt's blocks, let a prefill node push
its KV into them (a `TransferAgent` sink), then decode it in the running batch and
stream the tokens. It can also prefill a prompt itself (conditional disaggregation, or
the fallback when a transfer failed).

Per request:

    sink, first_block, cached = role.reserve(req, ttl_s)   # blocks held, sink open
    ...a prefill node pushes the prompt's KV into the sink...
    role.generate(req, first_token, listener)               # waits for the KV, decodes
    role.generate(req, None, listener)                      # or: prefill here

A sink that fails (its TTL, an abort, the sender gone) gives its blocks back to the
engine; a reserved request nobody generates is freed with its sink.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

from tandem.engine.request import Request
from tandem.kvtransfer.agent import SinkInfo, TransferAgent
from tandem.kvtransfer.connector import Connector, TransferError
from tandem.kvtransfer.layout import KVLayout
from tandem.node.loop import EngineLoop, Listener


class DecodeRole:
    def __init__(self, loop: EngineLoop, connector: Connector, host: str,
                 layout: KVLayout, secret: bytes | None = None, port: int = 0,
                 advertise_host: str | None = None) -> None:
        """`secret`: the cluster secret a sender's begin must prove (kvtransfer/auth.py);
        the transfer agent listens on `host`:`port`, known as `advertise_host`."""
        self.loop, self.layout = loop, layout
        self.connector = connector
        self.agent = TransferAgent(loop.engine.runner.kv_caches, layout, connector,
                                   self._sink_freed, host, secret=secret, port=port,
                                   advertise_host=advertise_host)
        self._lock = threading.Lock()
        self._sinks: dict[int, str] = {}  # a sink's first block id -> its request
        self.kv_bytes_received = 0
        self.transfers_failed = 0

    @property
    def address(self) -> str:
        return self.agent.address

    def reserve(self, req: Request, ttl_s: float) -> tuple[SinkInfo, int, int]:
        """Hold the blocks of `req`'s prompt and open a sink for those its prefix cache
        lacks: (the sink, the first prompt block it receives, prompt tokens cached).
        Raises ValueError for a bad request, RuntimeError when blocks run out."""
        cached = self.loop.call(lambda e: e.reserve(req))
        first_block = cached // self.layout.block_size
        ids = tuple(req.block_ids[first_block:])
        with self._lock:
            self._sinks[ids[0]] = req.request_id
        try:
            sink = self.agent.reserve(req.request_id, ids, ttl_s)
        except BaseException:
            with self._lock:
                del self._sinks[ids[0]]
            self.loop.call(lambda e: e.release_reserved(req.request_id))
            raise
        return sink, first_block, cached

    def generate(self, req: Request, first_token: int | None, listener: Listener,
                 timeout_s: float = 60.0) -> None:
        """Start decoding `req`; its outputs go to `listener` (on the engine loop's
        thread). With `first_token`, its reserved sink must become ready (within
        `timeout_s`; else TransferError); without, the prompt is computed here, in its
        reserved blocks if it has them. Raises ValueError for a bad request."""
        rid = req.request_id
        reserved = self.agent.holds(rid)
        if first_token is not None:
            if not reserved:
                raise ValueError(f"request {rid!r} has no reservation here to decode from")
            if not self.agent.wait_ready(rid, timeout_s):
                status = self.agent.status(rid)
                self.agent.abort(rid, f"not ready after {timeout_s:g}s")
                raise TransferError(f"the KV of {rid!r} did not arrive: "
                                    f"{status.reason or status.state.value}")
            self._forget(self.agent.release(rid))
            # Its first output reaches the listener on the loop thread, before the next
            # step's: delivered from here, it could come after it.
            self.loop.start(rid, listener, lambda e: e.start_decode(rid, first_token))
            return
        self.loop.listen(rid, listener)
        try:
            # The prefill pool is skipped, or failed: compute the prompt here, in its
            # reserved blocks while it still has them (a failed sink gives them back).
            self._forget_request(rid)  # so the sink's end does not free them now
            if reserved:
                self.agent.abort(rid, "prefilled on the decode node instead")
            if self.loop.call(lambda e: e.start_prefill(rid)):
                return
            self.loop.call(lambda e: e.add(req))
        except BaseException:
            self.loop.unlisten(rid)
            raise

    def abort(self, request_id: str, reason: str) -> bool:
        """Fail its sink (which frees its blocks) and stop it in the engine."""
        sink_ended = self.agent.holds(request_id) and self.agent.abort(request_id, reason)
        return self.loop.abort(request_id) or sink_ended

    def close(self) -> None:
        self.agent.close()

    def _bytes(self, num_blocks: int) -> int:
        return num_blocks * self.layout.block_bytes * self.layout.num_layers

    def _forget(self, block_ids: Sequence[int]) -> None:
        """A released sink: its blocks belong to the running request now."""
        with self._lock:
            self._sinks.pop(block_ids[0], None)
        self.kv_bytes_received += self._bytes(len(block_ids))

    def _forget_request(self, request_id: str) -> None:
        with self._lock:
            for first, rid in list(self._sinks.items()):
                if rid == request_id:
                    del self._sinks[first]

    def _sink_freed(self, block_ids: list[int]) -> None:
        """The agent is done with a failed sink: give its request's blocks back, unless
        the request went on without it (prefilled here)."""
        with self._lock:
            rid = self._sinks.pop(block_ids[0], None)
        if rid is None:
            return
        self.transfers_failed += 1
        self.loop.submit(lambda e: e.release_reserved(rid))

