"""Who may use a server's data dir: one process at a time, and one cluster for good.

Two processes on one data dir shared the Raft term/vote file: the second one's elections rewrote
the first one's vote and commit index. And nothing said which cluster a Raft journal belonged to:
a server started on another cluster's folder won an election and spliced that cluster's log into
this one. So a running server holds ``paramserver.lock`` (an advisory ``flock``, released when the
process ends, however it ends), and ``raft/cluster.id`` records the cluster id (keyed by the
cluster secret and the ring's vnodes, as ServerStatus reports it) the journal was written under:
a server whose id differs refuses to start. The file lives beside the journal so that it travels
with it. A journal from before the file existed gets it at its next start.
"""
from __future__ import annotations

import fcntl
import os
from pathlib import Path

from paramserver.server.errors import ConfigError

LOCK_FILE = "paramserver.lock"
IDENTITY_FILE = "cluster.id"  # inside the Raft folder


class DataDirInUse(ConfigError):
    """Another process holds the data dir."""


class ForeignDataDir(ConfigError):
    """The data dir's Raft journal belongs to another cluster."""


def lock_data_dir(data_dir: Path) -> int:
    """Take the data dir for this process; the returned descriptor holds it until closed (or the
    process ends). Raises DataDirInUse naming the holder's pid."""
    data_dir.mkdir(parents=True, exist_ok=True)
    path = data_dir / LOCK_FILE
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        raise DataDirInUse(f"data dir {data_dir} is in use by another paramserver (pid {holder}); stop it, or give this "
                           "one its own --data-dir") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


def check_identity(raft_dir: Path, cluster_id: str, *, fsync: bool = True) -> None:
    """Refuse a Raft folder written under another cluster id; record the id on a folder without one."""
    path = raft_dir / IDENTITY_FILE
    try:
        recorded = path.read_text(encoding="ascii").strip()
    except FileNotFoundError:
        recorded = None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read {path} ({exc}); it names the cluster this data dir belongs to") from None
    if recorded is not None:
        if recorded != cluster_id:
            raise ForeignDataDir(
                f"data dir {raft_dir.parent} belongs to another cluster: {path} records cluster id {recorded[:12]}..., "
                f"this server's secret and --vnodes give {cluster_id[:12]}...; point --data-dir at this server's own "
                f"folder (or an empty one to join afresh). After rotating the cluster secret on every member, delete "
                f"{IDENTITY_FILE} in each member's raft folder"
            )
        return
    raft_dir.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{IDENTITY_FILE}.tmp")
    with open(tmp, "w", encoding="ascii") as f:
        f.write(cluster_id + "\n")
        f.flush()
        if fsync:
            os.fsync(f.fileno())
    os.replace(tmp, path)
    if fsync:
        dir_fd = os.open(raft_dir, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)


__all__ = ["DataDirInUse", "ForeignDataDir", "IDENTITY_FILE", "LOCK_FILE", "check_identity", "lock_data_dir"]
