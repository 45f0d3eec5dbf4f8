"""Byte framing of connector frames on stream transports (tcp).

A frame on the wire:

    prefix  !4sHIQ  magic b"TDKV", version, header length, payload length (bytes)
    header  the frame's header as a serialized `Envelope` (protos/transfer.proto,
            `messages.encode`), with the payload's `dtype` and `shape`
    payload raw bytes of the contiguous tensor (C order), absent when length is 0

Nothing is allocated for a payload before its header was checked: a well-formed transfer
message (`messages.decode`) whose `dtype` and `shape` (a known dtype, a short list of
non-negative ints) account for exactly the payload length in the prefix
(`check_payload`). A frame that fails this is a TransferError, and the stream is out of
step from there: the connection ends.

Payload bytes go straight between the socket and the tensor's memory: `sendall` of a
memoryview over the tensor, `recv_into` a memoryview over the tensor the allocator
returned; no intermediate bytes objects. CUDA tensors cross through a reusable pinned
CPU buffer (`HostStaging`), one device copy per frame.
"""

from __future__ import annotations

import socket
import struct
from collections.abc import Callable

import torch

from tandem.kvtransfer.connector import (
    Allocator,
    Frame,
    TransferError,
    check_payload,
    payload_header,
    payload_spec,
)
from tandem.kvtransfer.messages import decode, encode

MAGIC = b"TDKV"
VERSION = 2  # 1: JSON headers
PREFIX = struct.Struct("!4sHIQ")
# Headers are small control data; a bigger one means a corrupt or foreign stream.
MAX_HEADER_BYTES = 1 << 20


def byte_view(t: torch.Tensor) -> memoryview:
    """A writable, zero-copy byte view of a contiguous CPU tensor's memory."""
    if t.device.type != "cpu" or not t.is_contiguous():
        raise ValueError(f"need a contiguous CPU tensor, got one on {t.device}, {t.stride()=}")
    # uint8 reinterpretation keeps bf16 (which numpy lacks) and every other dtype exact.
    return memoryview(t.detach().reshape(-1).view(torch.uint8).numpy())


class HostStaging:
    """A reusable pinned CPU buffer through which CUDA payloads cross a socket.
    Grows to the largest payload seen; one per connection, used by one thread."""

    def __init__(self) -> None:
        self._buf: torch.Tensor | None = None

    def get(self, nbytes: int) -> torch.Tensor:
        if self._buf is None or self._buf.numel() < nbytes:
            self._buf = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        return self._buf[:nbytes]


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def send_frame(sock: socket.socket, frame: Frame, staging: HostStaging) -> None:
    """Write one frame; returns once the payload's memory may be reused."""
    payload = frame.payload
    if payload is not None and not payload.is_contiguous():
        payload = payload.contiguous()
    header = encode(payload_header(frame))
    nbytes = 0 if payload is None else payload.numel() * payload.element_size()
    sock.sendall(PREFIX.pack(MAGIC, VERSION, len(header), nbytes) + header)
    if not nbytes:
        return
    assert payload is not None
    if payload.device.type != "cpu":
        host = staging.get(nbytes)
        host.copy_(_as_bytes(payload))  # synchronous: the bytes are on the host after this
        payload = host
    sock.sendall(byte_view(payload))


def recv_exactly_into(sock: socket.socket, view: memoryview) -> None:
    """Fill `view` from the socket; EOF before it is full is an error (mid-frame)."""
    while view.nbytes:
        n = sock.recv_into(view)
        if n == 0:
            raise TransferError("connection closed mid-frame")
        view = view[n:]


def recv_frame(
    sock: socket.socket,
    alloc: Allocator,
    staging: HostStaging,
    keep_waiting: Callable[[], bool] = lambda: False,
) -> Frame | None:
    """Read one frame; None on a clean EOF between frames.

    The socket's timeout bounds every read. A timeout before the frame's first byte asks
    `keep_waiting()` whether an idle connection may wait on; a timeout after it means the
    peer stalled mid-frame and is an error."""
    prefix = bytearray(PREFIX.size)
    view = memoryview(prefix)
    while True:
        try:
            n = sock.recv_into(view)
        except TimeoutError:
            if keep_waiting():
                continue
            raise TransferError("timed out waiting for a frame") from None
        if n == 0:
            return None
        break
    try:
        recv_exactly_into(sock, view[n:])
        magic, version, header_len, payload_len = PREFIX.unpack(prefix)
        if magic != MAGIC or version != VERSION:
            raise TransferError(f"not a Tandem KV frame (magic {magic!r}, version {version})")
        if header_len > MAX_HEADER_BYTES:
            raise TransferError(f"frame header of {header_len} bytes is too large")
        raw = bytearray(header_len)
        recv_exactly_into(sock, memoryview(raw))
        header = decode(raw)
        if not check_payload(header, payload_len):
            return Frame(header)
        payload = _recv_payload(sock, header, payload_len, alloc, staging)
    except TimeoutError:
        raise TransferError("peer stalled mid-frame") from None
    return Frame(header, payload)


def _recv_payload(
    sock: socket.socket,
    header: dict,
    payload_len: int,
    alloc: Allocator,
    staging: HostStaging,
) -> torch.Tensor:
    """The payload `check_payload` vouched for, in the tensor `alloc` gave for it."""
    dtype, shape = payload_spec(header)
    out = alloc(header)
    if out.dtype != dtype or tuple(out.shape) != shape or not out.is_contiguous():
        raise TransferError(
            f"allocator gave {tuple(out.shape)} {out.dtype} for a {shape} {dtype} payload"
        )
    if out.device.type == "cpu":
        recv_exactly_into(sock, byte_view(out))
    else:
        host = staging.get(payload_len)
        recv_exactly_into(sock, byte_view(host))
        _as_bytes(out).copy_(host)  # synchronous, so `host` is free for the next frame
    return out
