"""ClientSettings: precedence (flags > environment > config file > defaults), the TOML file, errors."""
from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from paramserver.client.cluster_view import ClusterOptions
from paramserver.client.config import ClientSettings, add_client_arguments, read_config_file, settings_from_args
from paramserver.client.errors import ConfigError


@pytest.fixture
def tls_files(tmp_path: Path) -> dict[str, Path]:
    files = {}
    for name in ("ca.pem", "client.pem", "client.key", "other.pem", "other.key"):
        kind = "PRIVATE KEY" if name.endswith(".key") else "CERTIFICATE"  # the markers settings check for
        (tmp_path / name).write_text(f"-----BEGIN {kind}-----\n")
        files[name] = tmp_path / name
    return files


def write_config(folder: Path, text: str, name: str = "client.toml") -> Path:
    path = folder / name
    path.write_text(text)
    return path


def parse(argv: list[str], *, write: bool = False) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_client_arguments(p, write=write)
    p.add_argument("--verify", default=None)
    p.add_argument("--no-bulk", action="store_true")
    p.add_argument("--timeout", type=float, default=None)
    return p.parse_args(argv)


def test_defaults_and_token_for() -> None:
    s = ClientSettings(cluster=("h:1",), admin_token="admin-1", read_token=None).validate()
    assert (s.verify, s.bulk, s.timeout_s, s.tls, s.use_bulk) == ("crc", True, 10.0, False, True)
    assert s.token_for(write=True) == "admin-1" and s.token_for(write=False) == "admin-1"  # admin works for reads
    s = ClientSettings(cluster=("h:1",), admin_token="admin-1", read_token="read-1")
    assert s.token_for(write=True) == "admin-1" and s.token_for(write=False) == "read-1"
    assert ClientSettings(cluster=("h:1",)).token_for(write=False) is None


def test_file_gives_everything_with_paths_relative_to_its_folder(tmp_path: Path, tls_files: dict[str, Path]) -> None:
    (tmp_path / "admin.token").write_text("admin-secret-1\n")
    (tmp_path / "read.token").write_text("read-secret-1")
    cfg = write_config(tmp_path, """
cluster = ["10.0.0.1:7000", "10.0.0.2:7000"]
admin_token_file = "admin.token"
read_token_file = "read.token"
tls_ca = "ca.pem"
tls_cert = "client.pem"
tls_key = "client.key"
verify = "content"
bulk = false
timeout_s = 4
""")
    s = ClientSettings.load({}, {"PARAMS_CONFIG": str(cfg)})
    assert s.cluster == ("10.0.0.1:7000", "10.0.0.2:7000")
    assert (s.admin_token, s.read_token) == ("admin-secret-1", "read-secret-1")
    assert (s.tls_ca, s.tls_cert, s.tls_key) == (tls_files["ca.pem"], tls_files["client.pem"], tls_files["client.key"])
    assert s.tls and not s.use_bulk
    assert (s.verify, s.bulk, s.timeout_s, s.config_file) == ("content", False, 4.0, cfg)


def test_precedence_flags_over_environment_over_file(tmp_path: Path, tls_files: dict[str, Path]) -> None:
    (tmp_path / "admin.token").write_text("file-admin-1")
    (tmp_path / "read.token").write_text("file-read-1")
    cfg = write_config(tmp_path, """
cluster = "file:1"
admin_token_file = "admin.token"
read_token_file = "read.token"
tls_ca = "ca.pem"
verify = "crc"
""")
    env = {"PARAMS_CONFIG": str(cfg)}
    s = settings_from_args(parse([]), env)
    assert (s.cluster, s.admin_token, s.read_token, s.tls_ca, s.verify) == (
        ("file:1",), "file-admin-1", "file-read-1", tls_files["ca.pem"], "crc")

    env |= {"PARAMS_CLUSTER": "env:1,env:2", "PARAMS_READ_TOKEN": "env-read-1", "PARAMS_VERIFY": "content",
            "PARAMS_TLS_CA": str(tls_files["other.pem"])}
    s = settings_from_args(parse([]), env)
    assert s.cluster == ("env:1", "env:2") and s.read_token == "env-read-1" and s.admin_token == "file-admin-1"
    assert s.verify == "content" and s.tls_ca == tls_files["other.pem"]

    s = settings_from_args(parse(["--cluster", "flag:1", "--token", "flag-read-1", "--verify", "crc", "--no-bulk",
                                  "--tls-ca", str(tls_files["ca.pem"]), "--timeout", "2.5"]), env)
    assert s.cluster == ("flag:1",) and s.read_token == "flag-read-1" and s.admin_token == "file-admin-1"
    assert (s.verify, s.bulk, s.tls_ca, s.timeout_s) == ("crc", False, tls_files["ca.pem"], 2.5)
    # --token is the admin token for a writing command
    s = settings_from_args(parse(["--token", "flag-admin-1"], write=True), env, write=True)
    assert s.admin_token == "flag-admin-1" and s.read_token == "env-read-1"
    assert s.token_for(write=True) == "flag-admin-1"

    # --config wins over PARAMS_CONFIG
    other = write_config(tmp_path, 'cluster = ["other:9"]\n', "other.toml")
    assert settings_from_args(parse(["--config", str(other)]), {"PARAMS_CONFIG": str(cfg)}).cluster == ("other:9",)


def test_defaults_argument_and_empty_environment_values() -> None:
    defaults = ClientSettings(cluster=("127.0.0.1:7000",), timeout_s=30.0)
    s = settings_from_args(parse([]), {"PARAMS_CLUSTER": "  ", "PARAMS_READ_TOKEN": ""}, defaults=defaults)
    assert s.cluster == ("127.0.0.1:7000",) and s.timeout_s == 30.0 and s.read_token is None


def test_cluster_options_and_client_config_carry_tls_and_the_right_token(tls_files: dict[str, Path]) -> None:
    s = ClientSettings(cluster=("h:1", "h:2"), admin_token="admin-1", read_token="read-1", tls_ca=tls_files["ca.pem"],
                       tls_cert=tls_files["client.pem"], tls_key=tls_files["client.key"], timeout_s=3.0).validate()
    w, r = s.cluster_options(write=True), s.cluster_options(write=False)
    assert isinstance(w, ClusterOptions) and w.seeds == ("h:1", "h:2") and w.token == "admin-1" and r.token == "read-1"
    assert (w.tls, w.tls_ca, w.tls_cert, w.tls_key, w.timeout_s) == (
        True, tls_files["ca.pem"], tls_files["client.pem"], tls_files["client.key"], 3.0)
    c = w.client_config("h:1")
    assert (c.tls, c.tls_ca, c.client_cert, c.client_key, c.token) == (
        True, tls_files["ca.pem"], tls_files["client.pem"], tls_files["client.key"], "admin-1")
    c = s.client_config("h:2", write=False, timeout_s=1.0)
    assert (c.address, c.token, c.timeout_s, c.client_cert) == ("h:2", "read-1", 1.0, tls_files["client.pem"])


@pytest.mark.parametrize("text, words", [
    ('cluster = ["h:1"]\nadmin_token = "secret"\n', ["unknown key", "admin_token", "admin_token_file"]),
    ('cluster = ["h:1"]\nverfy = "crc"\n', ["unknown key", "verfy"]),
    ('cluster = ["nohostport"]\n', ["HOST:PORT"]),
    ('cluster = 7\n', ["cluster must be a list"]),
    ('verify = "sha1"\n', ["verify must be one of"]),
    ('bulk = "yes"\n', ["bulk must be true or false"]),
    ('timeout_s = 0\n', ["timeout_s"]),
    ('cluster = [\n', ["not valid TOML"]),
    ('read_token_file = "missing.token"\n', ["read_token_file", "missing.token: cannot read it"]),
    ('tls_ca = "missing-ca.pem"\n', ["tls_ca", "missing-ca.pem", "does not exist"]),
    ('tls_cert = "client.pem"\n', ["tls_cert is set but tls_key is not"]),
])  # fmt: skip
def test_bad_config_files_are_clear_errors(tmp_path: Path, tls_files: dict[str, Path], text: str, words: list[str]) -> None:
    cfg = write_config(tmp_path, text)
    env = {"PARAMS_CONFIG": str(cfg)} if "cluster" in text else {"PARAMS_CONFIG": str(cfg), "PARAMS_CLUSTER": "h:1"}
    with pytest.raises(ConfigError) as info:
        ClientSettings.load({}, env)
    message = str(info.value)
    for word in words:
        assert word in message, (word, message)
    assert str(cfg) in message or "missing-ca.pem" in message or "tls_cert" in message


def test_token_file_must_hold_one_token(tmp_path: Path) -> None:
    (tmp_path / "t").write_text("two words\n")
    cfg = write_config(tmp_path, 'cluster = ["h:1"]\nadmin_token_file = "t"\n')
    with pytest.raises(ConfigError, match="one token"):
        read_config_file(cfg)
    (tmp_path / "t").write_text("\n")
    with pytest.raises(ConfigError, match="one token"):
        read_config_file(cfg)


def test_missing_config_file_and_cluster(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read client config file"):
        ClientSettings.load({}, {"PARAMS_CONFIG": str(tmp_path / "nope.toml")})
    with pytest.raises(ConfigError, match="no cluster address given.*PARAMS_CLUSTER.*PARAMS_CONFIG"):
        ClientSettings.load({}, {})


def test_tls_errors_name_the_file_and_where_it_came_from(tmp_path: Path, tls_files: dict[str, Path]) -> None:
    env = {"PARAMS_CLUSTER": "h:1"}
    with pytest.raises(ConfigError, match=r"tls_ca file .*absent\.pem \(from PARAMS_TLS_CA\) does not exist"):
        ClientSettings.load({}, env | {"PARAMS_TLS_CA": str(tmp_path / "absent.pem")})
    with pytest.raises(ConfigError, match=r"tls_cert file .*absent\.pem \(from --tls-cert\) does not exist"):
        ClientSettings.load({"tls_cert": tmp_path / "absent.pem", "tls_key": tls_files["client.key"]}, env)
    with pytest.raises(ConfigError, match="--tls-cert is given without --tls-key"):
        ClientSettings.load({"tls_cert": tls_files["client.pem"]}, env)
    with pytest.raises(ConfigError, match="PARAMS_TLS_KEY is given without PARAMS_TLS_CERT"):
        ClientSettings.load({}, env | {"PARAMS_TLS_KEY": str(tls_files["client.key"])})
    with pytest.raises(ConfigError, match="unknown client setting"):
        ClientSettings.load({"tls_certificate": "x"}, env)
    with pytest.raises(ConfigError, match="verify must be one of"):
        ClientSettings.load({}, env | {"PARAMS_VERIFY": "md5"})
    # A pair from a higher source replaces the file's pair as a whole.
    cfg = write_config(tmp_path, 'cluster = ["h:1"]\ntls_ca = "ca.pem"\ntls_cert = "client.pem"\ntls_key = "client.key"\n')
    s = ClientSettings.load({}, {"PARAMS_CONFIG": str(cfg), "PARAMS_TLS_CERT": str(tls_files["other.pem"]),
                                 "PARAMS_TLS_KEY": str(tls_files["other.key"])})
    assert (s.tls_cert, s.tls_key, s.tls_ca) == (tls_files["other.pem"], tls_files["other.key"], tls_files["ca.pem"])


def test_help_names_flags_environment_and_defaults() -> None:
    p = argparse.ArgumentParser()
    add_client_arguments(p, write=True, cluster_default="127.0.0.1:7000")
    text = p.format_help()
    for word in ("--cluster", "--token", "--config", "--tls-ca", "--tls-cert", "--tls-key", "PARAMS_CLUSTER", "PARAMS_ADMIN_TOKEN",
                 "PARAMS_READ_TOKEN", "PARAMS_CONFIG", "PARAMS_TLS_CA", "PARAMS_TLS_CERT", "PARAMS_TLS_KEY", "127.0.0.1:7000", "default"):
        assert word in text, word


def test_token_file_keeps_the_token_out_of_argv(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    add_client_arguments(parser, write=False)
    f = tmp_path / "read.token"
    f.write_text("tok-123\n")
    s = settings_from_args(parser.parse_args(["--cluster", "127.0.0.1:1", "--token-file", str(f)]), {})
    assert s.read_token == "tok-123"
    s = settings_from_args(parser.parse_args(["--cluster", "127.0.0.1:1", "--token", "tok-456"]), {})
    assert s.read_token == "tok-456"
    assert "--token-file" in parser.format_help()  # --token's help points at it
    f.write_text("two words")
    with pytest.raises(ConfigError, match="one token"):
        settings_from_args(parser.parse_args(["--cluster", "127.0.0.1:1", "--token-file", str(f)]), {})
    with pytest.raises(ConfigError, match="cannot read"):
        settings_from_args(parser.parse_args(["--cluster", "127.0.0.1:1", "--token-file", str(tmp_path / "nope")]), {})
    with pytest.raises(SystemExit):
        parser.parse_args(["--token", "a", "--token-file", str(f)])


def test_an_empty_token_is_refused_without_blaming_the_config_file(tmp_path: Path) -> None:
    """'--token ""' used to be reported as coming "(from client.toml)" when a config file was in use."""
    settings = ClientSettings(cluster=("127.0.0.1:1",), admin_token="", config_file=tmp_path / "client.toml")
    with pytest.raises(ConfigError) as info:
        settings.validate()
    text = str(info.value)
    assert "admin_token must be a non-empty string" in text and "--token" in text and "PARAMS_ADMIN_TOKEN" in text
    assert "(from " not in text


def test_a_tls_file_that_is_not_pem_is_refused_up_front(tmp_path: Path) -> None:
    """gRPC only logged "Could not load any root certificate" and then failed every call as UNAVAILABLE (exit 6)."""
    bogus = tmp_path / "ca.pem"
    bogus.write_text("not a certificate\n")
    with pytest.raises(ConfigError, match="tls_ca file .*ca.pem does not hold a PEM certificate"):
        ClientSettings(cluster=("127.0.0.1:1",), tls_ca=bogus).validate()
    key = tmp_path / "client.key"
    key.write_text("-----BEGIN CERTIFICATE-----\n")
    with pytest.raises(ConfigError, match="tls_key file .*client.key does not hold a PEM private key"):
        ClientSettings(cluster=("127.0.0.1:1",), tls_cert=key, tls_key=key).validate()
