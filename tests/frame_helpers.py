"""Shared by the frame-level connector tests (ucx, nccl): numbered frames with known
payloads and their bit-exact check, and the subprocess bodies (spawn) that send frames
or push KV through the connector they name (`get_connector(name, **options)`)."""

from __future__ import annotations

import time
from typing import Any

import torch
from kv_helpers import MODEL, make_caches

from tandem.kvtransfer.agent import SinkInfo
from tandem.kvtransfer.connector import Connector, Frame, get_connector
from tandem.kvtransfer.layout import KVLayout
from tandem.kvtransfer.sender import push

FRAMES = 12


def expected_payload(sender: int, i: int, device: str = "cpu") -> torch.Tensor | None:
    """Frame i of sender `sender`: fp32, bf16, or no payload, random bytes; the later
    ones past UCX's rendezvous threshold (8 KiB), so both of its protocols run."""
    if i % 3 == 2:
        return None
    g = torch.Generator().manual_seed(1000 * sender + i)
    dtype = torch.float32 if i % 3 == 0 else torch.bfloat16
    return torch.randn(2, 3 + 8 * i, 4, 8, generator=g).to(dtype).to(device)


def numbered_frame(sender: int, i: int, device: str = "cpu") -> Frame:
    """A layer message: request `sender`, layer i (any header-only kind would do too)."""
    return Frame({"kind": "layer", "request_id": f"{sender}", "layer": i},
                 expected_payload(sender, i, device))


def bye(sender: int) -> Frame:
    """The reply a receiver sends sender `sender` once its frames arrived."""
    return Frame({"kind": "done", "request_id": f"{sender}"})


def assert_frames_exact(frames: list[Frame], sender: int) -> None:
    assert [f.header["layer"] for f in frames] == list(range(FRAMES)), "order not kept"
    for f in frames:
        want = expected_payload(sender, f.header["layer"])
        if want is None:
            assert f.payload is None and "shape" not in f.header
            continue
        assert f.payload is not None and f.payload.dtype == want.dtype
        assert f.header["dtype"] == str(want.dtype).removeprefix("torch.")
        assert f.header["shape"] == list(want.shape)
        # Bit-exact: compare the raw bytes, so bf16 and NaN payloads can't hide a difference.
        assert torch.equal(f.payload.cpu().view(torch.uint8), want.view(torch.uint8))


def _connector(name: str, options: dict[str, Any], device: str) -> Connector:
    if device != "cpu":
        torch.cuda.set_device(device)
    return get_connector(name, **options)


def send_frames_and_await_reply(name: str, options: dict[str, Any], address: str,
                                sender: int, device: str = "cpu") -> None:
    """Send FRAMES frames, then wait for the receiver's reply naming this sender."""
    connector = _connector(name, options, device)
    s = connector.sender(address, connect_timeout=20)
    for i in range(FRAMES):
        s.send(numbered_frame(sender, i, device), timeout=20)
    reply = s.poll(20)
    s.close()
    connector.close()
    assert reply is not None and reply.header == bye(sender).header, reply


def send_two_frames_then_hang(name: str, options: dict[str, Any], address: str,
                              sent: Any) -> None:
    s = _connector(name, options, "cpu").sender(address, connect_timeout=20)
    s.send(numbered_frame(7, 0))
    s.send(numbered_frame(7, 1))
    sent.set()
    time.sleep(60)  # the parent SIGKILLs us long before this


def push_kv(name: str, options: dict[str, Any], sink: dict, src_ids: list[int],
            dtype_name: str, device: str = "cpu") -> None:
    connector = _connector(name, options, device)
    caches = make_caches(16, getattr(torch, dtype_name), seed=1, device=device)
    push(connector, SinkInfo.from_dict(sink), caches, src_ids, KVLayout.of(caches, MODEL),
         connect_timeout=20)
