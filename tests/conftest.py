"""Shared fixtures: free loopback ports and per-test data directories."""
from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import grpc
import pytest

from deploy.local import LocalCluster, LocalClusterConfig, free_port  # free_port: the one helper; tests import it from here too


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """PDP_SERIAL=only keeps the tests marked ``serial``, PDP_SERIAL=skip all the others (deselected,
    not skipped): scripts/check.sh runs the serial ones alone, then the rest on pytest-xdist workers.
    Unset (a plain pytest run), every test is kept."""
    mode = os.environ.get("PDP_SERIAL", "")
    if mode not in ("only", "skip"):
        return
    serial = [it.get_closest_marker("serial") is not None for it in items]
    keep = [it for it, s in zip(items, serial) if s == (mode == "only")]
    dropped = [it for it, s in zip(items, serial) if s != (mode == "only")]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = keep


@pytest.fixture
def port_factory() -> Iterator[object]:
    taken: set[int] = set()

    def make() -> int:
        for _ in range(100):
            p = free_port()
            if p not in taken:
                taken.add(p)
                return p
        raise RuntimeError("no free loopback port found after 100 tries")

    yield make


def stop_process(proc: subprocess.Popen[Any], timeout: float = 10.0) -> None:
    """SIGTERM, wait, and SIGKILL if it has not exited by then."""
    proc.terminate()
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=timeout)


@contextmanager
def local_cluster(root: Path, wait: float = 90.0, **config: Any) -> Iterator[LocalCluster]:
    """A LocalCluster under ``root`` (``config``: LocalClusterConfig fields), up until the block ends."""
    cluster = LocalCluster(LocalClusterConfig(root=root, **config))
    try:
        cluster.up(wait=wait)
        yield cluster
    finally:
        cluster.down()


REPO = Path(__file__).resolve().parents[1]


def paramctl_at(cluster: LocalCluster, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """``paramctl ARGS`` as a user runs it against ``cluster`` (its address from PARAMS_CLUSTER, no
    other PARAMS_* setting of the test's environment), from the repository root."""
    import sys

    env = {k: v for k, v in os.environ.items() if not k.startswith("PARAMS_")}
    env["PARAMS_CLUSTER"] = cluster.seed
    return subprocess.run([sys.executable, "-m", "paramserver.client.ctl", *args], env=env, capture_output=True, text=True,
                          timeout=timeout, cwd=REPO)


@contextmanager
def mounted_tmpfs(mount: Path, mib: int, why: str) -> Iterator[Path]:
    """A ``mib`` MiB tmpfs at ``mount`` (root only; the test is skipped with ``why`` elsewhere), unmounted afterwards."""
    if os.geteuid() != 0:
        pytest.skip(f"needs root to mount a {mib} MiB tmpfs as {why} (run as root, e.g. in the CI container)")
    mount.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={mib}m,mode=0755", "tmpfs", str(mount)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({done.stderr.strip() or done.returncode}): no full-disk case without one")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


class FakeRpcError(grpc.RpcError):
    """A gRPC failure with a status code, as a stub raises it: for unit tests of code that reads ``exc.code()``."""

    def __init__(self, code: grpc.StatusCode) -> None:
        self._code = code

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._code.name.lower()
