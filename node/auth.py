"""The cluster secret on node gRPC calls: a node obeys only callers of its cluster.

Every call to a node started with a secret must carry `x-tandem-cluster: <token>` in its
metadata, the token an HMAC of a fixed context keyed by the secret (so the secret itself
is never on the wire, and the transfer handshake's proofs, keyed the same way over
another context, cannot be made from it). A call without it, or with another, ends with
UNAUTHENTICATED before its handler runs; the check is in constant time.

    server = grpc.aio.server(interceptors=aio_server_interceptors(secret))
    stub = AuthedStub(NodeStub(grpc.aio.insecure_channel(address)), secret)
    channel = authenticated(grpc.insecure_channel(address), secret)   # synchronous

Plain-text gRPC carries the token as a bearer credential: whoever can read the cluster's
traffic can replay it. Clusters whose network is not trusted put the node ports behind
mTLS (a service mesh) as well.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import os
from pathlib import Path
from typing import Any

import grpc

METADATA_KEY = "x-tandem-cluster"
CLUSTER_SECRET_ENV = "TANDEM_CLUSTER_SECRET"
_CONTEXT = b"tandem-node-grpc\0"
_REFUSAL = "this node obeys only its cluster: a missing or wrong cluster secret"
HEALTH_PREFIX = "/grpc.health.v1.Health/"


def read_secret(value: str | None, path: str | None, env: str) -> str | None:
    """A secret from its flag, else its file (`path`, trailing newline dropped), else the
    environment variable `env`; None when none is given. An empty secret is an error."""
    if value is None and path is not None:
        try:
            value = Path(path).read_text().rstrip("\r\n")
        except OSError as exc:
            raise ValueError(f"cannot read the secret file {path}: {exc.strerror}") from None
    if value is None:
        value = os.environ.get(env)
    if value is not None and not value:
        raise ValueError(f"an empty secret is not a secret (from {path or env})")
    return value


def token(secret: bytes) -> str:
    return hmac.new(secret, _CONTEXT, hashlib.sha256).hexdigest()


def aio_server_interceptors(secret: bytes | None) -> list[grpc.aio.ServerInterceptor]:
    """The check on an asyncio server. `grpc.health.v1` (Kubernetes' probes, which
    carry no secret) is open: it tells only whether the node serves."""
    return [] if secret is None else [_AioRequireToken(token(secret))]


class AuthedStub:
    """A stub (asyncio's or a synchronous one) whose every call carries the cluster token
    (the same as a client interceptor, which grpc.aio would run through extra tasks on
    each call)."""

    def __init__(self, stub: Any, secret: bytes | None) -> None:
        self._stub = stub
        self._metadata = None if secret is None else ((METADATA_KEY, token(secret)),)

    def __getattr__(self, name: str) -> Any:
        method = getattr(self._stub, name)
        if self._metadata is not None:
            method = functools.partial(method, metadata=self._metadata)
        setattr(self, name, method)  # looked up once
        return method


def authenticated(channel: grpc.Channel, secret: bytes | None) -> grpc.Channel:
    """`channel`, its calls carrying the cluster token (unchanged without a secret)."""
    if secret is None:
        return channel
    return grpc.intercept_channel(channel, _SyncToken(((METADATA_KEY, token(secret)),)))


class _AioRequireToken(grpc.aio.ServerInterceptor):
    def __init__(self, expected: str) -> None:
        self._expected = expected.encode()

    async def intercept_service(self, continuation: Any, details: grpc.HandlerCallDetails
                                ) -> grpc.RpcMethodHandler | None:
        given = next((v for k, v in details.invocation_metadata or () if k == METADATA_KEY), "")
        if details.method.startswith(HEALTH_PREFIX) or (
                isinstance(given, str) and hmac.compare_digest(given.encode(), self._expected)):
            return await continuation(details)
        handler = await continuation(details)
        if handler is None:
            return None
        if handler.response_streaming:
            return grpc.unary_stream_rpc_method_handler(_refuse_stream_aio)
        return grpc.unary_unary_rpc_method_handler(_refuse_aio)


async def _refuse_aio(_: object, context: grpc.aio.ServicerContext) -> None:
    await context.abort(grpc.StatusCode.UNAUTHENTICATED, _REFUSAL)


async def _refuse_stream_aio(request: object, context: grpc.aio.ServicerContext) -> Any:
    await _refuse_aio(request, context)
    yield  # unreachable: an async generator, as a streaming handler must be


class _SyncToken(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor):
    def __init__(self, metadata: tuple[tuple[str, str], ...]) -> None:
        self._metadata = metadata

    def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(_ClientCallDetails.of(details, self._metadata), request)

    def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(_ClientCallDetails.of(details, self._metadata), request)


class _ClientCallDetails(grpc.ClientCallDetails):
    """The synchronous API's call details are an interface: this is its one value type."""

    def __init__(self, method: str, timeout: float | None, metadata: Any,
                 credentials: Any, wait_for_ready: bool | None,
                 compression: Any) -> None:
        self.method, self.timeout, self.metadata = method, timeout, metadata
        self.credentials, self.wait_for_ready, self.compression = (
            credentials, wait_for_ready, compression)

    @classmethod
    def of(cls, details: grpc.ClientCallDetails, extra: tuple[tuple[str, str], ...]
           ) -> _ClientCallDetails:
        return cls(details.method, details.timeout, tuple(details.metadata or ()) + extra,
                   details.credentials, getattr(details, "wait_for_ready", None),
                   getattr(details, "compression", None))
