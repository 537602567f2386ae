"""What a local cluster is made of: its files' names, its configuration, one slot per server, free ports,
and the configuration as ``cluster.json`` stores it (secrets never in it)."""
from __future__ import annotations

import contextlib
import random
import socket
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from .errors import EXIT_BAD_ARGUMENTS, LauncherError

STATE_FILE = "cluster.json"
CLIENT_CONFIG = "client.toml"  # the client config (paramserver.client.config) 'up' writes: export PARAMS_CONFIG=...
TLS_DIR = "tls"
SECRETS_DIR = "secrets"  # mode 0700; one 0600 file per secret, named on the servers' command lines by path only
SECRET_FILES = {"admin_token": "admin.token", "read_token": "read.token", "secret": "cluster.secret"}
CLIENT_CERT = "client"  # the one client certificate 'up --tls' issues
NETNS_GRPC_PORT = 7070  # in namespace mode every server has its own port space, so all use the same ports
NETNS_RAFT_PORT = 7071


def free_port(host: str = "127.0.0.1") -> int:
    """A port that was free a moment ago; callers bind it soon after."""
    return free_ports(1, host)[0]


_EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_LOW_PORT = 10000  # below this, well-known services (and root-only habits) live


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = (int(v) for v in _EPHEMERAL_RANGE.read_text().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """``n`` distinct ports that were free a moment ago: all held at once while they are picked (one
    picked at a time can come back twice, and two servers of one cluster then share a port).

    Picked below the kernel's ephemeral range: a port from bind(0) is one the kernel will also hand
    out as the source port of an outgoing connection or to another bind(0), so on a busy machine
    (test suites side by side, thousands of client connections) a server started a moment later,
    or restarted on its port, failed with "Address already in use" (issue 41, drills under load).
    Outside that range only another explicit pick can take it. Falls back to bind(0) when the
    range leaves no room."""
    low, _high = _ephemeral_range()
    rng = random.SystemRandom()
    with contextlib.ExitStack() as stack:
        picked: list[int] = []
        if low - _LOW_PORT >= 4 * n:
            for port in rng.sample(range(_LOW_PORT, low), min(low - _LOW_PORT, 64 * n)):
                s = stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
                try:
                    s.bind((host, port))
                except OSError:
                    continue
                picked.append(port)
                if len(picked) == n:
                    return picked
        socks = [stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) for _ in range(n - len(picked))]
        for s in socks:
            s.bind((host, 0))
        return picked + [int(s.getsockname()[1]) for s in socks]


@dataclass(frozen=True)
class LocalClusterConfig:
    root: Path
    servers: int = 3
    host: str = "127.0.0.1"
    base_port: int = 0  # 0: pick free ports; else grpc = base+2i, raft = base+2i+1
    admin_token: str | None = None
    read_token: str | None = None
    secret: str | None = None
    replication: int = 3
    extra_args: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()
    # Namespace mode: each server in its own network namespace (root, Linux, iproute2);
    # `host` is then unused, servers bind their namespace address.
    netns: bool = False
    netns_prefix: str | None = None  # None: a fresh unique "pdp-xxxxxx-"
    netns_subnet: str | None = None  # None: a free 10.231.X.0/24
    netns_clients: int = 0  # extra client namespaces on the bridge (for drills)
    # Generate what is not given of the admin token, the read token and the cluster secret (kept
    # under root/secrets and reused on restart). Namespace mode always does: its servers bind
    # non-loopback addresses, where a server refuses to start without them.
    generate_secrets: bool = False
    # Mutual TLS: a private CA and per-server certificates under root/tls (deploy.certs), reused on
    # restart; servers call each other with their own certificate. The bulk read port is off under TLS.
    tls: bool = False

    def validate(self) -> None:
        if not 1 <= self.servers <= 15:
            raise LauncherError(f"--servers must be between 1 and 15, got {self.servers}", EXIT_BAD_ARGUMENTS)
        if self.base_port and not 1024 <= self.base_port <= 65535 - 2 * self.servers:
            raise LauncherError(f"--base-port {self.base_port} leaves no room for {self.servers} servers", EXIT_BAD_ARGUMENTS)
        if self.replication < 1:
            raise LauncherError("--replication must be at least 1", EXIT_BAD_ARGUMENTS)
        if not self.netns and (self.netns_prefix or self.netns_subnet or self.netns_clients):
            raise LauncherError("netns_prefix, netns_subnet and netns_clients need netns=True (--netns)", EXIT_BAD_ARGUMENTS)


@dataclass
class ServerSlot:
    server_id: str
    grpc: str
    raft: str
    data_dir: str
    log_file: str
    pid: int | None = None
    args: list[str] = field(default_factory=list)
    netns: str | None = None  # the server's network namespace in namespace mode


def config_to_json(c: LocalClusterConfig) -> dict[str, Any]:
    d = asdict(replace(c, root=Path(c.root).resolve(), admin_token=None, read_token=None, secret=None))
    for key in SECRET_FILES:  # the secrets live in their 0600 files only
        del d[key]
    d["root"] = str(d["root"])
    return d


def config_from_json(cfg: Any, secrets: dict[str, str | None]) -> LocalClusterConfig:
    """The configuration ``config_to_json`` stored, with the secrets read from their files."""
    return LocalClusterConfig(
        root=Path(cfg["root"]), servers=cfg["servers"], host=cfg["host"], base_port=cfg["base_port"],
        admin_token=secrets["admin_token"], read_token=secrets["read_token"], secret=secrets["secret"],
        generate_secrets=cfg.get("generate_secrets", False),
        replication=cfg.get("replication", 3), extra_args=tuple(cfg.get("extra_args", ())),
        env=tuple(tuple(x) for x in cfg.get("env", ())),
        netns=cfg.get("netns", False), netns_prefix=cfg.get("netns_prefix"), netns_subnet=cfg.get("netns_subnet"),
        netns_clients=cfg.get("netns_clients", 0), tls=cfg.get("tls", False),
    )
