"""The prefill role over one engine: compute a prompt, push its KV into a decode node's
sink layer by layer while the later layers compute, and return the first token.

A prompt is batched with the others (chunked prefill, the engine's scheduler); in the
step that completes it, the engine's prefill hook opens a `KVPush` into the sink over the
request's own blocks and sends each layer as soon as its KV is written. When the step
has sampled the first token, a worker waits for the receiver's confirmation; the result
comes back then. The request's blocks go back to the engine's prefix cache as usual, and
are only reused by work queued after the push read them.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace

from tandem.engine.outputs import RequestOutput
from tandem.engine.request import Request
from tandem.kvtransfer.agent import SinkInfo
from tandem.kvtransfer.connector import Connector, TransferError
from tandem.kvtransfer.layout import KVLayout
from tandem.kvtransfer.sender import KVPush
from tandem.kvtransfer.staging import KVRows
from tandem.node.loop import EngineLoop

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PrefillResult:
    first_token: int
    cached_tokens: int  # prompt tokens this node took from its prefix cache
    kv_bytes: int  # pushed into the sink


@dataclass(eq=False)
class _Pending:
    sink: SinkInfo
    first_block: int
    result: Future[PrefillResult]
    push: KVPush | None = None
    error: BaseException | None = None
    started: float = 0.0  # time.monotonic() at the push's start


class PrefillRole:
    def __init__(self, loop: EngineLoop, connector: Connector, layout: KVLayout,
                 send_timeout_s: float = 30.0) -> None:
        self.loop, self.connector, self.layout = loop, connector, layout
        self._rows = KVRows(loop.engine.runner.kv_caches)
        self._send_timeout_s = send_timeout_s
        self._pending: dict[str, _Pending] = {}  # touched on the loop thread only
        self._finisher = ThreadPoolExecutor(4, thread_name_prefix="kv-push-finish")
        self._lock = threading.Lock()
        self.kv_bytes_sent = 0
        self.kv_transfer_seconds = 0.0  # summed over pushes, start to the receiver's done
        self.transfers_failed = 0
        loop.engine.prefill_hook = self._hook

    def prefill(self, req: Request, sink: SinkInfo, first_block: int,
                timeout_s: float = 120.0) -> PrefillResult:
        """Compute `req`'s prompt and push blocks first_block.. of it into `sink`.
        Raises ValueError for a bad request, TransferError when the push failed."""
        if len(sink.block_ids) != -(-req.num_prompt_tokens // self.layout.block_size) - first_block:
            raise ValueError(f"the sink's {len(sink.block_ids)} blocks from block {first_block} "
                             f"do not fit a {req.num_prompt_tokens}-token prompt")
        params = req.params
        one = Request(req.request_id, req.prompt_token_ids,
                      replace(params, max_tokens=1, min_tokens=min(params.min_tokens, 1)),
                      cache_salt=req.cache_salt)
        pending = _Pending(sink, first_block, Future())
        rid = req.request_id

        def add(engine) -> None:  # noqa: ANN001 - the loop's engine
            self._pending[rid] = pending
            engine.add(one)

        self.loop.listen(rid, lambda out: self._on_output(rid, out))
        try:
            self.loop.call(add)
        except BaseException:
            self.loop.unlisten(rid)
            self._pending.pop(rid, None)
            raise
        return pending.result.result(timeout_s)

    def close(self) -> None:
        self._finisher.shutdown(wait=True)

    # -- on the loop thread ----------------------------------------------------------------

    def _hook(self, req: Request):  # noqa: ANN202 - Callable[[int], None] | None
        pending = self._pending.get(req.request_id)
        if pending is None:
            return None
        n = len(pending.sink.block_ids)
        src = req.block_ids[pending.first_block:pending.first_block + n]
        pending.started = time.monotonic()
        try:
            push = KVPush(self.connector, pending.sink, self._rows, src, self.layout,
                          send_timeout=self._send_timeout_s)
            push.start()
        except (TransferError, ValueError) as exc:
            pending.error = exc
            return None
        pending.push = push

        def send(layer: int) -> None:
            if pending.error is not None:
                return
            try:
                push.send_layer(layer)
            except TransferError as exc:  # the receiver aborted, or went away
                pending.error = exc
                push.abort(str(exc))

        return send

    def _on_output(self, rid: str, out: RequestOutput | BaseException) -> None:
        if isinstance(out, RequestOutput) and not out.finished:
            return
        pending = self._pending.pop(rid, None)
        if pending is None:
            return
        if isinstance(out, BaseException):
            pending.error = pending.error or out
        elif out.finish_reason == "abort" and pending.error is None:
            pending.error = TransferError(f"prefill of {rid!r} was aborted")
        if pending.error is not None or pending.push is None:
            if pending.push is not None:
                pending.push.abort(str(pending.error))
            with self._lock:  # finisher threads count too
                self.transfers_failed += 1
            error = pending.error or TransferError(f"no KV push was opened for {rid!r}")
            pending.result.set_exception(error)
            return
        assert isinstance(out, RequestOutput)
        self._finisher.submit(self._finish, pending, out)

    # -- on a finisher thread --------------------------------------------------------------

    def _finish(self, pending: _Pending, out: RequestOutput) -> None:
        assert pending.push is not None
        try:
            pending.push.finish()
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            with self._lock:
                self.transfers_failed += 1
            pending.result.set_exception(exc)
            return
        kv_bytes = len(pending.sink.block_ids) * self.layout.block_bytes * self.layout.num_layers
        with self._lock:
            self.kv_bytes_sent += kv_bytes
            self.kv_transfer_seconds += time.monotonic() - pending.started
        pending.result.set_result(PrefillResult(out.token_ids[0], out.num_cached_tokens, kv_bytes))
