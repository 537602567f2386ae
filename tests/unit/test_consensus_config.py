from __future__ import annotations

import dataclasses
import importlib.util
from pathlib import Path
from typing import Any

import pytest

from consensus.config import ConfigError, RaftConfig
from consensus.errors import Conflict, Invalid, NotFound
from consensus.replica import unwrap


def cfg(tmp_path: Path, **overrides: Any) -> RaftConfig:
    base = RaftConfig("n1", "127.0.0.1:7001", ("127.0.0.1:7002", "127.0.0.1:7003"), tmp_path / "n1")
    return dataclasses.replace(base, **overrides)


def test_defaults_are_valid_and_files_live_in_data_dir(tmp_path: Path) -> None:
    c = cfg(tmp_path)
    c.validate()
    assert c.journal_file.parent == c.dump_file.parent == tmp_path / "n1"
    assert c.election_min_timeout > 3 * c.append_entries_period


@pytest.mark.parametrize("overrides,needle", [
    ({"server_id": "bad/id"}, "server_id"),
    ({"raft_address": "nohost"}, "raft_address"),
    ({"peers": ("127.0.0.1:7001",)}, "other members"),
    ({"peers": ("127.0.0.1:7002", "127.0.0.1:7002")}, "twice"),
    ({"peers": ["127.0.0.1:7002"]}, "tuple"),
    ({"data_dir": "/tmp/x"}, "pathlib"),
    ({"secret": ""}, "secret"),
    ({"election_min_timeout": 0.15}, "3 x append_entries_period"),
    ({"election_max_timeout": 0.3}, "greater than election_min_timeout"),
    ({"connection_timeout": 0.5}, "at least election_max_timeout"),
    ({"link_keepalive_period": 2.0}, "half of connection_timeout"),
    ({"commit_timeout": 0}, "commit_timeout"),
    ({"connection_retry": -1}, "connection_retry"),
    ({"tcp_keepalive": (1, 1)}, "tcp_keepalive"),
    ({"leader_fallback_timeout": 0.01}, "leader_fallback_timeout"),
    ({"log_compaction_min_entries": 1}, "log_compaction_min_entries"),
])
def test_validate_names_the_field(tmp_path: Path, overrides: dict[str, Any], needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        cfg(tmp_path, **overrides).validate()


def test_config_error_is_invalid(tmp_path: Path) -> None:
    with pytest.raises(Invalid):
        cfg(tmp_path, server_id="").validate()


def test_data_dir_must_not_be_a_file(tmp_path: Path) -> None:
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(ConfigError, match="not a directory"):
        cfg(tmp_path, data_dir=f).validate()


def test_secret_without_cryptography_says_what_to_install(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # cryptography is a dependency, but an environment that lost it must get advice, not a traceback.
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "cryptography" else real(name, *a))
    with pytest.raises(ConfigError, match="pip install cryptography"):
        cfg(tmp_path, secret="s3cret").validate()
    monkeypatch.undo()
    cfg(tmp_path, secret="s3cret").validate()


def test_outcomes_unwrap_to_typed_errors() -> None:
    assert unwrap(("ok", {"a": 1})) == {"a": 1}
    with pytest.raises(Conflict, match="both"):
        unwrap(("error", "Conflict", "both"))
    with pytest.raises(NotFound):
        unwrap(("error", "NotFound", "x"))
    with pytest.raises(Invalid):
        unwrap(("error", "Invalid", "x"))


def test_consensus_imports_neither_grpc_nor_torch() -> None:
    import subprocess
    import sys
    code = "import sys, consensus, consensus.node, consensus.devnode; print('grpc' in sys.modules, 'torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]
