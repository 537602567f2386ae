"""Server configuration of the bulk read port: defaults, validation, TLS turns it off, CLI flags."""
from __future__ import annotations

from pathlib import Path

import pytest

from paramserver.server.cli import _overrides, _parser
from paramserver.server.config import ServerConfig
from paramserver.wire.errors import ConfigError
from paramserver.client.pull import PullOptions


def config(tmp_path: Path, **kw: object) -> ServerConfig:
    return ServerConfig(server_id="ps1", data_dir=tmp_path, listen="10.1.2.3:7000", admin_token="admin-token-1", **kw).validate()  # type: ignore[arg-type]


def test_default_is_on_with_a_free_port_on_the_grpc_host(tmp_path: Path) -> None:
    cfg = config(tmp_path)
    assert cfg.bulk_enabled and cfg.bulk_listen_address == "10.1.2.3:0"
    assert config(tmp_path, bulk_listen="0.0.0.0:7400").bulk_listen_address == "0.0.0.0:7400"


def test_tls_turns_bulk_off(tmp_path: Path) -> None:
    cert, key = tmp_path / "c.pem", tmp_path / "k.pem"
    cert.write_text("x")
    key.write_text("y")
    assert not config(tmp_path, tls_cert=cert, tls_key=key).bulk_enabled
    assert not config(tmp_path, bulk=False).bulk_enabled


def test_bad_bulk_listen_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="bulk_listen must be HOST:PORT"):
        config(tmp_path, bulk_listen="nowhere")


def test_cli_flags(tmp_path: Path) -> None:
    args = _parser().parse_args(["serve", "--id", "ps1", "--data-dir", str(tmp_path), "--bulk-listen", "127.0.0.1:7401", "--no-bulk"])
    o = _overrides(args)
    assert o["bulk_listen"] == "127.0.0.1:7401" and o["bulk"] is False
    o = _overrides(_parser().parse_args(["serve", "--id", "ps1", "--data-dir", str(tmp_path)]))
    assert "bulk" not in o and o["bulk_listen"] is None


def test_pull_defaults_to_crc_verification_over_bulk() -> None:
    options = PullOptions().validate()
    assert options.verify == "crc" and options.bulk and options.bulk_streams_per_server == 1
    with pytest.raises(ConfigError, match="bulk_streams_per_server"):
        PullOptions(bulk_streams_per_server=0).validate()
