"""The gRPC/protobuf contracts (protos/): the committed generated code is what the .proto
files generate, and the check notices when it is not."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tandem.protos import generate, node_pb2, node_pb2_grpc


def test_the_generated_code_is_up_to_date() -> None:
    assert generate.stale() == [], "run `make protos` and commit the result"


def test_an_edited_proto_makes_the_generated_code_stale(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a copy of the package: a new field in node.proto, code not regenerated."""
    copy = tmp_path / "tandem"
    shutil.copytree(generate.ROOT / "protos", copy / "protos")
    proto = copy / "protos" / "node.proto"
    proto.write_text(proto.read_text().replace(
        "message AbortReply {\n  bool found = 1;\n}",
        "message AbortReply {\n  bool found = 1;\n  string why = 2;\n}"))
    monkeypatch.setattr(generate, "ROOT", copy)
    monkeypatch.setattr(generate, "PROTOS", copy / "protos")
    assert generate.stale() == ["node_pb2.py"]


def test_a_request_survives_the_wire() -> None:
    sampling = node_pb2.SamplingParams(temperature=0.0, max_tokens=8, stop=["\n"], seed=3)
    request = node_pb2.Request(request_id="r-1", prompt_token_ids=[1, 2, 3], sampling=sampling)
    back = node_pb2.Request.FromString(request.SerializeToString())
    assert back == request
    assert back.sampling.HasField("temperature") and not back.sampling.HasField("top_p")
    assert hasattr(node_pb2_grpc, "NodeStub") and hasattr(node_pb2_grpc, "NodeServicer")
