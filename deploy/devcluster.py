"""Metadata nodes as real processes (``python -m consensus.devnode``) on 127.0.0.1.

``DevNode`` starts one node and talks to it over its JSON-lines pipe; ``DevCluster`` runs N of
them and finds the leader they agree on. The consensus integration tests, the Raft durability
tests and ``bench/bench_consensus.py`` drive the metadata plane through these; servers embed
``consensus.node.MetadataNode`` instead.
"""
from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

from consensus import errors

from .local import free_port

T = TypeVar("T")
REPO_ROOT = Path(__file__).resolve().parents[1]  # the devnode runs from here, as the servers of deploy.local do
_ERRORS = {name: getattr(errors, name) for name in errors.__dict__ if isinstance(getattr(errors, name), type)}


def wait_until(predicate: Callable[[], T | None], timeout: float, interval: float = 0.05, what: str = "condition") -> T:
    """Poll until predicate returns something truthy; exceptions count as 'not yet'."""
    deadline = time.monotonic() + timeout
    last_exc: BaseException | None = None
    while True:
        try:
            value = predicate()
            if value:
                return value
        except Exception as exc:  # noqa: BLE001 - a node may be electing or restarting
            last_exc = exc
        if time.monotonic() >= deadline:
            raise TimeoutError(f"{what} not reached within {timeout}s (last error: {last_exc!r})")
        time.sleep(interval)


class DevNode:
    """One devnode process and a JSON-lines client for it."""

    def __init__(self, server_id: str, raft: str, peers: Iterable[str], data_dir: Path,
                 extra_args: Iterable[str] = (), env: dict[str, str] | None = None,
                 log_dir: Path | None = None) -> None:
        self.server_id = server_id
        self.raft = raft
        self.peers = list(peers)
        self.data_dir = data_dir
        self.extra_args = list(extra_args)
        self.env = env
        self.log_dir = log_dir  # default: beside the data dir (a power-loss test keeps logs off its test fs)
        self.proc: subprocess.Popen[str] | None = None
        self._pending: dict[int, queue.Queue[dict[str, Any]]] = {}
        self._lock = threading.Lock()
        self._next_id = 0

    def start(self, timeout: float = 30.0) -> None:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "consensus.devnode", "--id", self.server_id, "--raft", self.raft,
               "--data-dir", str(self.data_dir), *self.extra_args]
        for peer in self.peers:
            cmd += ["--peer", peer]
        log_file = (self.log_dir or self.data_dir.parent) / f"{self.server_id}.log"
        env = {**os.environ, **(self.env or {})}
        with open(log_file, "a") as stderr:  # the child keeps its own copy of the descriptor
            self.proc = subprocess.Popen(self.wrap(cmd), stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=stderr,
                                         text=True, bufsize=1, cwd=REPO_ROOT, env=env)
        started: queue.Queue[dict[str, Any]] = queue.Queue()
        threading.Thread(target=self._read_loop, args=(self.proc, started), daemon=True).start()
        logs = self.log_dir or self.data_dir.parent
        try:
            event = started.get(timeout=timeout)
        except queue.Empty:
            self.kill()
            raise TimeoutError(f"{self.server_id} did not start within {timeout}s; see {logs}") from None
        if event.get("event") != "started":
            self.kill()
            raise RuntimeError(f"{self.server_id} exited during start-up; see {logs}/{self.server_id}.log")

    def wrap(self, cmd: list[str]) -> list[str]:
        """The command line that runs ``cmd`` (a subclass may run it elsewhere, e.g. in a namespace)."""
        return cmd

    def _read_loop(self, proc: subprocess.Popen[str], started: queue.Queue[dict[str, Any]]) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            try:
                message = json.loads(line)
            except json.JSONDecodeError:
                continue
            if message.get("event") == "started":
                started.put(message)
                continue
            with self._lock:
                waiter = self._pending.pop(message.get("id"), None)
            if waiter is not None:
                waiter.put(message)
        # The process is gone: whoever still waits learns it now, not at its timeout.
        started.put({"event": "exited"})
        with self._lock:
            orphans, self._pending = list(self._pending.values()), {}
        for waiter in orphans:
            waiter.put({"ok": False, "error": "Unavailable", "message": f"{self.server_id} exited"})

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def call(self, op: str, *, wait: float = 30.0, **args: Any) -> Any:
        """Run op on the node; raise the consensus error it answered with."""
        proc = self.proc
        if proc is None or proc.poll() is not None or proc.stdin is None:
            raise errors.Unavailable(f"{self.server_id} is not running")
        waiter: queue.Queue[dict[str, Any]] = queue.Queue()
        with self._lock:
            self._next_id += 1
            request_id = self._next_id
            self._pending[request_id] = waiter
        try:
            proc.stdin.write(json.dumps({"id": request_id, "op": op, "args": args}) + "\n")
            proc.stdin.flush()
        except (BrokenPipeError, OSError) as exc:
            raise errors.Unavailable(f"{self.server_id} is gone: {exc}") from exc
        try:
            reply = waiter.get(timeout=wait)
        except queue.Empty:
            with self._lock:
                self._pending.pop(request_id, None)
            raise TimeoutError(f"{self.server_id} did not answer {op} within {wait}s") from None
        if reply["ok"]:
            return reply["result"]
        cls = _ERRORS.get(reply["error"], errors.MetadataError)
        if cls is errors.NotLeader:
            raise errors.NotLeader(reply["message"], reply.get("leader"))
        raise cls(reply["message"])

    def kill(self) -> None:
        """kill -9."""
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
        self._reap()

    def stop(self, timeout: float = 10.0) -> None:
        proc = self.proc
        if proc is not None and proc.poll() is None and proc.stdin is not None:
            try:
                proc.stdin.write(json.dumps({"op": "shutdown"}) + "\n")
                proc.stdin.flush()
                proc.wait(timeout=timeout)
            except (OSError, subprocess.TimeoutExpired):
                pass
        self.kill()

    def _reap(self) -> None:
        proc = self.proc
        if proc is None:
            return
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        for stream in (proc.stdin, proc.stdout):
            try:
                if stream is not None:
                    stream.close()
            except OSError:
                pass


class DevCluster:
    """N devnodes on loopback; every process is killed by close(), even after a failure."""

    def __init__(self, root: Path, size: int = 3, extra_args: Iterable[str] = (),
                 env: dict[str, str] | None = None, log_dir: Path | None = None) -> None:
        self.root = root
        self.extra_args = list(extra_args)
        self.env = env
        addresses = [f"127.0.0.1:{free_port()}" for _ in range(size)]
        self.nodes = [
            DevNode(f"n{i}", a, [p for p in addresses if p != a], root / f"n{i}", self.extra_args, env, log_dir)
            for i, a in enumerate(addresses)
        ]

    def start(self, timeout: float = 60.0) -> None:
        for node in self.nodes:
            node.start()
        self.wait_ready(timeout)

    def wait_ready(self, timeout: float = 60.0, nodes: Iterable[DevNode] | None = None) -> None:
        for node in list(nodes) if nodes is not None else self.alive():
            wait_until(partial(node.call, "wait_ready", timeout=1.0), timeout, what=f"{node.server_id} ready")

    def alive(self) -> list[DevNode]:
        return [n for n in self.nodes if n.alive]

    def by_address(self, address: str) -> DevNode:
        return next(n for n in self.nodes if n.raft == address)

    def leader(self, timeout: float = 30.0) -> DevNode:
        """The node that the live nodes agree is leader."""
        def agreed() -> DevNode | None:
            views = {n.call("leader", wait=5) for n in self.alive()}
            if len(views) != 1:
                return None
            (address,) = views
            if address is None:
                return None
            node = self.by_address(address)
            return node if node.alive and node.call("is_leader", wait=5) else None
        return wait_until(agreed, timeout, what="one agreed leader")

    def followers(self) -> list[DevNode]:
        leader = self.leader()
        return [n for n in self.alive() if n is not leader]

    def close(self) -> None:
        for node in self.nodes:
            node.kill()
