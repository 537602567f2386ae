from __future__ import annotations

import json
from pathlib import Path

import pytest

from paramserver.server.config import ServerConfig
from paramserver.wire.errors import ConfigError


def base(tmp_path: Path, **kw: object) -> ServerConfig:
    return ServerConfig(server_id="ps1", data_dir=tmp_path, **kw)  # type: ignore[arg-type]


def test_defaults_validate_and_quorum(tmp_path: Path) -> None:
    cfg = base(tmp_path).validate()
    assert cfg.replication_factor == 3 and cfg.write_quorum is None
    assert cfg.effective_write_quorum(5) == 2
    assert cfg.effective_write_quorum(1) == 1
    assert base(tmp_path, write_quorum=3).effective_write_quorum(2) == 2
    assert cfg.advertise_address == cfg.listen


@pytest.mark.parametrize(
    "kw, fragment",
    [
        ({"server_id": ""}, "server_id"),
        ({"listen": "nope"}, "HOST:PORT"),
        ({"write_quorum": 4}, "write_quorum"),
        ({"replication_factor": 0}, "replication_factor"),
        ({"read_token": "read-token-1"}, "admin_token"),
        ({"admin_token": "short"}, "at least 8"),
        ({"tls_cert": Path("/nonexistent.pem")}, "tls_cert and tls_key"),
        ({"max_message_bytes": 1024}, "max_message_bytes"),
        ({"peers": ("127.0.0.1:7100",)}, "own raft address"),
        ({"scrub_busy_fraction": 1.5}, "scrub_busy_fraction"),
        ({"scrub_quiet_s": -1.0}, "scrub_quiet_s"),
    ],
)
def test_invalid_configs_say_what_to_fix(tmp_path: Path, kw: dict[str, object], fragment: str) -> None:
    data = {"server_id": "ps1", "data_dir": tmp_path, **kw}
    with pytest.raises(ConfigError, match=fragment):
        ServerConfig(**data).validate()  # type: ignore[arg-type]


def test_from_toml_and_json_with_overrides(tmp_path: Path) -> None:
    toml = tmp_path / "ps.toml"
    toml.write_text(
        '[server]\nserver_id = "ps2"\ndata_dir = "/tmp/ps2"\nlisten = "127.0.0.1:7002"\n'
        'peers = ["127.0.0.1:7101", "127.0.0.1:7102"]\nzone = "rack-a"\ncache_bytes = 1048576\nmetrics_port = 9100\n'
    )
    cfg = ServerConfig.from_file(toml, listen="127.0.0.1:7009", zone=None)
    assert cfg.server_id == "ps2" and cfg.data_dir == Path("/tmp/ps2")
    assert cfg.peers == ("127.0.0.1:7101", "127.0.0.1:7102") and cfg.zone == "rack-a"
    assert cfg.listen == "127.0.0.1:7009"  # override wins, None is ignored
    assert cfg.extra == {"metrics_port": 9100}
    js = tmp_path / "ps.json"
    js.write_text(json.dumps({"server_id": "ps3", "data_dir": "/tmp/ps3", "peers": "127.0.0.1:7101,127.0.0.1:7102"}))
    assert ServerConfig.from_file(js).peers == ("127.0.0.1:7101", "127.0.0.1:7102")


def test_bad_files_are_named(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        ServerConfig.from_file(tmp_path / "missing.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("server_id = ")
    with pytest.raises(ConfigError, match="not valid TOML"):
        ServerConfig.from_file(bad)
    nodir = tmp_path / "nodir.json"
    nodir.write_text('{"server_id": "x"}')
    with pytest.raises(ConfigError, match="data_dir"):
        ServerConfig.from_file(nodir)


def test_an_unknown_config_key_is_refused_naming_the_closest_one(tmp_path: Path) -> None:
    """A misspelt key used to be kept in ``extra`` and never read: its default stayed in force, silently."""
    import subprocess
    import sys

    config = tmp_path / "ps.toml"
    config.write_text(f'server_id = "ps1"\ndata_dir = "{tmp_path / "d"}"\ncache-mb = 5\nwrite_stream_idle = 4\nhot_rate = 2.0\n')
    done = subprocess.run([sys.executable, "-m", "paramserver", "serve", "--config", str(config)], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.count("\n") == 1 and "'cache-mb' (did you mean 'cache_bytes'?)" in done.stderr
    assert "'write_stream_idle' (did you mean 'write_stream_idle_s'?)" in done.stderr and "hot_rate" not in done.stderr
    assert not (tmp_path / "d").exists()  # refused before anything started


def test_the_shipped_server_configs_use_only_known_keys() -> None:
    import tomllib

    import yaml

    from paramserver.server.cli import check_extra_keys

    root = Path(__file__).resolve().parents[2] / "deploy"
    texts = [text for doc in yaml.safe_load_all((root / "k8s" / "10-paramserver-config.yaml").read_text())
             for text in (doc.get("data") or {}).values()]
    texts.append((root / "systemd" / "paramserver.toml.example").read_text())
    assert len(texts) >= 4
    for text in texts:
        values = {k: v for k, v in tomllib.loads(text).items() if not k.endswith("_file")}  # secrets: files absent here
        check_extra_keys(ServerConfig.from_mapping(values, insecure=True))  # insecure: the secrets were left out
