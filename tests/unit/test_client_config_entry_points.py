"""The Python entry points read the CLIs' settings: arguments > environment > PARAMS_CONFIG file >
defaults (``paramserver.client.config.resolve_settings``), with no server needed: what each entry
point would connect with is captured before the first call."""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from paramserver.client import ClusterClient, pull, push
from paramserver.client.cluster_view import ClusterOptions
from paramserver.client.config import ClientSettings, resolve_settings, split_cluster_arg
from paramserver.client.errors import ConfigError
from paramserver.client.session import client_for

ENVS = ("PARAMS_CLUSTER", "PARAMS_ADMIN_TOKEN", "PARAMS_READ_TOKEN", "PARAMS_TLS_CA", "PARAMS_TLS_CERT", "PARAMS_TLS_KEY",
        "PARAMS_VERIFY", "PARAMS_CONFIG")


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ENVS:
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def config(tmp_path: Path) -> Path:
    """A client config as 'deploy.local up --tls' writes it: addresses, token files, TLS files."""
    (tmp_path / "tls").mkdir()
    for name, kind in (("ca.pem", "CERTIFICATE"), ("client.pem", "CERTIFICATE"), ("client.key", "PRIVATE KEY")):
        (tmp_path / "tls" / name).write_text(f"-----BEGIN {kind}-----\n")
    (tmp_path / "admin.token").write_text("file-admin\n")
    (tmp_path / "read.token").write_text("file-read\n")
    path = tmp_path / "client.toml"
    path.write_text('cluster = ["127.0.0.1:7000", "127.0.0.1:7002"]\nadmin_token_file = "admin.token"\n'
                    'read_token_file = "read.token"\ntls_ca = "tls/ca.pem"\ntls_cert = "tls/client.pem"\n'
                    'tls_key = "tls/client.key"\nverify = "content"\n')
    return path


class Captured(Exception):
    def __init__(self, **seen: Any) -> None:
        super().__init__("captured")
        self.seen = seen


def test_resolve_settings_precedence(config: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PARAMS_CONFIG", str(config))
    s = resolve_settings()
    assert s.cluster == ("127.0.0.1:7000", "127.0.0.1:7002") and s.tls_ca == config.parent / "tls" / "ca.pem"
    assert (s.token_for(write=True), s.token_for(write=False), s.verify) == ("file-admin", "file-read", "content")
    monkeypatch.setenv("PARAMS_READ_TOKEN", "env-read")
    monkeypatch.setenv("PARAMS_CLUSTER", "127.0.0.1:9000")
    s = resolve_settings()
    assert s.cluster == ("127.0.0.1:9000",) and s.token_for(write=False) == "env-read"  # environment > file
    s = resolve_settings("127.0.0.1:1", token="arg-read", verify="crc")
    assert (s.cluster, s.read_token, s.admin_token, s.verify) == (("127.0.0.1:1",), "arg-read", "file-admin", "crc")
    s = resolve_settings(["127.0.0.1:1"], token="arg-admin", write=True)  # the token of a write is the admin token
    assert (s.admin_token, s.read_token) == ("arg-admin", "env-read")
    given = ClientSettings(cluster=("127.0.0.1:5",), read_token="mine")
    assert resolve_settings(given) is given  # already resolved: no environment, no file
    assert resolve_settings(given, token="other", tls_ca=str(config.parent / "tls" / "ca.pem")).tls
    with pytest.raises(ConfigError, match="unknown client setting"):
        resolve_settings(tsl_ca="x")


def test_no_cluster_anywhere_says_where_to_give_one() -> None:
    with pytest.raises(ConfigError, match="PARAMS_CONFIG"):
        resolve_settings()
    with pytest.raises(ConfigError, match="no cluster address"):
        push({"w": torch.zeros(2)}, model="m")
    with pytest.raises(ConfigError, match="no cluster address"):
        ClusterClient()


def test_split_cluster_arg() -> None:
    assert split_cluster_arg("m:prod", None, what="ref") == (None, "m:prod")
    assert split_cluster_arg("h:1", "m:prod", what="ref") == ("h:1", "m:prod")
    assert split_cluster_arg("m:prod", "out.safetensors", None, what="ref and out") == (None, "m:prod", "out.safetensors")
    assert split_cluster_arg(None, "m:prod", "o", what="ref and out") == (None, "m:prod", "o")
    with pytest.raises(TypeError, match="missing argument"):
        split_cluster_arg(None, None, what="ref")


def test_push_takes_the_admin_token_and_tls_from_the_config(config: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    module = sys.modules["paramserver.client.push"]  # loaded by ``from paramserver.client import push``

    def for_options(options: ClusterOptions) -> None:  # push's one session, on the options it resolved
        raise Captured(options=options)

    monkeypatch.setattr(module.ClusterClient, "for_options", staticmethod(for_options))
    monkeypatch.setenv("PARAMS_CONFIG", str(config))
    state = {"w": torch.zeros(2)}
    with pytest.raises(Captured) as got:
        push(state, model="m")  # the cluster left out
    o = got.value.seen["options"]
    assert (o.seeds, o.token, o.tls_ca, o.tls_cert) == (
        ("127.0.0.1:7000", "127.0.0.1:7002"), "file-admin", config.parent / "tls" / "ca.pem", config.parent / "tls" / "client.pem")
    with pytest.raises(Captured) as got:
        push("127.0.0.1:1", state, model="m", token="arg")  # as before: explicit values win
    assert (got.value.seen["options"].seeds, got.value.seen["options"].token) == (("127.0.0.1:1",), "arg")
    mine = ClusterOptions(("127.0.0.1:2",), token="t")
    with pytest.raises(Captured) as got:
        push("127.0.0.1:1", state, model="m", cluster=mine)  # ClusterOptions are used as they are
    assert got.value.seen["options"] is mine


def test_pull_takes_tokens_tls_and_verify_from_the_config(config: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    module = sys.modules["paramserver.client.pull"]

    def client(**kwargs: Any) -> None:
        raise Captured(**kwargs)

    monkeypatch.setattr(module, "ClusterClient", client)
    monkeypatch.setenv("PARAMS_CONFIG", str(config))
    with pytest.raises(Captured) as got:
        pull("m:prod", tmp_path / "out.safetensors")
    seen = got.value.seen
    assert (seen["cluster"].token, seen["cluster"].tls_ca, seen["verify"]) == ("file-read", config.parent / "tls" / "ca.pem", "content")
    from paramserver.client.pull import PullOptions, pull_tensors

    with pytest.raises(Captured) as got:
        pull_tensors("127.0.0.1:1", "m:prod", token="arg", options=PullOptions(verify="crc"))
    seen = got.value.seen
    assert (seen["cluster"].seeds, seen["cluster"].token, seen["verify"]) == (("127.0.0.1:1",), "arg", "crc")


def test_cluster_client_reads_the_settings_unless_given_cluster_options(config: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PARAMS_CONFIG", str(config))
    with ClusterClient() as c:
        assert (c.options.seeds, c.options.token, c.options.tls_ca, c.verify) == (
            ("127.0.0.1:7000", "127.0.0.1:7002"), "file-read", config.parent / "tls" / "ca.pem", "content")
    with ClusterClient("127.0.0.1:1", token="arg", verify="crc") as c:  # explicit values win, the rest from the file
        assert (c.options.seeds, c.options.token, c.verify, c.options.tls_cert) == (
            ("127.0.0.1:1",), "arg", "crc", config.parent / "tls" / "client.pem")
    with ClusterClient(settings=resolve_settings(), verify="crc") as c:  # an explicit verify wins over the settings'
        assert (c.verify, c.options.token) == ("crc", "file-read")
    with ClusterClient(cluster=ClusterOptions(("127.0.0.1:2",))) as c:
        assert (c.options.token, c.options.tls_ca, c.verify) == (None, None, "crc")
    monkeypatch.delenv("PARAMS_CONFIG")
    with ClusterClient.from_config(config, token="override") as c:
        assert (c.options.seeds[0], c.options.token, c.options.tls) == ("127.0.0.1:7000", "override", True)
    with ClusterClient.from_config(config, cluster="127.0.0.1:3", verify="crc") as c:
        assert (c.options.seeds, c.verify, c.options.token) == (("127.0.0.1:3",), "crc", "file-read")
    with ClusterClient.from_config(cluster="127.0.0.1:3") as c:  # no file, no environment: the defaults
        assert (c.options.token, c.options.tls, c.verify) == (None, False, "crc")


def test_the_loaders_client_comes_from_the_same_settings(config: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PARAMS_CONFIG", str(config))
    client, owned = client_for(None)
    with client:
        assert owned and (client.options.seeds[0], client.options.token) == ("127.0.0.1:7000", "file-read")
    client, owned = client_for("127.0.0.1:1", token="arg")
    with client:
        assert (client.options.seeds, client.options.token, client.options.tls) == (("127.0.0.1:1",), "arg", True)
    again, owned = client_for(client)
    assert again is client and not owned
