"""Generate the Python code of the gRPC/protobuf contracts (`protos/*.proto`) into
`protos/`: `*_pb2.py` (messages) and `*_pb2_grpc.py` (service stubs), committed.

    make protos                              # after editing a .proto
    python -m tandem.protos.generate --check # exit 1 if the committed code is stale

The code is generated as `tandem.protos.*`, so the stubs import the messages by their
package path. The output depends on the grpcio-tools version, pinned in pyproject.toml's
test extra.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from importlib import resources
from pathlib import Path

from grpc_tools import protoc

PROTOS = Path(__file__).resolve().parent
ROOT = PROTOS.parent  # the package `tandem`


def generate(out: Path) -> list[Path]:
    """Write the generated code for every .proto into `out`/tandem/protos; its files."""
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "tandem").symlink_to(ROOT)  # so the code is generated as tandem.protos
        sources = [f"tandem/protos/{p.name}" for p in sorted(PROTOS.glob("*.proto"))]
        well_known = resources.files("grpc_tools") / "_proto"
        rc = protoc.main(["grpc_tools.protoc", f"-I{tmp}", f"-I{well_known}",
                          f"--python_out={out}", f"--grpc_python_out={out}", *sources])
    if rc != 0:
        raise RuntimeError(f"protoc failed ({rc}) on {sources}")
    return sorted((out / "tandem" / "protos").glob("*_pb2*.py"))


def stale() -> list[str]:
    """The generated files that differ from what the .proto files generate now."""
    with tempfile.TemporaryDirectory() as tmp:
        fresh = {p.name: p.read_text() for p in generate(Path(tmp))}
    committed = {p.name: p.read_text() for p in PROTOS.glob("*_pb2*.py")}
    names = sorted(fresh.keys() | committed.keys())
    return [n for n in names if fresh.get(n) != committed.get(n)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n".join(__doc__.splitlines()[1:]))
    p.add_argument("--check", action="store_true",
                   help="change nothing; exit 1 if the committed code is stale")
    args = p.parse_args()
    if args.check:
        if bad := stale():
            sys.exit(f"stale generated code: {', '.join(bad)}; run `make protos`")
        print("generated code is up to date")
        return
    with tempfile.TemporaryDirectory() as tmp:
        for path in generate(Path(tmp)):
            (PROTOS / path.name).write_text(path.read_text())
            print(f"wrote protos/{path.name}")


if __name__ == "__main__":
    main()
