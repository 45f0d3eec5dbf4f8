"""The KV transfer protocol's messages as they travel (`kvtransfer/messages.py`, the one
adapter over protos/transfer.proto): every kind survives the wire exactly; a header that
is no message of its kind is refused by the sender; bytes that are no well-typed,
complete message of a known kind are refused by the receiver with TransferError, before
anything is allocated for the payload they announce; the ipc sink target survives the
node service's Sink, and a broken one is refused."""

from __future__ import annotations

import socket
from typing import Any

import pytest
import torch

from tandem.kvtransfer.agent import SinkInfo
from tandem.kvtransfer.connector import TransferError
from tandem.kvtransfer.ipc_mapping import export
from tandem.kvtransfer.layout import KVLayout
from tandem.kvtransfer.messages import KINDS, decode, encode, target_from_pb, target_to_pb
from tandem.kvtransfer.wire import MAGIC, PREFIX, VERSION, HostStaging, recv_frame
from tandem.node.convert import sink_from_pb, sink_to_pb
from tandem.protos import transfer_pb2 as pb

LAYOUT = KVLayout("m", "bfloat16", 4, 2, 8, 4).to_dict()
NEXT = {"kind": "layer", "request_id": "r", "layer": 2, "layers": 2, "dtype": "bfloat16",
        "shape": [2, 2, 3, 4, 2, 8]}
PROOF = "ab" * 32

HEADERS: list[dict[str, Any]] = [
    {"kind": "begin", "request_id": "r", "layout": LAYOUT, "num_blocks": 3},
    {"kind": "begin", "request_id": "r", "layout": LAYOUT, "num_blocks": 3, "auth": PROOF,
     "next": NEXT},
    {"kind": "begin", "request_id": "r", "layout": LAYOUT, "num_blocks": 3,
     "writer": {"pid": 4242, "event": "00ff" * 16}},
    {"kind": "begin", "request_id": "r", "layout": LAYOUT, "num_blocks": 3,
     "writer": {"pid": 4242, "event": None}},
    {"kind": "accept", "request_id": "r"},
    {"kind": "layer", "request_id": "r", "layer": 0, "dtype": "bfloat16",
     "shape": [2, 3, 4, 2, 8]},
    {**NEXT, "layer": 0, "next": NEXT},
    {"kind": "layer", "request_id": "r", "layer": 1},  # ipc: no payload
    {"kind": "end", "request_id": "r"},
    {"kind": "done", "request_id": "r"},
    {"kind": "done", "request_id": "r", "more": ["s", "t"]},  # a written message's
    {"kind": "abort", "request_id": "r", "reason": ""},
    {"kind": "abort", "request_id": "r", "reason": "layouts differ", "error": "layout_mismatch"},
    {"kind": "abort", "request_id": "r", "reason": "gave up", "auth": PROOF},
    {"kind": "nccl_hello", "backend": "gloo"},
    {"kind": "nccl_welcome", "store_port": 29500, "pair": "tandem-kv/1.2.3.4:5/0/"},
    {"kind": "written", "layout": LAYOUT, "pid": 4242, "sinks": [
        {"request_id": "r", "num_blocks": 3, "first_token": 0, "event": "00ff" * 16},
        {"request_id": "s", "num_blocks": 1, "first_token": 7, "auth": PROOF}]},
]
WRITTEN = HEADERS[-1]


@pytest.mark.parametrize("header", HEADERS, ids=lambda h: h["kind"])
def test_every_message_round_trips(header: dict[str, Any]) -> None:
    assert decode(encode(header)) == header


def test_every_kind_is_covered() -> None:
    assert {h["kind"] for h in HEADERS} == set(KINDS)


def test_a_tuple_shape_travels_as_a_list() -> None:
    header = {**NEXT, "shape": tuple(NEXT["shape"])}
    assert decode(encode(header)) == NEXT


# -- the sender's side: no header that is not a message of its kind leaves --------------


@pytest.mark.parametrize(
    ("header", "error"),
    [
        ({"kind": "t", "request_id": "r"}, "no transfer message of kind 't'"),
        ({"request_id": "r"}, "no transfer message of kind None"),
        ({"kind": "end"}, r"missing \['request_id'\]"),
        ({"kind": "layer", "request_id": "r"}, r"missing \['layer'\]"),
        ({"kind": "end", "request_id": "r", "layer": 0}, r"no fields \['layer'\]"),
        ({"kind": "accept", "request_id": "r", "dtype": "float32", "shape": [1]},
         r"no fields \['dtype', 'shape'\]"),
        ({"kind": "layer", "request_id": "r", "layer": "0"}, "bad layer header"),
        ({"kind": "layer", "request_id": "r", "layer": 1 << 40}, "bad layer header"),
        ({"kind": "begin", "request_id": "r", "layout": LAYOUT, "num_blocks": 3, "auth": 17},
         "bad begin header"),
        ({"kind": "begin", "request_id": "r", "layout": {**LAYOUT, "extra": 1},
          "num_blocks": 3}, "bad begin header"),
        ({"kind": "layer", "request_id": "r", "layer": 0, "shape": [1]}, "dtype and shape go"),
        ({"kind": "layer", "request_id": "r", "layer": 0, "dtype": "int8"}, "dtype and shape go"),
        ({**NEXT, "next": {**NEXT, "next": NEXT}}, r"no fields \['next'\]"),
        ({**NEXT, "next": {"kind": "end", "request_id": "r"}}, "announces a layer message"),
        ({**WRITTEN, "sinks": []}, "names no sink"),
        ({**WRITTEN, "sinks": [{"request_id": "r", "num_blocks": 3}]},
         r"written sink without \['first_token'\]"),
        ({**WRITTEN, "sinks": [{**WRITTEN["sinks"][0], "layer": 0}]},
         r"no fields \['layer'\] in a written sink"),
        ({**WRITTEN, "pid": None}, r"missing \['pid'\]"),
    ],
)
def test_a_header_that_is_no_message_of_its_kind_is_not_sent(
    header: dict[str, Any], error: str
) -> None:
    with pytest.raises(TransferError, match=error):
        encode(header)


# -- the receiver's side: refused before anything is allocated ---------------------------


def _field(number: int, wire_type: int, value: bytes) -> bytes:
    """One field in protobuf's wire format by hand (one-byte tag, one-byte length)."""
    assert number < 16 and len(value) < 128
    return bytes([number << 3 | wire_type]) + (bytes([len(value)]) if wire_type == 2 else b"")\
        + value


def _envelope(kind: int, fields: bytes) -> bytes:
    return _field(kind, 2, fields)


LAYER, END = 3, 4
VALID = encode({"kind": "layer", "request_id": "r", "layer": 0, "dtype": "float32",
                "shape": [4]})

MALFORMED = {
    "no bytes": (b"", "no known kind"),
    "unknown kind": (_envelope(15, _field(1, 2, b"r")), "no known kind"),
    "not protobuf": (b"\xff\xfe\xfd", "not a transfer message"),
    "json": (b'{"kind": "layer", "request_id": "r", "layer": 0}', "not a transfer message"),
    "missing request_id": (pb.Envelope(layer=pb.Layer(layer=0, dtype="float32", shape=[4]))
                           .SerializeToString(), "layer message without request_id"),
    "missing layer": (pb.Envelope(layer=pb.Layer(request_id="r", dtype="float32", shape=[4]))
                      .SerializeToString(), "layer message without layer"),
    "begin without layout": (pb.Envelope(begin=pb.Begin(request_id="r", num_blocks=2))
                             .SerializeToString(), "begin message without layout"),
    "writer without pid": (pb.Envelope(begin=pb.Begin(
        request_id="r", num_blocks=2, layout=pb.Layout(**LAYOUT), writer=pb.Writer(event="e")))
        .SerializeToString(), "ipc writer without pid"),
    "shape without dtype": (pb.Envelope(layer=pb.Layer(request_id="r", layer=0, shape=[4]))
                            .SerializeToString(), "payload shape but no dtype"),
    "next inside next": (pb.Envelope(layer=pb.Layer(
        request_id="r", layer=0, next=pb.Layer(request_id="r", layer=1, next=pb.Layer(
            request_id="r", layer=2)))).SerializeToString(), "`next` announced inside"),
    "layer as a string": (_envelope(LAYER, _field(1, 2, b"r") + _field(2, 2, b"0")),
                          "layer message with unknown or mistyped fields"),
    "request_id as a varint": (_envelope(LAYER, _field(1, 0, b"\x07") + _field(2, 0, b"\x00")),
                               "layer message with unknown or mistyped fields"),
    "shape as a double": (_envelope(LAYER, _field(1, 2, b"r") + _field(2, 0, b"\x00")
                                    + _field(4, 2, b"float32") + _field(5, 1, b"\0" * 7 + b"@")),
                          "layer message with unknown or mistyped fields"),
    "a payload spec on an end": (_envelope(END, _field(1, 2, b"r") + _field(4, 2, b"float32")
                                           + _field(5, 2, b"\x04")),
                                 "end message with unknown or mistyped fields"),
    "bad utf-8": (_envelope(END, _field(1, 2, b"\xff")), "not a transfer message"),
    "written without sinks": (pb.Envelope(written=pb.Written(layout=pb.Layout(**LAYOUT), pid=1))
                              .SerializeToString(), "written message without sinks"),
    "written sink without first_token": (pb.Envelope(written=pb.Written(
        layout=pb.Layout(**LAYOUT), pid=1, sinks=[pb.WrittenSink(request_id="r", num_blocks=1)]))
        .SerializeToString(), "written sink message without first_token"),
    "a written sink's unknown field": (_envelope(9, _field(2, 0, b"\x01") + _field(3, 2, _field(
        1, 2, b"r") + _field(2, 0, b"\x01") + _field(5, 0, b"\x00") + _field(9, 0, b"\x01"))),
        "written message with unknown or mistyped fields"),
    "truncated": (VALID[:-1], "not a transfer message"),
}


@pytest.mark.parametrize("case", MALFORMED)
def test_a_malformed_envelope_is_refused(case: str) -> None:
    raw, error = MALFORMED[case]
    with pytest.raises(TransferError, match=error):
        decode(raw)


def test_every_truncation_of_a_message_is_refused() -> None:
    whole = encode({**NEXT, "next": NEXT})
    for n in range(len(whole)):
        with pytest.raises(TransferError):
            decode(whole[:n])


@pytest.mark.parametrize("case", MALFORMED)
def test_a_malformed_envelope_ends_the_frame_before_allocation(case: str) -> None:
    """Each announcing a 16-byte payload that does follow: nothing is allocated for it."""
    raw, error = MALFORMED[case]
    calls: list[dict[str, Any]] = []

    def alloc(header: dict[str, Any]) -> torch.Tensor:
        calls.append(header)
        return torch.empty(4)

    a, b = socket.socketpair()
    with a, b:
        b.settimeout(5)
        a.sendall(PREFIX.pack(MAGIC, VERSION, len(raw), 16) + raw + b"\0" * 16)
        with pytest.raises(TransferError, match=error):
            recv_frame(b, alloc, HostStaging())
    assert calls == []


def test_a_well_formed_envelope_is_allocated_for() -> None:
    calls: list[dict[str, Any]] = []

    def alloc(header: dict[str, Any]) -> torch.Tensor:
        calls.append(header)
        return torch.empty(4)

    a, b = socket.socketpair()
    with a, b:
        b.settimeout(5)
        a.sendall(PREFIX.pack(MAGIC, VERSION, len(VALID), 16) + VALID + b"\0" * 16)
        frame = recv_frame(b, alloc, HostStaging())
    assert frame is not None and frame.header == decode(VALID) == calls[0]


# -- the ipc sink target -------------------------------------------------------------------


def _cpu_target() -> dict[str, Any]:
    rows, tags = torch.zeros(8, 16, 32), torch.zeros(16, dtype=torch.int32)
    return {"cache": export(rows), "tags": export(tags), "layout": LAYOUT, "ticket": 7}


CUDA_DESC = {"host": "boot", "pid": 12, "dtype": "bfloat16", "shape": [8, 16, 32],
             "stride": [512, 32, 1], "device": "cuda", "handle": "0a" * 64, "offset": 1024,
             "size": 1 << 20}


def test_an_ipc_target_round_trips() -> None:
    target = _cpu_target()
    assert "fd" in target["cache"]
    assert target_from_pb(target_to_pb(target)) == target
    cuda = {**target, "cache": CUDA_DESC}
    assert target_from_pb(pb.IpcTarget.FromString(target_to_pb(cuda).SerializeToString())) \
        == cuda


def test_an_ipc_target_crosses_the_node_service_in_its_sink() -> None:
    target = _cpu_target()
    sink = SinkInfo("r", "ipc://127.0.0.1:1", (3, 1), LAYOUT, 12.5, target)
    msg = sink_to_pb(sink, first_block=2, connector="ipc")
    assert sink_from_pb(type(msg).FromString(msg.SerializeToString())) == (sink, 2)
    plain = SinkInfo("r", "tcp://127.0.0.1:1", (3, 1), LAYOUT, 12.5)
    assert sink_from_pb(sink_to_pb(plain, 0, "tcp")) == (plain, 0)


@pytest.mark.parametrize(
    ("change", "error"),
    [
        (lambda t: t.ClearField("tags"), r"without \['tags'\]"),
        (lambda t: t.ClearField("ticket"), r"without \['ticket'\]"),
        (lambda t: t.cache.ClearField("pid"), "shared tensor message without pid"),
        (lambda t: t.cache.ClearField("fd"), "without handle or fd"),
    ],
)
def test_a_broken_ipc_target_is_refused(change: Any, error: str) -> None:
    msg = target_to_pb(_cpu_target())
    change(msg)
    with pytest.raises(TransferError, match=error):
        target_from_pb(msg)
    sink = sink_to_pb(SinkInfo("r", "ipc://h:1", (1,), LAYOUT, 1.0, _cpu_target()), 0, "ipc")
    sink.target.CopyFrom(msg)
    with pytest.raises(ValueError, match="bad sink target"):
        sink_from_pb(sink)


def test_an_ipc_target_that_is_no_target_is_not_sent() -> None:
    with pytest.raises(TransferError, match="bad ipc target"):
        target_to_pb({**_cpu_target(), "extra": 1})
    with pytest.raises(TransferError, match="bad ipc target"):
        target_to_pb({**_cpu_target(), "cache": {**CUDA_DESC, "pid": "12"}})
