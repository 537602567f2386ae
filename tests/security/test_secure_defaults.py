"""Secure by default: a server on a non-loopback address needs a cluster secret and an admin token,
secrets never travel on a command line, and the launcher keeps them in 0600 files.

The non-loopback cases run a real ``paramserver serve`` inside a network namespace the test
creates (root, iproute2), on that namespace's own address.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import pytest

from deploy.local import LocalCluster, LocalClusterConfig
from deploy.netns import NetnsConfig, NetnsTopology, netns_available
from paramserver.server.config import ServerConfig, is_loopback_host
from paramserver.server.errors import ConfigError

SECRET = "a-cluster-secret-of-some-length"
ADMIN = "admin-token-for-the-test"


def _clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("PARAMS_")}


def _private(path: Path, text: str) -> Path:
    path.write_text(text + "\n")
    path.chmod(0o600)
    return path


# ---------------------------------------------------------------- pure config


@pytest.mark.parametrize("host,loopback", [
    ("127.0.0.1", True), ("127.3.4.5", True), ("localhost", True), ("::1", True), ("[::1]", True),
    ("0.0.0.0", False), ("::", False), ("", False), ("10.1.2.3", False), ("ps1.example", False),
])  # fmt: skip
def test_loopback_means_loopback_only(host: str, loopback: bool) -> None:
    assert is_loopback_host(host) is loopback


def test_config_refuses_open_ports_off_loopback(tmp_path: Path) -> None:
    base = dict(server_id="ps1", data_dir=tmp_path, listen="10.9.9.9:7000", raft="10.9.9.9:7100")
    with pytest.raises(ConfigError, match="--cluster-secret-file"):
        ServerConfig(**base, admin_token=ADMIN).validate()  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="--admin-token-file"):
        ServerConfig(**base, cluster_secret=SECRET).validate()  # type: ignore[arg-type]
    ok = ServerConfig(**base, cluster_secret=SECRET, admin_token=ADMIN).validate()  # type: ignore[arg-type]
    assert ok.open_to_network() == []
    open_anyway = ServerConfig(**base, insecure=True).validate()  # type: ignore[arg-type]
    # Raft, gRPC and the bulk port (on the --listen host by default), each named by its flag
    gaps = open_anyway.open_to_network()
    assert [g.split("(")[1].split()[0] for g in gaps] == ["--raft", "--listen", "--bulk-listen"], gaps
    # loopback needs nothing: a laptop's cluster starts as before
    ServerConfig(server_id="ps1", data_dir=tmp_path).validate()


def test_every_listener_is_under_the_one_rule(tmp_path: Path) -> None:
    """Bulk and metrics ports too (issue 41): a non-loopback --bulk-listen took chunk writes from
    anyone while --listen and --raft were loopback."""
    local = dict(server_id="ps1", data_dir=tmp_path)
    with pytest.raises(ConfigError, match="--bulk-listen 10.9.9.9:7300") as info:
        ServerConfig(**local, bulk_listen="10.9.9.9:7300").validate()  # type: ignore[arg-type]
    assert "--admin-token-file" in str(info.value) and "--insecure" in str(info.value)
    ServerConfig(**local, bulk_listen="10.9.9.9:7300", admin_token=ADMIN).validate()  # type: ignore[arg-type]
    ServerConfig(**local, bulk_listen="10.9.9.9:7300", bulk=False).validate()  # type: ignore[arg-type]  # off: no listener
    warned = ServerConfig(**local, bulk_listen="10.9.9.9:7300", insecure=True).validate()  # type: ignore[arg-type]
    assert any("--bulk-listen" in line for line in warned.check_exposure())
    # metrics: the read token, checked on the --listen host
    net = dict(local, listen="10.9.9.9:7000", admin_token=ADMIN)
    with pytest.raises(ConfigError, match="--metrics-port") as info:
        ServerConfig(**net, extra={"metrics_port": 9100}).validate()  # type: ignore[arg-type]
    assert "--read-token-file" in str(info.value)
    ServerConfig(**net, read_token="read-token-x", extra={"metrics_port": 9100}).validate()  # type: ignore[arg-type]
    ServerConfig(**local, extra={"metrics_port": 9100}).validate()  # type: ignore[arg-type]  # loopback


def test_metrics_need_the_read_token_when_one_is_set() -> None:
    import json
    import socket
    import urllib.error
    import urllib.request

    from prometheus_client.core import GaugeMetricFamily

    from paramserver.server.metrics import serve_metrics

    class One:
        def collect(self) -> Iterator[GaugeMetricFamily]:
            yield GaugeMetricFamily("paramserver_test_gauge", "a gauge", value=1.0)

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = serve_metrics(port, "127.0.0.1", One(), tokens=("read-token-m", "admin-token-m"))  # type: ignore[arg-type]
    try:
        def get(token: str | None) -> tuple[int, str]:
            req = urllib.request.Request(f"http://127.0.0.1:{port}/metrics",
                                         headers={"Authorization": f"Bearer {token}"} if token else {})
            try:
                with urllib.request.urlopen(req, timeout=10) as r:
                    return r.status, r.read().decode()
            except urllib.error.HTTPError as exc:
                return exc.code, exc.read().decode()

        for token in (None, "wrong-token"):
            status, body = get(token)
            assert status == 401 and "read token" in json.loads(body)["error"], body
        for token in ("read-token-m", "admin-token-m"):
            status, body = get(token)
            assert status == 200 and "paramserver_test_gauge 1.0" in body, body
    finally:
        server.shutdown()
        server.server_close()


def test_secrets_come_from_files_and_a_short_secret_is_refused(tmp_path: Path) -> None:
    secret = _private(tmp_path / "cluster.secret", SECRET)
    admin = _private(tmp_path / "admin.token", ADMIN)
    cfg = ServerConfig.from_mapping({"server_id": "ps1", "data_dir": str(tmp_path), "listen": "10.9.9.9:1", "raft": "10.9.9.9:2",
                                     "cluster_secret_file": str(secret), "admin_token_file": str(admin)})
    assert cfg.cluster_secret == SECRET and cfg.admin_token == ADMIN
    with pytest.raises(ConfigError, match="empty"):
        ServerConfig.from_mapping({"server_id": "ps1", "data_dir": str(tmp_path), "admin_token_file": str(_private(tmp_path / "e", ""))})
    with pytest.raises(ConfigError, match="cannot read"):
        ServerConfig.from_mapping({"server_id": "ps1", "data_dir": str(tmp_path), "admin_token_file": str(tmp_path / "missing")})
    with pytest.raises(ConfigError, match="at least 16"):
        ServerConfig(server_id="ps1", data_dir=tmp_path, cluster_secret="short").validate()


def test_a_secret_on_the_command_line_is_refused(tmp_path: Path) -> None:
    for flag in ("--admin-token", "--read-token", "--cluster-secret"):
        proc = subprocess.run([sys.executable, "-m", "paramserver", "serve", "--id", "ps1", "--data-dir", str(tmp_path),
                               flag, "visible-in-ps-value"], capture_output=True, text=True, timeout=60, env=_clean_env())
        assert proc.returncode == 2, proc.stderr
        assert f"{flag}-file" in proc.stderr and "ps" in proc.stderr and "Traceback" not in proc.stderr
        assert "visible-in-ps-value" not in proc.stderr


# ---------------------------------------------------------------- launcher: no secret in argv or cluster.json


def test_launcher_passes_secrets_as_0600_files_only(tmp_path: Path) -> None:
    root = tmp_path / "cluster"
    cluster = LocalCluster(LocalClusterConfig(root=root, servers=1, replication=1, generate_secrets=True,
                                              extra_args=("--no-fsync",)))
    try:
        cluster.up(wait=60)
        admin, read, secret = cluster.config.admin_token, cluster.config.read_token, cluster.config.secret
        assert admin and read and secret and len({admin, read, secret}) == 3
        secrets_dir = root / "secrets"
        assert secrets_dir.stat().st_mode & 0o777 == 0o700
        for name in ("admin.token", "read.token", "cluster.secret"):
            assert (secrets_dir / name).stat().st_mode & 0o777 == 0o600, name
        slot = cluster.slots[0]
        cmdline = Path(f"/proc/{slot.pid}/cmdline").read_bytes().decode()
        environ = Path(f"/proc/{slot.pid}/environ").read_bytes().decode()
        state = (root / "cluster.json").read_text()
        client = (root / "client.toml").read_text()
        for value in (admin, read, secret):
            assert value not in cmdline and value not in environ and value not in state and value not in client
        assert "--cluster-secret-file" in cmdline and "--admin-token-file" in cmdline
        # A restart of the same folder keeps the generated secrets (clients' files stay valid).
        cluster.down()
        again = LocalCluster(LocalClusterConfig(root=root, servers=1, replication=1, generate_secrets=True,
                                                extra_args=("--no-fsync",)))
        cluster = again
        again.up(wait=60)
        assert (again.config.admin_token, again.config.secret) == (admin, secret)
        assert LocalCluster.load_state(root).config.admin_token == admin
    finally:
        cluster.down()


# ---------------------------------------------------------------- non-loopback, in a namespace

_NETNS_OK, _NETNS_WHY = netns_available()
netns_only = pytest.mark.skipif(not _NETNS_OK, reason=f"needs network namespaces (root, iproute2): {_NETNS_WHY}")


@pytest.fixture
def namespace() -> Iterator[NetnsTopology]:
    topo = NetnsTopology(NetnsConfig.fresh(1)).create()
    try:
        yield topo
    finally:
        topo.destroy()


def _serve(topo: NetnsTopology, data_dir: Path, *extra: str, wait_s: float = 30.0) -> tuple[int | None, str]:
    """Run ``paramserver serve`` in the namespace on its own address; (exit code or None if it served, output)."""
    host = topo.address(0)
    argv = topo.exec_args(0, [sys.executable, "-m", "paramserver", "serve", "--id", "ps1", "--data-dir", str(data_dir),
                              "--listen", f"{host}:7070", "--raft", f"{host}:7071", "--no-fsync", *extra])
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_clean_env())
    assert proc.stdout is not None
    lines: list[str] = []
    deadline = time.monotonic() + wait_s
    try:
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line)
            if "serving gRPC on" in line:
                return None, "".join(lines)
        proc.wait(timeout=10)
        return proc.returncode, "".join(lines)
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)


@netns_only
@pytest.mark.root
@pytest.mark.timeout(120)
def test_non_loopback_server_needs_secret_and_token(namespace: NetnsTopology, tmp_path: Path) -> None:
    secret = _private(tmp_path / "cluster.secret", SECRET)
    admin = _private(tmp_path / "admin.token", ADMIN)
    code, out = _serve(namespace, tmp_path / "a")
    assert code == 2 and "--cluster-secret" in out and namespace.address(0) in out and "Traceback" not in out, out
    code, out = _serve(namespace, tmp_path / "b", "--cluster-secret-file", str(secret))
    assert code == 2 and "--admin-token" in out and "Traceback" not in out, out
    code, out = _serve(namespace, tmp_path / "c", "--cluster-secret-file", str(secret), "--admin-token-file", str(admin))
    assert code is None, out  # it served
    code, out = _serve(namespace, tmp_path / "d", "--insecure")
    assert code is None, out
    assert "WARNING" in out and "--insecure" in out and "no cluster secret" in out and "no admin token" in out


@netns_only
@pytest.mark.root
@pytest.mark.timeout(120)
def test_non_loopback_bulk_port_needs_the_admin_token(namespace: NetnsTopology, tmp_path: Path) -> None:
    """gRPC and Raft on loopback, the bulk port on the namespace's address, no token: it started and
    stored a 1 MiB write from another namespace. Now refused (exit 2, naming --bulk-listen)."""
    bulk = f"{namespace.address(0)}:7300"
    local = ("--listen", "127.0.0.1:7070", "--raft", "127.0.0.1:7071", "--bulk-listen", bulk)
    code, out = _serve(namespace, tmp_path / "a", *local)
    assert code == 2 and "--bulk-listen" in out and bulk in out and "--admin-token-file" in out, out
    assert "Traceback" not in out, out
    code, out = _serve(namespace, tmp_path / "b", *local, "--insecure")
    assert code is None, out  # it served
    assert "WARNING" in out and "--insecure" in out and "--bulk-listen" in out, out
    admin = _private(tmp_path / "admin.token", ADMIN)
    code, out = _serve(namespace, tmp_path / "c", *local, "--admin-token-file", str(admin))
    assert code is None, out
