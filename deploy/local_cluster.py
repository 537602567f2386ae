"""``LocalCluster``: start, stop, kill, restart and partition N real ``paramserver`` processes (see
``deploy.local`` for the CLI). Its files (secrets, certificates, client config, state) are ``ClusterFiles``'."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Collection, Sequence

from paramserver.wire.address import split_host_port

from .errors import EXIT_BAD_ARGUMENTS, EXIT_CONFLICT, EXIT_NOT_FOUND, EXIT_OTHER, EXIT_UNAVAILABLE, LauncherError
from .local_files import ClusterFiles, read_secrets
from .local_layout import (NETNS_GRPC_PORT, NETNS_RAFT_PORT, STATE_FILE, LocalClusterConfig, ServerSlot,
                           config_from_json, free_ports)
from .local_procs import alive, log_tail, signal_slot

if TYPE_CHECKING:
    from .netns import NetnsTopology


class LocalCluster(ClusterFiles):
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
            if any(alive(s.pid) for s in old.slots):
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
        if slot.pid and alive(slot.pid):
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
        if signal_slot(slot, signal.SIGTERM):
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
        if slot.pid and alive(slot.pid):
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
            if code is not None or not (slot.pid and alive(slot.pid)):
                slot.pid = None
                self.save_state()
                self._procs.pop(server_id, None)
                last = log_tail(slot.log_file, 1).strip() or "(nothing logged)"
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
        while slot.pid and alive(slot.pid) and time.monotonic() < deadline:
            time.sleep(0.05)

    def _finish(self, slot: ServerSlot, timeout: float) -> None:
        """Reap a server that was sent SIGTERM; SIGKILL it if it outlives ``timeout``."""
        self._reap(slot, timeout)
        if signal_slot(slot, signal.SIGKILL):
            self._reap(slot, 5.0)
        slot.pid = None

    def down(self, timeout: float = 10.0) -> None:
        for slot in self.slots:
            signal_slot(slot, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for slot in self.slots:
            if slot.pid:
                self._finish(slot, max(0.1, deadline - time.monotonic()))
        if self.topology is not None:
            self.topology.destroy()
        self.save_state()

    def running(self) -> list[str]:
        return [s.server_id for s in self.slots if s.pid and alive(s.pid)]

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
                if slot.pid and not alive(slot.pid):
                    tail = log_tail(slot.log_file)
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
    @classmethod
    def _from_state(cls, root: Path, data: Any) -> "LocalCluster":
        cluster = cls(config_from_json(data["config"], read_secrets(root)))
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
