"""A FUSE file system that loses everything unsynced when told to lose power (in the manner of LazyFS).

    python -m tests.powerloss.fs MOUNTPOINT --state FILE --control SOCKET

Every file and folder lives in this process's memory twice: as the programs using the mount
see it, and as a disk would hold it after a power loss. Only these move data to the second:

- fsync / fdatasync of a file: its whole content and size, as they are now;
- fsync of a folder (fsyncdir): its list of names, as it is now.

Nothing else is durable: a created, renamed or deleted name lasts only once its folder is
fsynced (POSIX's rule, stricter than ext4), and a file whose name is durable but whose data was
never synced comes back empty. The kernel's page cache is no second hiding place: without
writeback caching (libfuse 2) a write(2) reaches this process at once, and mmap'd pages reach
it when written back or msynced, so until then they are as volatile as here.

The control socket takes one command a line and answers one JSON line:
``cut``: power off. From then on every request fails with EIO, so no later sync can succeed
and be acknowledged; the durable image is written to ``--state``. The caller then kills the
programs and unmounts; a new instance started with the same ``--state`` is the machine
powered back on. ``stats``: counts of syncs and requests.
"""
from __future__ import annotations

import argparse
import errno
import json
import os
import pickle
import socket
import stat
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, TypeVar

from fuse import FUSE, FuseOSError, Operations

ROOT = 1
F = TypeVar("F", bound=Callable[..., Any])


@dataclass
class Inode:
    ino: int
    is_dir: bool
    mode: int
    data: bytearray = field(default_factory=bytearray)  # files, as seen through the mount
    durable_data: bytes = b""  # files, as a disk holds them
    entries: dict[str, int] = field(default_factory=dict)  # folders, as seen
    durable_entries: dict[str, int] = field(default_factory=dict)  # folders, as a disk holds them
    mtime_ns: int = field(default_factory=time.time_ns)


def _op(fn: F) -> F:
    """Every request under one lock, and EIO for all of them once the power is off."""
    def wrapper(self: "PowerLossFS", *args: Any, **kwargs: Any) -> Any:
        with self.mutex:
            self.requests += 1
            if not self.powered:
                raise FuseOSError(errno.EIO)
            return fn(self, *args, **kwargs)
    wrapper.__name__ = fn.__name__
    return wrapper  # type: ignore[return-value]


class PowerLossFS(Operations):  # type: ignore[misc]
    use_ns = True

    def __init__(self, image: dict[int, tuple[Any, ...]] | None = None) -> None:
        # Not "lock": fusepy would take an attribute of that name for FUSE's lock operation.
        self.mutex = threading.RLock()
        self.powered = True
        self.requests = 0
        self.syncs = 0
        self.dir_syncs = 0
        self.inodes: dict[int, Inode] = {}
        if image:
            for ino, (kind, mode, content) in image.items():
                if kind == "dir":
                    self.inodes[ino] = Inode(ino, True, mode, entries=dict(content), durable_entries=dict(content))
                else:
                    self.inodes[ino] = Inode(ino, False, mode, data=bytearray(content), durable_data=content)
        else:
            self.inodes[ROOT] = Inode(ROOT, True, stat.S_IFDIR | 0o755)
        self.next_ino = max(self.inodes) + 1

    # ------------------------------------------------------------ power
    def cut(self) -> dict[str, Any]:
        """Power off: from now on nothing reaches the disk; returns the durable image and what was lost."""
        with self.mutex:
            self.powered = False
            image: dict[int, tuple[Any, ...]] = {}
            stack = [ROOT]
            while stack:
                node = self.inodes[stack.pop()]
                if node.is_dir:
                    image[node.ino] = ("dir", node.mode, dict(node.durable_entries))
                    stack.extend(node.durable_entries.values())
                else:
                    image[node.ino] = ("file", node.mode, node.durable_data)
            lost_bytes = sum(abs(len(n.data) - len(n.durable_data)) + (0 if bytes(n.data) == n.durable_data else 1)
                             for n in self.inodes.values() if not n.is_dir and n.ino in image)
            lost_names = sum(len(set(n.entries.items()) ^ set(n.durable_entries.items()))
                             for n in self.inodes.values() if n.is_dir and n.ino in image)
            return {"image": image, "files_changed_unsynced": lost_bytes, "names_changed_unsynced": lost_names,
                    "syncs": self.syncs, "dir_syncs": self.dir_syncs, "requests": self.requests}

    # ------------------------------------------------------------ lookup
    def _lookup(self, path: str) -> Inode:
        node = self.inodes[ROOT]
        for part in [p for p in path.split("/") if p]:
            if not node.is_dir:
                raise FuseOSError(errno.ENOTDIR)
            ino = node.entries.get(part)
            if ino is None:
                raise FuseOSError(errno.ENOENT)
            node = self.inodes[ino]
        return node

    def _parent(self, path: str) -> tuple[Inode, str]:
        head, _, name = path.rstrip("/").rpartition("/")
        parent = self._lookup(head or "/")
        if not parent.is_dir:
            raise FuseOSError(errno.ENOTDIR)
        return parent, name

    def _node(self, path: str, fh: int | None) -> Inode:
        return self.inodes[fh] if fh else self._lookup(path)

    def _new(self, path: str, is_dir: bool, mode: int) -> Inode:
        parent, name = self._parent(path)
        if name in parent.entries:
            raise FuseOSError(errno.EEXIST)
        node = Inode(self.next_ino, is_dir, (stat.S_IFDIR if is_dir else stat.S_IFREG) | (mode & 0o7777))
        self.next_ino += 1
        self.inodes[node.ino] = node
        parent.entries[name] = node.ino
        parent.mtime_ns = time.time_ns()
        return node

    # ------------------------------------------------------------ metadata
    @_op
    def getattr(self, path: str, fh: int | None = None) -> dict[str, Any]:
        node = self._node(path, fh)
        size = 4096 if node.is_dir else len(node.data)
        return {"st_mode": node.mode, "st_nlink": 2 if node.is_dir else 1, "st_size": size,
                "st_blocks": (size + 511) // 512, "st_uid": 0, "st_gid": 0, "st_ino": node.ino,
                "st_atime": node.mtime_ns, "st_mtime": node.mtime_ns, "st_ctime": node.mtime_ns}

    @_op
    def readdir(self, path: str, fh: int) -> list[str]:
        return [".", "..", *self._node(path, fh).entries]

    @_op
    def opendir(self, path: str) -> int:
        node = self._lookup(path)
        if not node.is_dir:
            raise FuseOSError(errno.ENOTDIR)
        return node.ino

    @_op
    def releasedir(self, path: str, fh: int) -> int:
        return 0

    @_op
    def mkdir(self, path: str, mode: int) -> int:
        self._new(path, True, mode)
        return 0

    @_op
    def rmdir(self, path: str) -> int:
        parent, name = self._parent(path)
        node = self._lookup(path)
        if not node.is_dir:
            raise FuseOSError(errno.ENOTDIR)
        if node.entries:
            raise FuseOSError(errno.ENOTEMPTY)
        del parent.entries[name]
        return 0

    @_op
    def unlink(self, path: str) -> int:
        parent, name = self._parent(path)
        if name not in parent.entries:
            raise FuseOSError(errno.ENOENT)
        if self.inodes[parent.entries[name]].is_dir:
            raise FuseOSError(errno.EISDIR)
        del parent.entries[name]
        return 0

    @_op
    def rename(self, old: str, new: str) -> int:
        src, src_name = self._parent(old)
        dst, dst_name = self._parent(new)
        if src_name not in src.entries:
            raise FuseOSError(errno.ENOENT)
        ino = src.entries[src_name]
        replaced = dst.entries.get(dst_name)
        if replaced is not None and replaced != ino:
            moving_dir, target = self.inodes[ino].is_dir, self.inodes[replaced]
            if target.is_dir and (not moving_dir or target.entries):
                raise FuseOSError(errno.EISDIR if not moving_dir else errno.ENOTEMPTY)
            if moving_dir and not target.is_dir:
                raise FuseOSError(errno.ENOTDIR)
        del src.entries[src_name]
        dst.entries[dst_name] = ino
        return 0

    @_op
    def chmod(self, path: str, mode: int) -> int:
        node = self._lookup(path)
        node.mode = (node.mode & ~0o7777) | (mode & 0o7777)
        return 0

    @_op
    def chown(self, path: str, uid: int, gid: int) -> int:
        return 0

    @_op
    def utimens(self, path: str, times: tuple[int, int] | None = None) -> int:
        self._lookup(path).mtime_ns = times[1] if times else time.time_ns()
        return 0

    @_op
    def access(self, path: str, amode: int) -> int:
        self._lookup(path)
        return 0

    @_op
    def statfs(self, path: str) -> dict[str, int]:
        return {"f_bsize": 4096, "f_frsize": 4096, "f_blocks": 1 << 20, "f_bfree": 1 << 19, "f_bavail": 1 << 19,
                "f_files": 1 << 20, "f_ffree": 1 << 19, "f_favail": 1 << 19, "f_namemax": 255}

    # ------------------------------------------------------------ data
    @_op
    def create(self, path: str, mode: int, fi: Any = None) -> int:
        return self._new(path, False, mode).ino

    @_op
    def open(self, path: str, flags: int) -> int:
        node = self._lookup(path)
        if flags & os.O_TRUNC:
            del node.data[:]
        return node.ino

    @_op
    def read(self, path: str, size: int, offset: int, fh: int) -> bytes:
        return bytes(self._node(path, fh).data[offset:offset + size])

    @_op
    def write(self, path: str, data: bytes, offset: int, fh: int) -> int:
        buf = self._node(path, fh).data
        if offset > len(buf):
            buf.extend(bytes(offset - len(buf)))
        buf[offset:offset + len(data)] = data
        return len(data)

    @_op
    def truncate(self, path: str, length: int, fh: int | None = None) -> int:
        buf = self._node(path, fh).data
        if length < len(buf):
            del buf[length:]
        else:
            buf.extend(bytes(length - len(buf)))
        return 0

    @_op
    def flush(self, path: str, fh: int) -> int:
        return 0  # close() is no sync

    @_op
    def release(self, path: str, fh: int) -> int:
        return 0

    @_op
    def fsync(self, path: str, datasync: int, fh: int) -> int:
        node = self._node(path, fh)
        node.durable_data = bytes(node.data)
        self.syncs += 1
        return 0

    @_op
    def fsyncdir(self, path: str, datasync: int, fh: int) -> int:
        node = self._node(path, fh)
        node.durable_entries = dict(node.entries)
        self.dir_syncs += 1
        return 0


def _serve_control(fs: PowerLossFS, path: str, state: str) -> None:
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    if os.path.exists(path):
        os.unlink(path)
    server.bind(path)
    server.listen(4)
    while True:
        conn, _ = server.accept()
        with conn, conn.makefile("rw") as f:
            for line in f:
                command = line.strip()
                if command == "cut":
                    result = fs.cut()
                    tmp = state + ".tmp"
                    with open(tmp, "wb") as out:
                        pickle.dump(result.pop("image"), out)
                        out.flush()
                        os.fsync(out.fileno())
                    os.replace(tmp, state)
                    reply: dict[str, Any] = {"ok": True, **result}
                elif command == "stats":
                    with fs.mutex:
                        reply = {"ok": True, "powered": fs.powered, "syncs": fs.syncs, "dir_syncs": fs.dir_syncs,
                                 "requests": fs.requests}
                else:
                    reply = {"ok": False, "error": f"unknown command {command!r}; cut or stats"}
                f.write(json.dumps(reply) + "\n")
                f.flush()


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.powerloss.fs", description=__doc__.split("\n")[0])
    parser.add_argument("mountpoint")
    parser.add_argument("--state", required=True, help="durable image: read at start if present, written at cut")
    parser.add_argument("--control", required=True, help="UNIX socket path for 'cut' and 'stats'")
    args = parser.parse_args()
    image = None
    if os.path.exists(args.state):
        with open(args.state, "rb") as f:
            image = pickle.load(f)  # written by an earlier instance of this test tool
    fs = PowerLossFS(image)
    threading.Thread(target=_serve_control, args=(fs, args.control, args.state), daemon=True).start()
    # Returns when the mount is unmounted. Single-threaded: requests are serialised by the lock anyway.
    FUSE(fs, args.mountpoint, foreground=True, nothreads=True, fsname="powerlossfs")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
