"""The committed stubs match the .proto, and the contract has every RPC the cluster needs."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PROTO_DIR = ROOT / "paramserver" / "wire" / "proto"


def _load_generator():
    spec = importlib.util.spec_from_file_location("gen_proto", ROOT / "scripts" / "gen_proto.py")
    module = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    spec.loader.exec_module(module)
    return module


def test_committed_stubs_match_proto(tmp_path: Path) -> None:
    pytest.importorskip("grpc_tools")
    gen = _load_generator()
    for fresh in gen.generate(tmp_path):
        committed = PROTO_DIR / fresh.name
        assert committed.exists(), f"{committed} missing: run python scripts/gen_proto.py"
        drift = f"{committed.name} drifted from paramserver.proto: run python scripts/gen_proto.py"
        assert committed.read_bytes() == fresh.read_bytes(), drift


def test_grpc_module_imports_as_package() -> None:
    from paramserver.wire.proto import pb, pb_grpc

    assert "from . import paramserver_pb2" in (PROTO_DIR / "paramserver_pb2_grpc.py").read_text()
    assert pb_grpc.paramserver__pb2 is pb
    assert "paramserver_pb2" not in sys.modules  # no top-level module leaked onto sys.path


def test_contract_lists_every_rpc() -> None:
    from paramserver.wire.proto import pb

    service = pb.DESCRIPTOR.services_by_name["ParamServer"]
    assert pb.DESCRIPTOR.package == "pdparams.v1"
    methods = {m.name: m for m in service.methods}
    expected = {
        "ClusterInfo", "PutChunks", "GetChunks", "HasChunks", "CommitVersion", "GetManifest", "ResolveTag",
        "GetVersion", "ListModels", "ListVersions", "ListTags", "SetTag", "RollbackTag", "DeleteTag",
        "AddMember", "RemoveMember", "ServerStatus", "ReportCorrupt", "ReportHeat", "GetHeat",
    }  # fmt: skip
    assert expected <= set(methods)
    assert methods["PutChunks"].client_streaming and not methods["PutChunks"].server_streaming
    assert methods["GetChunks"].server_streaming and not methods["GetChunks"].client_streaming


def test_version_carries_vector_clock_and_read_info() -> None:
    from paramserver.wire.proto import pb

    v = pb.Version(model="m", number=3, clock={"alice": 2, "bob": 1})
    assert not v.HasField("parent")
    v.parent = 0  # version 0 as parent must be distinguishable from "no parent"
    assert v.HasField("parent")
    reply = pb.VersionReply(version=v, read=pb.ReadInfo(commit_index=42, server_id="ps1"))
    back = pb.VersionReply.FromString(reply.SerializeToString())
    assert dict(back.version.clock) == {"alice": 2, "bob": 1}
    assert back.read.commit_index == 42
