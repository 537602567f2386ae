#!/usr/bin/env python
"""Regenerate the committed gRPC stubs from paramserver/wire/proto/paramserver.proto.

Usage: python scripts/gen_proto.py [--out DIR]

grpc_tools writes ``import paramserver_pb2`` into the grpc module, which only
works with the proto folder on sys.path; we rewrite it to a relative import so
``paramserver.proto.paramserver_pb2_grpc`` imports as part of the package.
tests/unit/test_paramserver_proto.py regenerates into a temp dir and compares,
so the committed files never drift from the .proto.
"""
from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

PROTO_DIR = Path(__file__).resolve().parent.parent / "paramserver" / "wire" / "proto"
PROTO_NAME = "paramserver.proto"
GENERATED = ("paramserver_pb2.py", "paramserver_pb2.pyi", "paramserver_pb2_grpc.py")


def generate(out_dir: Path) -> list[Path]:
    from grpc_tools import protoc  # dev dependency: pip install grpcio-tools
    import grpc_tools

    out_dir.mkdir(parents=True, exist_ok=True)
    include = Path(grpc_tools.__file__).parent / "_proto"
    rc = protoc.main(
        [
            "grpc_tools.protoc",
            f"-I{PROTO_DIR}",
            f"-I{include}",
            f"--python_out={out_dir}",
            f"--pyi_out={out_dir}",
            f"--grpc_python_out={out_dir}",
            str(PROTO_DIR / PROTO_NAME),
        ]
    )
    if rc != 0:
        raise SystemExit(f"protoc failed with exit code {rc}; fix {PROTO_DIR / PROTO_NAME} and rerun")
    grpc_file = out_dir / "paramserver_pb2_grpc.py"
    text = grpc_file.read_text()
    text = re.sub(r"^import paramserver_pb2 as", "from . import paramserver_pb2 as", text, flags=re.M)
    grpc_file.write_text(text)
    return [out_dir / name for name in GENERATED]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=PROTO_DIR, help=f"output folder (default {PROTO_DIR})")
    args = parser.parse_args(argv)
    for path in generate(args.out):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
