"""Local cluster launcher: N real ``paramserver`` processes on 127.0.0.1.

    python -m deploy.local up --servers 3 --dir .cluster
    python -m deploy.local status --dir .cluster
    python -m deploy.local down --dir .cluster

With ``--netns`` (root on Linux, iproute2) each server runs in its own network
namespace on a private bridge (see ``deploy.netns``) and binds its namespace's
address instead of 127.0.0.1; clients in the root namespace reach every server
through the topology's host port. Then real partitions can be cut and healed:

    python -m deploy.local up --netns --dir .cluster
    python -m deploy.local partition --dir .cluster --group ps1 --group ps2,ps3
    python -m deploy.local heal --dir .cluster

The same ``LocalCluster`` class drives the integration tests and the fault
drills, so what the tests exercise is what a user launches.

Failures print one line, ``error: ...``, and exit with the CLIs' codes: 1 other, 2 bad arguments
(or a damaged cluster.json), 3 no cluster there, 4 a cluster already running there (or a port it
needs taken), 6 not ready in time, 130 interrupted.
"""
from __future__ import annotations

import contextlib
import json
import os
import secrets
import shlex
import signal
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Collection, Sequence

from paramserver.wire.address import split_host_port
from paramserver.wire.cli_args import OneLineParser, float_in, int_in

if TYPE_CHECKING:
    from paramserver.client.config import ClientSettings

    from .netns import NetnsTopology

STATE_FILE = "cluster.json"
CLIENT_CONFIG = "client.toml"  # the client config (paramserver.client.config) 'up' writes: export PARAMS_CONFIG=...
TLS_DIR = "tls"
SECRETS_DIR = "secrets"  # mode 0700; one 0600 file per secret, named on the servers' command lines by path only
SECRET_FILES = {"admin_token": "admin.token", "read_token": "read.token", "secret": "cluster.secret"}
CLIENT_CERT = "client"  # the one client certificate 'up --tls' issues
NETNS_GRPC_PORT = 7070  # in namespace mode every server has its own port space, so all use the same ports
NETNS_RAFT_PORT = 7071

# The exit codes of the CLIs (paramserver/client/exit_codes.py), spelled out here because importing that
# module pulls in torch (about 2 s) before 'up' or '--help' can answer.
EXIT_OTHER = 1
EXIT_BAD_ARGUMENTS = 2
EXIT_NOT_FOUND = 3
EXIT_CONFLICT = 4
EXIT_UNAVAILABLE = 6
EXIT_INTERRUPTED = 130


class LauncherError(RuntimeError):
    """The local cluster could not be started, found or stopped; ``code`` is the CLI's exit code."""

    def __init__(self, message: str, code: int = EXIT_OTHER) -> None:
        super().__init__(message)
        self.code = code


def free_port(host: str = "127.0.0.1") -> int:
    """A port that was free a moment ago; callers bind it soon after."""
    return free_ports(1, host)[0]


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """``n`` distinct ports that were free a moment ago: all held at once while they are picked (one
    picked at a time can come back twice, and two servers of one cluster then share a port)."""
    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) for _ in range(n)]
        for s in socks:
            s.bind((host, 0))
        return [int(s.getsockname()[1]) for s in socks]


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


class LocalCluster:
    """Start, stop, kill and restart a set of local paramserver processes."""

    def __init__(self, config: LocalClusterConfig) -> None:
        config.validate()
        self.config = config
        self.root = Path(config.root).resolve()
        self.slots: list[ServerSlot] = []
        self._procs: dict[str, subprocess.Popen[bytes]] = {}
        self.topology: NetnsTopology | None = None  # set by up() in namespace mode

    # ---- layout -----------------------------------------------------------------
    def _plan(self) -> list[ServerSlot]:
        c = self.config
        slots = []
        picked = free_ports(2 * c.servers, c.host) if self.topology is None and not c.base_port else []
        for i in range(c.servers):
            host = c.host
            if self.topology is not None:
                host = self.topology.address(i)
                gp, rp = (c.base_port + 2 * i, c.base_port + 2 * i + 1) if c.base_port else (NETNS_GRPC_PORT, NETNS_RAFT_PORT)
            elif c.base_port:
                gp, rp = c.base_port + 2 * i, c.base_port + 2 * i + 1
            else:
                gp, rp = picked[2 * i], picked[2 * i + 1]
            sid = f"ps{i + 1}"
            slots.append(
                ServerSlot(
                    server_id=sid,
                    grpc=f"{host}:{gp}",
                    raft=f"{host}:{rp}",
                    data_dir=str(self.root / sid),
                    log_file=str(self.root / f"{sid}.log"),
                    netns=self.topology.ns(i) if self.topology is not None else None,
                )
            )
        return slots

    def _args_for(self, slot: ServerSlot) -> list[str]:
        c = self.config
        args = [
            sys.executable, "-m", "paramserver", "serve",
            "--id", slot.server_id,
            "--data-dir", slot.data_dir,
            "--listen", slot.grpc,
            "--raft", slot.raft,
            "--replication", str(c.replication),
        ]
        for other in self.slots:
            if other.server_id != slot.server_id:
                args += ["--peer", other.raft]
        # Secrets travel as paths to 0600 files, never as values: argv is visible to every user in ps.
        for key, flag in (("admin_token", "--admin-token-file"), ("read_token", "--read-token-file"),
                          ("secret", "--cluster-secret-file")):
            if getattr(c, key):
                args += [flag, str(self.secret_path(key))]
        if c.tls:
            tls = self.tls_dir
            args += ["--tls-cert", str(tls / f"{slot.server_id}.pem"), "--tls-key", str(tls / f"{slot.server_id}.key"),
                     "--tls-ca", str(tls / "ca.pem")]
        args += list(c.extra_args)
        if self.topology is not None:
            # `ip netns exec` execs the server, so the pid we keep is the server's own.
            args = self.topology.exec_args(self.index_of(slot.server_id), args)
        return args

    # ---- TLS and the client config ------------------------------------------------------
    @property
    def tls_dir(self) -> Path:
        return self.root / TLS_DIR

    @property
    def client_config_path(self) -> Path:
        return self.root / CLIENT_CONFIG

    def secret_path(self, key: str) -> Path:
        return self.root / SECRETS_DIR / SECRET_FILES[key]

    def _prepare_secrets(self) -> None:
        """Settle the admin token, read token and cluster secret and write each to its 0600 file.

        Given values win; else, when generating, the files of an earlier start are reused (so
        clients keep working across down/up) or fresh ones made. A secret this start does not use
        loses its file.
        """
        c = self.config
        generate = c.generate_secrets or c.netns
        folder = self.root / SECRETS_DIR
        folder.mkdir(mode=0o700, exist_ok=True)
        os.chmod(folder, 0o700)
        values: dict[str, str | None] = {}
        for key in SECRET_FILES:
            value = getattr(c, key)
            if value is None and generate:
                value = _read_secret(self.secret_path(key)) or secrets.token_urlsafe(32)
            values[key] = value
            path = self.secret_path(key)
            if value:
                _write_private(path, value + "\n")
            elif path.exists():
                path.unlink()
        self.config = replace(c, admin_token=values["admin_token"], read_token=values["read_token"], secret=values["secret"])

    def _make_certs(self) -> None:
        """The CA and one certificate per server (its host in the SANs) plus the client's; existing ones are reused."""
        from .certs import CertError, make_cluster_certs

        try:
            make_cluster_certs(self.tls_dir, {s.server_id: [s.grpc.rpartition(":")[0]] for s in self.slots}, clients=(CLIENT_CERT,))
        except (CertError, ValueError, OSError) as exc:
            raise LauncherError(f"cannot make the cluster's TLS certificates in {self.tls_dir}: {exc}") from None

    def client_settings(self, client_cert: str | None = CLIENT_CERT) -> "ClientSettings":
        """How a client reaches this cluster (addresses, tokens, and under TLS the CA and ``client_cert``'s files)."""
        from paramserver.client.config import ClientSettings

        tls: dict[str, Any] = {}
        if self.config.tls:
            tls["tls_ca"] = self.tls_dir / "ca.pem"
            if client_cert is not None:
                tls["tls_cert"], tls["tls_key"] = self.tls_dir / f"{client_cert}.pem", self.tls_dir / f"{client_cert}.key"
        return ClientSettings(cluster=tuple(self.addresses), admin_token=self.config.admin_token,
                              read_token=self.config.read_token, **tls)

    def write_client_config(self) -> Path:
        """Write ``client.toml`` into the cluster folder.

        Paths in it are relative to the folder, so the folder can move; no token sits in the file itself,
        it names the 0600 files under ``secrets/``.
        """
        c = self.config
        lines = [
            "# Client config of the local cluster (python -m deploy.local up); use it with",
            f"#   export PARAMS_CONFIG={self.client_config_path}",
            "# then paramctl and paramworker need no --cluster, --token or --tls-* flags.",
            f"cluster = [{', '.join(json.dumps(a) for a in self.addresses)}]",
        ]
        for key, name in (("admin_token_file", "admin_token"), ("read_token_file", "read_token")):
            if getattr(c, name):
                lines.append(f"{key} = {json.dumps(f'{SECRETS_DIR}/{SECRET_FILES[name]}')}")
        for stale in ("admin.token", "read.token"):  # where launchers before the secrets folder kept them
            if (self.root / stale).exists():
                (self.root / stale).unlink()
        if c.tls:
            lines += [
                f"tls_ca = {json.dumps(f'{TLS_DIR}/ca.pem')}",
                f"tls_cert = {json.dumps(f'{TLS_DIR}/{CLIENT_CERT}.pem')}",
                f"tls_key = {json.dumps(f'{TLS_DIR}/{CLIENT_CERT}.key')}",
            ]
        tmp = self.client_config_path.with_suffix(".toml.tmp")
        tmp.write_text("\n".join(lines) + "\n")
        tmp.replace(self.client_config_path)
        return self.client_config_path

    @property
    def addresses(self) -> list[str]:
        return [s.grpc for s in self.slots]

    @property
    def seed(self) -> str:
        return ",".join(self.addresses)

    def index_of(self, server_id: str) -> int:
        """0-based position of a server (its index in the namespace topology)."""
        for i, s in enumerate(self.slots):
            if s.server_id == server_id:
                return i
        raise LauncherError(f"no server {server_id!r} in this cluster (have {[s.server_id for s in self.slots]})",
                            EXIT_NOT_FOUND)

    def slot(self, server_id: str) -> ServerSlot:
        for s in self.slots:
            if s.server_id == server_id:
                return s
        raise LauncherError(f"no server {server_id!r} in this cluster (have {[s.server_id for s in self.slots]})",
                            EXIT_NOT_FOUND)

    # ---- processes ----------------------------------------------------------------
    def up(self, wait: float = 60.0) -> None:
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            what = "is a file, not a folder" if self.root.exists() else f"cannot be made ({exc.strerror or exc})"
            raise LauncherError(f"--dir {self.root} {what}: give a folder for the cluster's data, logs and {STATE_FILE}",
                                EXIT_BAD_ARGUMENTS) from None
        previous: list[ServerSlot] | None = None
        # Every refusal comes before the try below: the folder may belong to a running cluster, whose
        # state a refused start must leave as it is.
        if (self.root / STATE_FILE).exists():
            old = self.load_state(self.root)
            if any(_alive(s.pid) for s in old.slots):
                raise LauncherError(f"a cluster is already running under {self.root}: "
                                    f"run 'python -m deploy.local down --dir {self.root}' first", EXIT_CONFLICT)
            previous = self._restartable(old)
        try:
            if self.config.netns:
                self.topology = self._create_topology()
            self.slots = previous or self._plan()
            self._prepare_secrets()
            if self.config.tls:
                self._make_certs()
            for slot in self.slots:
                slot.args = self._args_for(slot)
                self._spawn(slot)
            self.save_state()
            self.write_client_config()
            self.wait_ready(wait)
        except BaseException:
            # Never leave processes or namespaces behind a failed start; the logs stay for reading.
            # With no slot planned yet there is nothing to stop or record, and saving would wipe the
            # folder's state (a stopped cluster's ports, which its Raft journal needs).
            if self.slots:
                self.down()
            elif self.topology is not None:
                self.topology.destroy()
            raise

    def _restartable(self, old: "LocalCluster") -> list[ServerSlot] | None:
        """The slots of a stopped cluster whose data is under root, to start it again as it was.

        Its Raft journal names every member by address, so the servers must come back on the
        same ports (a fresh set of free ports would leave them unable to elect a leader).
        None when there is no data to keep.
        """
        def has_data(server_id: str) -> bool:
            folder = self.root / server_id  # where this launcher keeps it, even if root was moved
            return folder.is_dir() and any(folder.iterdir())

        if not any(has_data(s.server_id) for s in old.slots):
            return None
        fresh = f"start a new cluster in another --dir, or delete {self.root} to discard its data"
        if old.config.netns or self.config.netns:
            why = ("namespace clusters cannot be restarted on new namespaces" if old.config.netns
                   else "it cannot be restarted in namespaces")
            raise LauncherError(
                f"{self.root} holds the data of a stopped {'namespace ' if old.config.netns else ''}cluster; {why}: {fresh}",
                EXIT_BAD_ARGUMENTS,
            )
        if len(old.slots) != self.config.servers:
            raise LauncherError(
                f"{self.root} holds the data of a {len(old.slots)}-server cluster: start it with --servers {len(old.slots)} "
                f"to keep its data, or {fresh}", EXIT_BAD_ARGUMENTS,
            )
        slots = [
            replace(slot, data_dir=str(self.root / slot.server_id), log_file=str(self.root / f"{slot.server_id}.log"), pid=None, args=[])
            for slot in old.slots
        ]
        wanted = self._plan() if self.config.base_port else None
        for i, slot in enumerate(slots):
            if wanted is not None and (wanted[i].grpc, wanted[i].raft) != (slot.grpc, slot.raft):
                raise LauncherError(
                    f"{self.root} holds a cluster whose {slot.server_id} listens on {slot.grpc} (Raft {slot.raft}), not on "
                    f"{wanted[i].grpc}: leave out --base-port to restart it where it was, or {fresh}", EXIT_BAD_ARGUMENTS,
                )
            for address in (slot.grpc, slot.raft):
                with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
                    probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the servers do: TIME_WAIT is no obstacle
                    try:
                        probe.bind(split_host_port(address))
                    except OSError:
                        raise LauncherError(
                            f"{slot.server_id} must come back on {address} (its peers know it there) but that port is in use; "
                            f"free it, or {fresh}", EXIT_CONFLICT,
                        ) from None
        return slots

    def _create_topology(self) -> "NetnsTopology":
        from .netns import NetnsConfig, NetnsError, NetnsTopology

        c = self.config
        try:
            cfg = (NetnsConfig(c.netns_prefix, c.servers, c.netns_clients, c.netns_subnet) if c.netns_prefix
                   else NetnsConfig.fresh(c.servers, c.netns_clients, c.netns_subnet))
            # Kept only once created: down() destroys by name prefix, and a prefix that
            # create() refused may belong to another running cluster.
            return NetnsTopology(cfg).create()
        except NetnsError as exc:
            raise LauncherError(f"namespace mode unavailable: {exc}") from None

    # ---- partitions (namespace mode) -----------------------------------------------------
    def _need_topology(self) -> "NetnsTopology":
        if self.topology is None:
            raise LauncherError("partitions need a cluster started in namespace mode: "
                                "LocalClusterConfig(netns=True) or 'python -m deploy.local up --netns' (as root)")
        return self.topology

    def partition(self, groups: Sequence[Collection[str]], host_side: int | None = None) -> None:
        """Cut the network between groups of server ids, e.g. [["ps1"], ["ps2", "ps3"]].

        host_side: index of the group that root-namespace clients (this process,
        workers started from it) are attached to; None keeps them reaching every server.
        """
        from .netns import HOST, Endpoint, NetnsError

        topo = self._need_topology()
        sets: list[set[Endpoint]] = [{self.index_of(sid) for sid in g} for g in groups]
        if host_side is not None:
            if not 0 <= host_side < len(sets):
                raise LauncherError(f"host_side must index one of the {len(sets)} groups, got {host_side}")
            sets[host_side].add(HOST)
        try:
            topo.partition(sets)
        except NetnsError as exc:
            raise LauncherError(str(exc)) from None

    def isolate(self, server_id: str) -> None:
        """Cut one server off from the others (root-namespace clients stay with the rest)."""
        from .netns import NetnsError

        try:
            self._need_topology().isolate(self.index_of(server_id))
        except NetnsError as exc:
            raise LauncherError(str(exc)) from None

    def heal(self) -> None:
        from .netns import NetnsError

        try:
            self._need_topology().heal()
        except NetnsError as exc:
            raise LauncherError(str(exc)) from None

    def _spawn(self, slot: ServerSlot) -> None:
        Path(slot.data_dir).mkdir(parents=True, exist_ok=True)
        # A server's secrets are exactly the files on its command line, never ones exported in this shell.
        env = {k: v for k, v in os.environ.items() if k not in ("PARAMS_ADMIN_TOKEN", "PARAMS_READ_TOKEN", "PARAMS_CLUSTER_SECRET")}
        env.update(dict(self.config.env))
        env.setdefault("PYTHONUNBUFFERED", "1")
        with open(slot.log_file, "ab") as log:  # the child keeps its own copy of the descriptor
            # A new session so that a Ctrl-C in the launcher's terminal does not
            # kill the cluster, and so 'down' can signal each server on its own.
            proc = subprocess.Popen(slot.args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    env=env, start_new_session=True)
        self._procs[slot.server_id] = proc
        slot.pid = proc.pid

    def kill(self, server_id: str, sig: int = signal.SIGKILL) -> None:
        slot = self.slot(server_id)
        if slot.pid and _alive(slot.pid):
            os.kill(slot.pid, sig)
            self._reap(slot, timeout=10.0)
        slot.pid = None
        self.save_state()

    def add_server(self) -> ServerSlot:
        """Start one more server, ``ps<N+1>``, with every member's Raft address as a peer and this
        cluster's secrets (and certificate): it joins once a member adds it (``paramctl member add``,
        which ``join_command`` spells out). Not in namespace mode (its topology is fixed at ``up``)."""
        if self.topology is not None or self.config.netns:
            raise LauncherError("a namespace-mode cluster cannot grow: its network topology is made at 'up'")
        if not self.running():
            raise LauncherError(f"no server of the cluster under {self.root} is running; start it with 'up' first")
        taken = {s.server_id for s in self.slots}
        n = len(self.slots) + 1
        while f"ps{n}" in taken:
            n += 1
        sid, host = f"ps{n}", self.config.host
        gp, rp = free_ports(2, host)
        slot = ServerSlot(server_id=sid, grpc=f"{host}:{gp}", raft=f"{host}:{rp}", data_dir=str(self.root / sid),
                          log_file=str(self.root / f"{sid}.log"))
        self.slots.append(slot)
        try:
            if self.config.tls:
                self._make_certs()
            slot.args = self._args_for(slot)
            self._spawn(slot)
        except BaseException:
            self.slots.remove(slot)
            raise
        self.config = replace(self.config, servers=len(self.slots))  # what 'up' restarts this folder with
        self.save_state()
        self.write_client_config()
        return slot

    def join_command(self, server_id: str) -> str:
        """The ``paramctl`` line that adds ``server_id`` to the running cluster."""
        slot = self.slot(server_id)
        return f"paramctl member add {slot.server_id} --grpc {slot.grpc} --raft {slot.raft}"

    def forget(self, server_id: str) -> None:
        """Stop a server (SIGTERM, then SIGKILL) and drop it from this folder's state, once the cluster
        no longer has it as a member (``paramctl member remove``); its data folder stays."""
        slot = self.slot(server_id)
        if _signal(slot, signal.SIGTERM):
            self._finish(slot, 10.0)
        self.slots.remove(slot)
        self.config = replace(self.config, servers=len(self.slots))
        self.save_state()
        self.write_client_config()

    def restart(self, server_id: str, wait: float | None = None) -> None:
        """Start one stopped server again with the arguments it was started with (the others may run).
        ``wait``: up to that many seconds for it to answer, raising with its log if it exits first
        (a refused data dir, a port taken) instead of reporting a start that did not happen."""
        slot = self.slot(server_id)
        if slot.pid and _alive(slot.pid):
            raise LauncherError(f"{server_id} is still running (pid {slot.pid}); stop it first", EXIT_CONFLICT)
        self._spawn(slot)
        self.save_state()
        if wait is not None:
            self.wait_answering(server_id, wait)

    def wait_answering(self, server_id: str, timeout: float) -> None:
        """Until ``server_id`` answers ClusterInfo (leader or not); LauncherError if it exits or stays silent."""
        slot = self.slot(server_id)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            proc = self._procs.get(server_id)
            code = proc.poll() if proc is not None else None
            if code is not None or not (slot.pid and _alive(slot.pid)):
                slot.pid = None
                self.save_state()
                self._procs.pop(server_id, None)
                last = _tail(slot.log_file, 1).strip() or "(nothing logged)"
                raise LauncherError(f"{server_id} exited during start-up{'' if code is None else f' (exit {code})'}: "
                                    f"{last} (log: {slot.log_file})",
                                    EXIT_BAD_ARGUMENTS if code == EXIT_BAD_ARGUMENTS else EXIT_OTHER)
            if self.cluster_info(server_id, timeout=1.0) is not None:
                return
            time.sleep(0.2)
        raise LauncherError(f"{server_id} (pid {slot.pid}) did not answer on {slot.grpc} within {timeout:.0f}s; see "
                            f"{slot.log_file}", EXIT_UNAVAILABLE)

    def _reap(self, slot: ServerSlot, timeout: float) -> None:
        proc = self._procs.pop(slot.server_id, None)
        deadline = time.monotonic() + timeout
        if proc is not None:
            try:
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                pass
            return
        while slot.pid and _alive(slot.pid) and time.monotonic() < deadline:
            time.sleep(0.05)

    def _finish(self, slot: ServerSlot, timeout: float) -> None:
        """Reap a server that was sent SIGTERM; SIGKILL it if it outlives ``timeout``."""
        self._reap(slot, timeout)
        if _signal(slot, signal.SIGKILL):
            self._reap(slot, 5.0)
        slot.pid = None

    def down(self, timeout: float = 10.0) -> None:
        for slot in self.slots:
            _signal(slot, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for slot in self.slots:
            if slot.pid:
                self._finish(slot, max(0.1, deadline - time.monotonic()))
        if self.topology is not None:
            self.topology.destroy()
        self.save_state()

    def running(self) -> list[str]:
        return [s.server_id for s in self.slots if s.pid and _alive(s.pid)]

    # ---- readiness ------------------------------------------------------------------
    def cluster_info(self, server_id: str | None = None, timeout: float = 2.0) -> dict[str, Any] | None:
        """ClusterInfo from one server (or the first that answers), as a dict."""
        import grpc

        from paramserver.client.rpc import ParamServerClient
        from paramserver.wire.proto import pb

        candidates = [self.slot(server_id)] if server_id else [s for s in self.slots if s.pid]
        settings = self.client_settings()
        for slot in candidates:
            client = ParamServerClient(settings.client_config(slot.grpc, write=False))
            try:
                reply = client.stub.ClusterInfo(pb.ClusterInfoRequest(), timeout=timeout)
            except grpc.RpcError:
                continue
            finally:
                client.close()
            return {
                "server_id": reply.server_id,
                "leader_id": reply.leader_id,
                "leader_grpc_address": reply.leader_grpc_address,
                "term": reply.term,
                "commit_index": reply.commit_index,
                "is_leader": reply.is_leader,
                "members": [
                    {"server_id": m.server_id, "grpc_address": m.grpc_address, "raft_address": m.raft_address,
                     "state": m.state, "zone": m.zone}
                    for m in reply.members
                ],
            }
        return None

    def leader_id(self, timeout: float = 2.0) -> str | None:
        """The leader as seen by a majority-side server that reports one."""
        for sid in self.running():
            info = self.cluster_info(sid, timeout=timeout)
            if info and info.get("leader_id"):
                return str(info["leader_id"])
        return None

    def wait_ready(self, timeout: float = 60.0, servers: Sequence[str] | None = None) -> str:
        """Wait until every running server answers and agrees on a leader; return its id."""
        deadline = time.monotonic() + timeout
        want = list(servers) if servers else self.running()
        last: Any = None
        while time.monotonic() < deadline:
            for slot in self.slots:
                if slot.pid and not _alive(slot.pid):
                    tail = _tail(slot.log_file)
                    raise LauncherError(f"{slot.server_id} exited during start-up; last log lines:\n{tail}")
            leaders: set[str | None] = set()
            members_ok = True
            for sid in want:
                info = self.cluster_info(sid, timeout=1.0)
                last = info
                if not info or not info.get("leader_id"):
                    leaders.add(None)
                    continue
                leaders.add(info["leader_id"])
                # Every server has registered (a drained one stays registered, as leaving).
                if not {s.server_id for s in self.slots} <= {m.get("server_id") for m in info.get("members", [])}:
                    members_ok = False
            if len(leaders) == 1 and None not in leaders and members_ok:
                return str(next(iter(leaders)))
            time.sleep(0.2)
        raise LauncherError(f"cluster under {self.root} not ready after {timeout:.0f}s (last answer: {last}); see the logs in {self.root}",
                            EXIT_UNAVAILABLE)

    # ---- state file -------------------------------------------------------------------
    def save_state(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        data: dict[str, Any] = {"config": _config_to_json(self.config), "slots": [asdict(s) for s in self.slots]}
        if self.topology is not None:
            t = self.topology
            data["netns"] = {"prefix": t.prefix, "servers": t.n, "clients": t.config.clients,
                             "subnet": t.subnet if t.has_subnet else None}
        tmp = self.root / (STATE_FILE + ".tmp")
        tmp.write_text(json.dumps(data, indent=2))
        tmp.replace(self.root / STATE_FILE)

    @classmethod
    def load_state(cls, root: Path) -> "LocalCluster":
        path = Path(root) / STATE_FILE
        if not path.exists():
            raise LauncherError(f"no cluster found under {root} ({STATE_FILE} missing): "
                                f"start one with 'python -m deploy.local up --dir {root}'", EXIT_NOT_FOUND)
        try:
            text = path.read_text()
        except OSError as exc:
            raise LauncherError(f"cannot read {path}: {exc.strerror or exc}", EXIT_BAD_ARGUMENTS) from None
        try:
            return cls._from_state(Path(root), json.loads(text))
        except LauncherError:
            raise  # already says what is wrong (a secret file that cannot be read)
        except (ValueError, KeyError, TypeError, AttributeError, RuntimeError) as exc:
            reason = " ".join(f"{type(exc).__name__}: {exc}".split())
            # The pids and ports it held are gone with it: running servers can only be stopped by hand,
            # and the folder's data only restarts on the old ports (each ps*.log names them).
            raise LauncherError(
                f"{path} is damaged or not a deploy.local state file ({reason}): stop any server still running "
                f"from {Path(root).resolve()} by hand, then start afresh with 'python -m deploy.local up' in another --dir",
                EXIT_BAD_ARGUMENTS,
            ) from None

    @classmethod
    def _from_state(cls, root: Path, data: Any) -> "LocalCluster":
        cfg = data["config"]
        config = LocalClusterConfig(
            root=Path(cfg["root"]), servers=cfg["servers"], host=cfg["host"], base_port=cfg["base_port"],
            admin_token=_read_secret(root / SECRETS_DIR / SECRET_FILES["admin_token"]),
            read_token=_read_secret(root / SECRETS_DIR / SECRET_FILES["read_token"]),
            secret=_read_secret(root / SECRETS_DIR / SECRET_FILES["secret"]),
            generate_secrets=cfg.get("generate_secrets", False),
            replication=cfg.get("replication", 3), extra_args=tuple(cfg.get("extra_args", ())),
            env=tuple(tuple(x) for x in cfg.get("env", ())),
            netns=cfg.get("netns", False), netns_prefix=cfg.get("netns_prefix"), netns_subnet=cfg.get("netns_subnet"),
            netns_clients=cfg.get("netns_clients", 0), tls=cfg.get("tls", False),
        )
        cluster = cls(config)
        cluster.slots = [ServerSlot(**s) for s in data["slots"]]
        if data.get("netns"):
            from .netns import NetnsConfig, NetnsTopology

            n = data["netns"]
            cluster.topology = NetnsTopology(NetnsConfig(n["prefix"], n["servers"], n.get("clients", 0), n.get("subnet")))
        return cluster

    def __enter__(self) -> "LocalCluster":
        return self

    def __exit__(self, *exc: object) -> None:
        self.down()


def _config_to_json(c: LocalClusterConfig) -> dict[str, Any]:
    d = asdict(replace(c, root=Path(c.root).resolve(), admin_token=None, read_token=None, secret=None))
    for key in SECRET_FILES:  # the secrets live in their 0600 files only
        del d[key]
    d["root"] = str(d["root"])
    return d


def _read_secret(path: Path) -> str | None:
    try:
        return path.read_text().strip() or None
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as exc:
        why = exc.strerror if isinstance(exc, OSError) and exc.strerror else "not text"
        raise LauncherError(f"cannot read the cluster's secret {path} ({why}): run as the user who started the "
                            f"cluster, or fix the file's owner and mode (0600)", EXIT_BAD_ARGUMENTS) from None


def _write_private(path: Path, text: str) -> None:
    """Write a secret file atomically, readable by its owner only from the first byte."""
    tmp = path.with_name(f".{path.name}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, text.encode())
        os.fchmod(fd, 0o600)
    finally:
        os.close(fd)
    tmp.replace(path)


def _secret_arg(key: str, path: Path | None, env: str) -> str | None:
    """A secret given to 'up': read as the servers read theirs, else from ``env``."""
    from paramserver.server.config import read_secret_file
    from paramserver.server.errors import ConfigError

    if path is None:
        return os.environ.get(env) or None
    try:
        return read_secret_file(key, path)
    except ConfigError as exc:
        raise LauncherError(str(exc), EXIT_BAD_ARGUMENTS) from None


def _signal(slot: ServerSlot, sig: int) -> bool:
    """Send ``sig`` to the slot's server when it is alive; whether it was."""
    if not (slot.pid and _alive(slot.pid)):
        return False
    try:
        os.kill(slot.pid, sig)
    except ProcessLookupError:
        return False
    return True


def _alive(pid: int | None) -> bool:
    if not pid:
        return False
    try:
        waited, _ = os.waitpid(pid, os.WNOHANG)
        if waited == pid:
            return False
    except ChildProcessError:
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie that is not our child still answers kill(0); check /proc. Every thread counts: a killed
    # group's leader shows Z while its other threads still hold the process's files (the data dir's
    # lock among them), so the process is gone only when no thread is left running.
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return True
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                if f.read().rsplit(")", 1)[-1].split()[0] not in ("Z", "X"):
                    return True
        except OSError:
            continue
    return False


def _tail(path: str, lines: int = 20) -> str:
    try:
        return "\n".join(Path(path).read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def main(argv: Sequence[str] | None = None) -> int:
    p = OneLineParser(prog="python -m deploy.local", description="Run a local paramserver cluster on 127.0.0.1.")
    sub = p.add_subparsers(dest="cmd", required=True)
    up = sub.add_parser("up", help="start N servers and wait for a leader")
    up.add_argument("--servers", type=int_in(1, 15, "--servers"), default=3, help="number of servers, 1 to 15 (default 3)")
    up.add_argument("--dir", default=".cluster", help="folder for data dirs, logs and cluster.json (default .cluster)")
    up.add_argument("--base-port", type=int, default=0, help="first port; gRPC = base+2i, Raft = base+2i+1 (default: free ports)")
    up.add_argument("--replication", type=int_in(1, 15, "--replication"), default=3,
                    help="replicas per chunk, 1 to 15, capped by the cluster size (default 3)")
    up.add_argument("--admin-token-file", type=Path, metavar="FILE",
                    help="file with the token for writes (or env PARAMS_ADMIN_TOKEN; default: generated)")
    up.add_argument("--read-token-file", type=Path, metavar="FILE",
                    help="file with the token for reads (or env PARAMS_READ_TOKEN; default: generated)")
    up.add_argument("--cluster-secret-file", type=Path, metavar="FILE",
                    help="file with the secret that encrypts and authenticates Raft traffic (or env PARAMS_CLUSTER_SECRET; "
                         "default: generated)")
    up.add_argument("--no-secrets", action="store_true",
                    help="generate no tokens and no cluster secret: every port open to anyone on this machine "
                         "(loopback only; not with --netns)")
    up.add_argument("--timeout", type=float_in(0, 3600, "--timeout"), default=60.0,
                    help="seconds to wait for a leader, above 0 and at most 3600 (default 60)")
    up.add_argument("--netns", action="store_true",
                    help="run each server in its own network namespace on a private bridge, so partitions can be cut "
                         "(root on Linux, iproute2); servers then bind 10.231.X.i instead of 127.0.0.1")
    up.add_argument("--subnet", help="with --netns: a private /24 for the bridge (default: a free 10.231.X.0/24)")
    up.add_argument("--client-namespaces", type=int_in(0, 16, "--client-namespaces"), default=0,
                    help="with --netns: extra client namespaces on the bridge, 0 to 16, for loaders on one side (default 0)")
    up.add_argument("--tls", action="store_true",
                    help="mutual TLS: make a private CA, a certificate per server and one client certificate under "
                         "DIR/tls (reused on restart); servers call each other with their own certificate; the bulk "
                         "read port is off (reads go over gRPC) (default: plaintext)")
    add = sub.add_parser("add", help="start one more server that joins the running cluster once "
                                     "'paramctl member add' (printed) adds it")
    add.add_argument("--dir", default=".cluster", help="the cluster's folder (default .cluster)")
    start = sub.add_parser("start", help="start one stopped server of a running cluster again (after a crash or a kill), "
                                         "on its ports and data dir")
    start.add_argument("--dir", default=".cluster", help="the cluster's folder (default .cluster)")
    start.add_argument("server_id", metavar="ID")
    forget = sub.add_parser("forget", help="stop a server and drop it from the folder's state, after "
                                           "'paramctl member remove' took it out of the cluster (its data stays)")
    forget.add_argument("--dir", default=".cluster", help="the cluster's folder (default .cluster)")
    forget.add_argument("server_id", metavar="ID")
    for name, text in (("down", "stop every server of the cluster"), ("status", "show servers, pids and the leader"),
                       ("partition", "cut the network between groups of servers (--netns clusters only)"),
                       ("heal", "restore full connectivity (--netns clusters only)")):
        sp = sub.add_parser(name, help=text)
        sp.add_argument("--dir", default=".cluster", help="the cluster's folder (default .cluster)")
        if name == "partition":
            sp.add_argument("--group", action="append", required=True, metavar="ID[,ID...]",
                            help="server ids on one side, e.g. --group ps1 --group ps2,ps3 (every server in one group)")
            sp.add_argument("--host-side", type=int, default=None, metavar="K",
                            help="attach root-namespace clients to group K (0-based); default: they reach every server")
    args = p.parse_args(argv)
    try:
        if args.cmd == "up":
            if args.no_secrets and args.netns:
                raise LauncherError("--no-secrets cannot be used with --netns: servers on non-loopback addresses need "
                                    "a cluster secret and an admin token", EXIT_BAD_ARGUMENTS)
            cluster = LocalCluster(LocalClusterConfig(
                root=Path(args.dir), servers=args.servers, base_port=args.base_port, replication=args.replication,
                generate_secrets=not args.no_secrets,
                admin_token=_secret_arg("admin_token", args.admin_token_file, "PARAMS_ADMIN_TOKEN"),
                read_token=_secret_arg("read_token", args.read_token_file, "PARAMS_READ_TOKEN"),
                secret=_secret_arg("cluster_secret", args.cluster_secret_file, "PARAMS_CLUSTER_SECRET"),
                netns=args.netns, netns_subnet=args.subnet, netns_clients=args.client_namespaces, tls=args.tls))
            # up() stops what it started when the start fails; a refusal (a cluster already running
            # there) must leave that cluster and its state alone, so nothing more is stopped here.
            cluster.up(wait=args.timeout)
            leader = cluster.leader_id()
            c = cluster.config
            security = ", ".join(x for x in ("mutual TLS" if c.tls else "", "tokens" if c.admin_token else "",
                                             "cluster secret" if c.secret else "") if x) or "open: no tokens, no secret"
            print(f"cluster of {len(cluster.slots)} servers up under {cluster.root} (leader {leader}; {security})")
            for s in cluster.slots:
                where = f"  netns {s.netns}" if s.netns else ""
                print(f"  {s.server_id}  grpc {s.grpc}  raft {s.raft}  pid {s.pid}{where}  log {s.log_file}")
            if c.admin_token or c.secret:
                print(f"  secrets (0600) under {cluster.root / SECRETS_DIR}; the client config names them")
            print(f"client config written to {cluster.client_config_path}; point paramctl and paramworker at it with:")
            print(f"export PARAMS_CONFIG={shlex.quote(str(cluster.client_config_path))}")
            print("then e.g.:  paramctl status   paramctl push FILE --model NAME --tag prod   paramworker load NAME:prod")
            print(f"stop it with:   python -m deploy.local down --dir {args.dir}")
            return 0
        cluster = LocalCluster.load_state(Path(args.dir))
        if args.cmd == "down":
            cluster.down()
            print(f"cluster under {cluster.root} stopped")
            return 0
        if args.cmd == "add":
            slot = cluster.add_server()
            print(f"started {slot.server_id}  grpc {slot.grpc}  raft {slot.raft}  pid {slot.pid}  log {slot.log_file}")
            print(f"add it to the cluster with:   {cluster.join_command(slot.server_id)}")
            return 0
        if args.cmd == "start":
            cluster.restart(args.server_id, wait=60.0)
            slot = cluster.slot(args.server_id)
            print(f"started {slot.server_id}  grpc {slot.grpc}  raft {slot.raft}  pid {slot.pid}  log {slot.log_file}")
            return 0
        if args.cmd == "forget":
            cluster.forget(args.server_id)
            print(f"{args.server_id} stopped and dropped from {cluster.root / STATE_FILE} (its data dir stays)")
            return 0
        if args.cmd == "partition":
            groups = [[x.strip() for x in g.split(",") if x.strip()] for g in args.group]
            cluster.partition(groups, host_side=args.host_side)
            print(f"partitioned: {' | '.join(','.join(g) for g in groups)}"
                  f"{'' if args.host_side is None else f' (root-namespace clients with group {args.host_side})'}")
            return 0
        if args.cmd == "heal":
            cluster.heal()
            print("healed: every server reaches every other")
            return 0
        leader = cluster.leader_id() if cluster.running() else None
        for s in cluster.slots:
            state = "running" if s.pid and _alive(s.pid) else "stopped"
            print(f"{s.server_id}  {state:8s} grpc {s.grpc}  raft {s.raft}  pid {s.pid}{'  (leader)' if s.server_id == leader else ''}")
        return 0
    except LauncherError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.code
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


if __name__ == "__main__":
    raise SystemExit(main())
