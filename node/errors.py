"""How a node's calls end when they fail: gRPC status codes by the exception's exact type,
never a traceback. `rpc` wraps a service method (unary or streaming) with it; the
service keeps `aborted` ({task: reason}) for the calls an Abort cancelled.

    ValueError            INVALID_ARGUMENT    a bad request
    Status(code)          code                a call the role does not serve now, ...
    KVCacheFull           RESOURCE_EXHAUSTED  Reserve: the blocks are not free now
    QueueTimeout          DEADLINE_EXCEEDED   the call's deadline passed in the queue
    PrefillFailed         its code            the prefill node failed; the plan says fail
    TransferError         ABORTED             a KV transfer failed
    LoopClosed            UNAVAILABLE         the node is stopping
    Aborted               CANCELLED           aborted while it waited
"""

from __future__ import annotations

import asyncio
import functools
import inspect
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc

from tandem.decode_node.driver import PrefillFailed, QueueTimeout
from tandem.decode_node.role import Aborted
from tandem.engine.llm_engine import KVCacheFull
from tandem.kvtransfer.connector import TransferError
from tandem.node.loop import LoopClosed


class Status(Exception):
    """End the call with `code`."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code = code


_CODES: dict[type[BaseException], grpc.StatusCode] = {
    ValueError: grpc.StatusCode.INVALID_ARGUMENT,
    KVCacheFull: grpc.StatusCode.RESOURCE_EXHAUSTED,
    QueueTimeout: grpc.StatusCode.DEADLINE_EXCEEDED,
    TransferError: grpc.StatusCode.ABORTED,
    LoopClosed: grpc.StatusCode.UNAVAILABLE,
    Aborted: grpc.StatusCode.CANCELLED,
}


def status_of(exc: BaseException) -> tuple[grpc.StatusCode, str] | None:
    if isinstance(exc, (Status, PrefillFailed)):
        return exc.code, str(exc)
    for kind in type(exc).__mro__:
        if kind in _CODES:
            prefix = "KV transfer failed: " if kind is TransferError else ""
            return _CODES[kind], prefix + str(exc)
    return None


def rpc(method: Callable) -> Callable:
    """The handler's typed errors end its call with their status code (table above); a
    call whose task an Abort cancelled ends with CANCELLED (one its client cancelled
    just ends)."""
    if inspect.isasyncgenfunction(method):
        @functools.wraps(method)
        async def stream(self: Any, request: Any, context: Any) -> AsyncIterator[Any]:
            try:
                async for item in method(self, request, context):
                    yield item
            except (Exception, asyncio.CancelledError) as exc:
                await _end(self, context, exc)
        return stream

    @functools.wraps(method)
    async def unary(self: Any, request: Any, context: Any) -> Any:
        try:
            return await method(self, request, context)
        except (Exception, asyncio.CancelledError) as exc:
            await _end(self, context, exc)
    return unary


async def _end(service: Any, context: grpc.aio.ServicerContext,
                 exc: BaseException) -> None:
    if isinstance(exc, asyncio.CancelledError):
        reason = service.aborted.pop(asyncio.current_task(), None)
        if reason is None:
            raise exc
        await context.abort(grpc.StatusCode.CANCELLED, f"the request was aborted: {reason}")
    status = status_of(exc)
    if status is None:
        raise exc
    await context.abort(*status)
