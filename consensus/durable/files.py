"""File-system helpers of the durable Raft state: fsync a folder and its ancestors, write or replace
a file durably, and the positioned write every Raft file goes through (with its fault seam for tests)."""
from __future__ import annotations

import logging
import os
from typing import Callable

log = logging.getLogger("consensus.durable")


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_path_and_ancestors(path: str) -> None:
    """Make ``path``'s own entry, and each ancestor's, durable.

    Whoever created the folders (the operator, a launcher, mkdir -p) may never have synced them,
    and a journal in a folder that a power loss takes away is lost with it. Folders above the
    parent may sit on file systems that refuse a directory fsync; those are skipped.
    """
    path = os.path.abspath(path)
    fsync_dir(path)
    parent = os.path.dirname(path)
    fsync_dir(parent)
    while True:
        above = os.path.dirname(parent)
        if above == parent:
            return
        parent = above
        try:
            fsync_dir(parent)
        except OSError as exc:
            log.debug("cannot fsync folder %s (%s); skipped", parent, exc)


def write_file_durably(path: str, data: bytes, *, fsync: bool) -> None:
    """Temporary file, fsync, rename over ``path``, fsync of the folder: all or nothing, and durable."""
    tmp = path + ".tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        _write_all(fd, data, 0)
        if fsync:
            os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    if fsync:
        fsync_dir(os.path.dirname(os.path.abspath(path)))


def replace_durably(src: str, dst: str) -> None:
    """rename(src, dst) with src fsynced before and the folder after."""
    fd = os.open(src, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(src, dst)
    fsync_dir(os.path.dirname(os.path.abspath(dst)))


# A seam for tests: called with the file descriptor before every write of the Raft state
# (journal, term/vote file), it raises the OSError a failing disk would (ENOSPC, EIO), so a
# test can fail one server's files without patching os for the whole process.
write_fault: Callable[[int], None] | None = None


def _write_all(fd: int, data: bytes, offset: int) -> None:
    if write_fault is not None:
        write_fault(fd)
    view = memoryview(data)
    while view:
        n = os.pwrite(fd, view, offset)
        view = view[n:]
        offset += n
