"""Small OS helpers of the chunk store: directory fsyncs, quiet unlinks, the descriptor limit,
sizes for messages."""
from __future__ import annotations

import os
import resource

# one directory fsync for the whole server: the Raft journal's (the store's segments need the same guarantee)
from consensus.durable.files import fsync_dir as fsync_dir


def size_of(path: str) -> int:
    try:
        return os.stat(path).st_size
    except OSError:
        return 0


def raise_fd_limit() -> None:
    """Each segment keeps one file descriptor open: raise the soft limit to the hard one (best effort)."""
    try:
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft != resource.RLIM_INFINITY and (hard == resource.RLIM_INFINITY or soft < hard):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 16), hard))
    except (ValueError, OSError):
        pass


def human_size(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


def fsync_dir_quietly(path: str) -> None:
    try:
        fsync_dir(path)
    except OSError:
        pass


def unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
