"""The one adapter between the KV transfer protocol's messages as they travel
(`protos/transfer.proto`) and as the transfer service holds them: a frame's header is a
dict (`Header`) whose `kind` names one of the envelope's messages and whose other keys
are exactly that message's fields; the ipc connector's sink target (`SinkInfo.target`)
is a dict too, as `ipc_mapping.export` and `ipc.Target.open` know it. No other module
imports the generated classes (`node/convert.py` puts the target's message into the node
service's Sink through `target_to_pb` / `target_from_pb`).

Both ways are checked: `encode` refuses a header with a field its kind does not have,
one of the wrong type or lacking one its kind requires; `decode` refuses bytes that are
no envelope, an envelope of no kind this version knows, a message with an unknown or
mistyped field (protobuf keeps one whose wire type is not the field's as unknown), or one
lacking a required field. Every refusal is a TransferError, raised before the caller
allocates anything for the frame. Nothing here unpickles or parses JSON.

A header's `dtype` and `shape` (only a layer's) describe the payload that follows it;
`next` (a begin's or a layer's) is the header of the next planned layer message, one
level deep. A `written` message's `sinks` is a list of dicts, one per sink; a done's
`more` (a list of request ids, absent if none) answers the others of one.
"""

from __future__ import annotations

from typing import Any

from google.protobuf import unknown_fields
from google.protobuf.message import DecodeError, Message

from tandem.kvtransfer.connector import TransferError
from tandem.protos import transfer_pb2 as pb

Header = dict[str, Any]

BEGIN, ACCEPT, LAYER, END, DONE, ABORT = "begin", "accept", "layer", "end", "done", "abort"
WRITTEN = "written"  # ipc: whole pushes' begin, layers and end, many at once
NCCL_HELLO, NCCL_WELCOME = "nccl_hello", "nccl_welcome"  # the nccl connector's own

# Per kind (the envelope's oneof field of that name): its scalar fields, required and
# optional. The nested ones: a begin's `layout` (required), `writer` and `next`; a
# layer's `shape` (with its `dtype`) and `next`.
_SCALARS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    BEGIN: (("request_id", "num_blocks"), ("auth",)),
    ACCEPT: (("request_id",), ()),
    LAYER: (("request_id", "layer"), ("layers", "dtype")),
    END: (("request_id",), ("first_token",)),
    DONE: (("request_id",), ()),
    ABORT: (("request_id",), ("reason", "error", "auth")),
    NCCL_HELLO: (("backend",), ("nonce", "at", "auth")),
    NCCL_WELCOME: (("store_port", "pair"), ()),
    WRITTEN: (("pid",), ()),
}
_NESTED = {BEGIN: ("layout", "writer", "next"), LAYER: ("shape", "next"),
           WRITTEN: ("layout", "sinks"), DONE: ("more",)}
# A written message's sinks (at least one): each a dict of these, the first three required.
_WRITTEN_SINK = (("request_id", "num_blocks", "first_token"), ("auth", "event"))
KINDS = tuple(_SCALARS)
_LAYOUT_FIELDS = tuple(f.name for f in pb.Layout.DESCRIPTOR.fields)
# ipc_mapping.export's description of a tensor: scalars (all required), then the rest.
_SHARED_SCALARS = ("host", "pid", "dtype", "device", "offset", "size")
_SHARED_MEMORY = ("handle", "fd")  # exactly one: cuda's handle or cpu's fd
_TARGET_FIELDS = ("cache", "tags", "layout", "ticket")


# -- frame headers -----------------------------------------------------------------------


def encode(header: Header) -> bytes:
    """`header` as an envelope's bytes; TransferError unless it is a message of its kind."""
    kind = header.get("kind")
    if kind not in _SCALARS:
        raise TransferError(f"no transfer message of kind {kind!r}")
    envelope = pb.Envelope()
    try:
        _header_to_pb(kind, header, getattr(envelope, kind))
    except (TypeError, ValueError, KeyError, AttributeError) as exc:
        raise TransferError(f"bad {kind} header {header!r}: {exc!r}") from None
    return envelope.SerializeToString()


def decode(raw: bytes | bytearray | memoryview) -> Header:
    """The header an envelope's bytes carry; TransferError unless it is a whole,
    well-typed message of a known kind with every field its kind requires."""
    envelope = pb.Envelope()
    try:
        envelope.ParseFromString(bytes(raw))
    except DecodeError as exc:
        raise TransferError(f"frame header is not a transfer message: {exc}") from None
    kind = envelope.WhichOneof("kind")
    if kind is None:
        raise TransferError("frame header is a transfer message of no known kind")
    if _has_unknown(envelope):
        raise TransferError(f"frame header is a {kind} message with unknown or mistyped fields")
    return _header_from_pb(kind, getattr(envelope, kind))


def _header_to_pb(kind: str, header: Header, msg: Message, top: bool = True) -> None:
    required, optional = _SCALARS[kind]
    nested = _NESTED.get(kind, ()) if top else ("shape",)
    if extra := header.keys() - {"kind", *required, *optional, *nested}:
        raise ValueError(f"no fields {sorted(extra)} in a {kind} message")
    if missing := [name for name in required if header.get(name) is None]:
        raise ValueError(f"missing {missing}")
    for name in (*required, *optional):
        if header.get(name) is not None:
            setattr(msg, name, header[name])
    if "layout" in header:
        msg.layout.CopyFrom(pb.Layout(**header["layout"]))
    if header.get("writer") is not None:
        writer = header["writer"]
        msg.writer.pid = writer["pid"]
        if writer.get("event") is not None:
            msg.writer.event = writer["event"]
    if ("shape" in header) != ("dtype" in header):
        raise ValueError("a payload's dtype and shape go together")
    if "shape" in header:
        msg.shape.extend(header["shape"])
    if header.get("more"):
        msg.more.extend(header["more"])
    if kind == WRITTEN:
        if not header.get("sinks"):
            raise ValueError("a written message names no sink")
        for sink in header["sinks"]:
            if extra := sink.keys() - {*_WRITTEN_SINK[0], *_WRITTEN_SINK[1]}:
                raise ValueError(f"no fields {sorted(extra)} in a written sink")
            if missing := [name for name in _WRITTEN_SINK[0] if sink.get(name) is None]:
                raise ValueError(f"a written sink without {missing}")
            entry = msg.sinks.add()
            for name, value in sink.items():
                if value is not None:
                    setattr(entry, name, value)
    if "next" in header:
        if header["next"].get("kind") != LAYER:
            raise ValueError("`next` announces a layer message")
        _header_to_pb(LAYER, header["next"], msg.next, top=False)


def _header_from_pb(kind: str, msg: Message, top: bool = True) -> Header:
    required, optional = _SCALARS[kind]
    header: Header = {"kind": kind, **_scalars(msg, required, optional, kind)}
    if kind in (BEGIN, WRITTEN):
        if not msg.HasField("layout"):
            raise TransferError(f"a {kind} message without layout")
        header["layout"] = {name: getattr(msg.layout, name) for name in _LAYOUT_FIELDS}
    if kind == BEGIN and msg.HasField("writer"):
        header["writer"] = _writer_from_pb(msg.writer)
    if kind == WRITTEN:
        if not msg.sinks:
            raise TransferError("a written message without sinks")
        header["sinks"] = [_scalars(sink, *_WRITTEN_SINK, "written sink") for sink in msg.sinks]
    if kind == DONE and msg.more:
        header["more"] = list(msg.more)
    if kind == LAYER:
        if "dtype" in header:
            header["shape"] = list(msg.shape)
        elif msg.shape:
            raise TransferError("a layer message with a payload shape but no dtype")
    if kind in (BEGIN, LAYER) and msg.HasField("next"):
        if not top:
            raise TransferError("a `next` announced inside a `next`")
        header["next"] = _header_from_pb(LAYER, msg.next, top=False)
    return header


def _writer_from_pb(msg: pb.Writer) -> dict[str, Any]:
    if not msg.HasField("pid"):
        raise TransferError("an ipc writer without pid")
    return {"pid": msg.pid, "event": msg.event if msg.HasField("event") else None}


def _scalars(msg: Message, required: tuple[str, ...], optional: tuple[str, ...],
             what: str) -> dict[str, Any]:
    """The scalar fields `msg` has; TransferError if one of `required` is missing."""
    out = {}
    for name in (*required, *optional):
        if msg.HasField(name):
            out[name] = getattr(msg, name)
        elif name in required:
            raise TransferError(f"a {what} message without {name}")
    return out


def _has_unknown(msg: Message) -> bool:
    """Whether `msg` or a message in it holds a field this version does not know, or one
    whose wire type was not its field's (protobuf keeps both as unknown)."""
    if len(unknown_fields.UnknownFieldSet(msg)):
        return True
    return any(field.message_type is not None and any(
        _has_unknown(item) for item in (value if field.is_repeated else (value,)))
        for field, value in msg.ListFields())


# -- the ipc sink target (SinkInfo.target) -------------------------------------------------


def target_to_pb(target: dict[str, Any]) -> pb.IpcTarget:
    """The ipc connector's sink target as the node service's Sink carries it."""
    try:
        if extra := target.keys() - set(_TARGET_FIELDS):
            raise ValueError(f"no fields {sorted(extra)} in an ipc target")
        return pb.IpcTarget(cache=_shared_to_pb(target["cache"]),
                            tags=_shared_to_pb(target["tags"]),
                            layout=pb.Layout(**target["layout"]), ticket=target["ticket"])
    except (TypeError, ValueError, KeyError, AttributeError) as exc:
        raise TransferError(f"bad ipc target: {exc!r}") from None


def target_from_pb(msg: pb.IpcTarget) -> dict[str, Any]:
    """The sink target a Sink message carries; TransferError unless it is whole."""
    if _has_unknown(msg):
        raise TransferError("an ipc target with unknown or mistyped fields")
    if missing := [name for name in _TARGET_FIELDS if not msg.HasField(name)]:
        raise TransferError(f"an ipc target without {missing}")
    return {"cache": _shared_from_pb(msg.cache), "tags": _shared_from_pb(msg.tags),
            "layout": {name: getattr(msg.layout, name) for name in _LAYOUT_FIELDS},
            "ticket": msg.ticket}


def _shared_to_pb(desc: dict[str, Any]) -> pb.SharedTensor:
    if extra := desc.keys() - {*_SHARED_SCALARS, *_SHARED_MEMORY, "shape", "stride"}:
        raise ValueError(f"no fields {sorted(extra)} in a shared tensor")
    return pb.SharedTensor(**desc)


def _shared_from_pb(msg: pb.SharedTensor) -> dict[str, Any]:
    desc = _scalars(msg, _SHARED_SCALARS, (), "shared tensor")
    memory = msg.WhichOneof("memory")
    if memory is None:
        raise TransferError("a shared tensor without handle or fd")
    return {**desc, memory: getattr(msg, memory), "shape": list(msg.shape),
            "stride": list(msg.stride)}
