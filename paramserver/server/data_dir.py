"""Who may use a server's data dir: one process at a time, and one cluster for good.

Two processes on one data dir shared the Raft term/vote file: the second one's elections rewrote
the first one's vote and commit index. And nothing said which cluster a Raft journal belonged to:
a server started on another cluster's folder won an election and spliced that cluster's log into
this one. So a running server holds ``paramserver.lock`` (an advisory ``flock``, released when the
process ends, however it ends), and ``raft/cluster.id`` records the cluster id (keyed by the
cluster secret and the ring's vnodes, as ServerStatus reports it) the journal was written under:
a server whose id differs refuses to start. The file lives beside the journal so that it travels
with it. It is written only once the server has joined (its member record committed through a
leader that speaks this secret), so a first start with a mistyped secret, which joins nothing,
leaves no id behind to refuse the right secret later.
"""
from __future__ import annotations

import fcntl
import os
from pathlib import Path

from paramserver.server.errors import ConfigError
from paramserver.server.errors import DataDirInUse as DataDirInUse  # re-exported: their old home
from paramserver.server.errors import ForeignDataDir as ForeignDataDir

LOCK_FILE = "paramserver.lock"
IDENTITY_FILE = "cluster.id"  # inside the Raft folder


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


def check_identity(raft_dir: Path, cluster_id: str) -> bool:
    """Refuse a Raft folder written under another cluster id. True when the folder records this id,
    False when it records none yet (``record_identity`` writes it once this server has joined)."""
    path = raft_dir / IDENTITY_FILE
    try:
        recorded = path.read_text(encoding="ascii").strip()
    except FileNotFoundError:
        return False
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read {path} ({exc}); it names the cluster this data dir belongs to") from None
    if recorded != cluster_id:
        raise ForeignDataDir(
            f"data dir {raft_dir.parent} belongs to another cluster: {path} records cluster id {recorded[:12]}..., "
            f"while this server's cluster secret and --vnodes give {cluster_id[:12]}...; if the folder is this "
            f"server's own, start it with the secret file and --vnodes it ran with; otherwise point --data-dir at its "
            f"own folder (or an empty one to join afresh). After rotating the cluster secret on every member, delete "
            f"{IDENTITY_FILE} in each member's raft folder"
        )
    return True


def record_identity(raft_dir: Path, cluster_id: str, *, fsync: bool = True) -> None:
    """Write the cluster id this Raft folder belongs to (atomically: a crash leaves the old state)."""
    path = raft_dir / IDENTITY_FILE
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


__all__ = ["DataDirInUse", "ForeignDataDir", "IDENTITY_FILE", "LOCK_FILE", "check_identity", "lock_data_dir", "record_identity"]
