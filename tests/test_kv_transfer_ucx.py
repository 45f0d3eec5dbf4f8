"""The ucx connector (the `ucxx` package, host memory on CPU), its own cases: dead and
silent addresses, a stalled receiver and a closed one end in bounded time; device memory
on a GPU. What every connector must do runs in test_connectors.py. Skipped where ucxx is
not installed (`pip install ucxx-cu12`)."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

pytest.importorskip("ucxx", reason="the ucx connector needs ucxx (pip install ucxx-cu12)")

from frame_helpers import (
    FRAMES,
    assert_frames_exact,
    bye,
    numbered_frame,
    send_frames_and_await_reply,
)
from kv_helpers import (
    Inbox,
    join_all,
    roundtrip,
    spawn,  # noqa: E402
    )

from tandem.kvtransfer.connector import (  # noqa: E402
    Frame,
    TransferError,
    get_connector,
)
from tandem.kvtransfer.ucx import UcxConnector  # noqa: E402


def _connector(**options: Any) -> UcxConnector:
    connector = get_connector("ucx", **options)
    assert isinstance(connector, UcxConnector)
    return connector


@pytest.fixture
def inbox() -> Iterator[tuple[Inbox, Any]]:
    box = Inbox()
    receiver = _connector().receiver("127.0.0.1", box.alloc, box.on_frame, box.on_error)
    yield box, receiver
    receiver.close()


# -- frames ----------------------------------------------------------------------------


def test_connect_to_a_dead_address_fails_in_bounded_time() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens here once closed
    start = time.monotonic()
    with pytest.raises(TransferError, match="connecting to ucx://127.0.0.1"):
        _connector().sender(f"ucx://127.0.0.1:{port}", connect_timeout=1)
    assert time.monotonic() - start < 2.5


def test_connect_to_a_silent_listener_times_out() -> None:
    with socket.create_server(("127.0.0.1", 0)) as silent:  # accepts, never speaks UCX
        start = time.monotonic()
        with pytest.raises(TransferError, match="connecting"):
            _connector().sender(f"ucx://127.0.0.1:{silent.getsockname()[1]}", connect_timeout=1)
        assert time.monotonic() - start < 2.5


def test_a_stalled_receiver_times_the_sender_out() -> None:
    box = Inbox()
    release = threading.Event()

    def slow(frame: Frame) -> None:
        box.on_frame(frame)
        release.wait(10)  # the receiver stops reading after the first frame

    connector = _connector(io_timeout=1.0)
    receiver = connector.receiver("127.0.0.1", box.alloc, slow, box.on_error)
    try:
        s = connector.sender(receiver.address)
        s.send(numbered_frame(0, 0))
        # rendezvous: needs a posted recv
        big = Frame(numbered_frame(0, 1).header, torch.randn(1 << 20))
        start = time.monotonic()
        with pytest.raises(TransferError, match="timed out"):
            s.send(big)
        assert time.monotonic() - start < 3
        with pytest.raises(TransferError, match="closed"):
            s.send(numbered_frame(0, 3))  # the connection is over
        release.set()
        assert box.wait(errors=1, timeout=5) and len(box.errors) == 1
    finally:
        release.set()
        receiver.close()


def test_receiver_close_fails_the_sender(inbox) -> None:  # noqa: ANN001
    box, receiver = inbox
    s = _connector(io_timeout=2.0).sender(receiver.address)
    s.send(numbered_frame(0, 0))
    assert box.wait(frames=1)
    receiver.close()
    with pytest.raises(TransferError, match="gone"):
        s.poll(5)
    with pytest.raises(TransferError):
        s.send(Frame(numbered_frame(0, 1).header, torch.randn(1 << 20)))
    assert box.errors == []  # close() is not an error
    s.close()


# -- device memory (the lent GPU machine, with ucxx-cu13 carried there) -----------------


def _ucx_cuda() -> bool:
    return torch.cuda.is_available() and _connector()._loop.cuda


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kv_round_trip_in_device_memory(dtype: torch.dtype) -> None:
    if not _ucx_cuda():
        pytest.skip("needs CUDA and UCX's CUDA transports")
    roundtrip(_connector(), dtype, [7, 2, 11, 5], [0, 3, 1, 9], device="cuda")


@pytest.mark.gpu
def test_frames_from_another_process_in_device_memory() -> None:
    if not _ucx_cuda():
        pytest.skip("needs CUDA and UCX's CUDA transports")
    device = f"cuda:{torch.cuda.device_count() - 1}"  # another GPU where there is one
    box = Inbox(device)
    receiver = _connector().receiver("127.0.0.1", box.alloc, box.on_frame, box.on_error)
    proc = spawn(send_frames_and_await_reply, "ucx", {}, receiver.address, 5, "cuda:0")
    try:
        assert box.wait(frames=FRAMES, timeout=60), f"{len(box.frames)} frames arrived"
        assert all(f.payload is None or f.payload.device == torch.device(device)
                   for f in box.frames)
        assert_frames_exact(box.frames, 5)
        receiver.reply(box.frames[0].peer, bye(5))
        join_all(proc, timeout=60)
    finally:
        receiver.close()
