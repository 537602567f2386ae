"""Power-loss testing: a FUSE file system that drops every unsynced write on command (see fs.py).

``PowerLossMount`` runs it as a process, cuts the power and brings the machine back:

    mount = PowerLossMount(tmp / "mnt", tmp / "fs")
    mount.start()              # the durable image of the last cut, if any
    ...                        # run programs with their data on tmp / "mnt"
    mount.cut()                # power off: nothing unsynced survives, every later request fails
    ...                        # kill the programs
    mount.unmount()
    mount.start()              # powered on again
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[2]


def unavailable_reason() -> str | None:
    """Why a FUSE power-loss test cannot run here, or None if it can."""
    if os.geteuid() != 0:
        return "mounting the power-loss FUSE file system needs root"
    if not os.path.exists("/dev/fuse"):
        return "/dev/fuse is missing (no FUSE in this kernel or container)"
    try:
        import fuse  # noqa: F401 - fusepy, which loads libfuse.so.2 at import
    except ImportError:
        return "fusepy is not installed (pip install fusepy; it is in the test extra)"
    except OSError as exc:
        return f"fusepy cannot load libfuse ({exc}); Debian: apt-get install libfuse2"
    return None


class PowerLossMount:
    def __init__(self, mountpoint: Path, workdir: Path) -> None:
        self.mountpoint = mountpoint
        self.workdir = workdir
        self.state = workdir / "durable.img"
        self.control = workdir / "control.sock"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 20.0) -> None:
        self.mountpoint.mkdir(parents=True, exist_ok=True)
        self.workdir.mkdir(parents=True, exist_ok=True)
        log = open(self.workdir / "fs.log", "ab")  # noqa: SIM115 - kept for the process' life
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.powerloss.fs", str(self.mountpoint), "--state", str(self.state),
             "--control", str(self.control)],
            cwd=REPO_ROOT, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
        )
        log.close()
        deadline = time.monotonic() + timeout
        while not (self.mounted() and self._ping()):
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"power-loss file system exited with {self.proc.returncode}; see {self.workdir}/fs.log")
            if time.monotonic() > deadline:
                self.close()
                raise TimeoutError(f"power-loss file system not mounted on {self.mountpoint} within {timeout}s")
            time.sleep(0.05)

    def mounted(self) -> bool:
        # Not os.path.ismount: a mount whose process died fails lstat, and ismount says False.
        target = os.path.abspath(self.mountpoint)
        with open("/proc/self/mounts") as f:
            return any(line.split()[1] == target for line in f if len(line.split()) > 1)

    def _ping(self) -> bool:
        try:
            return bool(self.request("stats").get("ok"))
        except OSError:
            return False

    def request(self, command: str) -> dict[str, Any]:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(10)
            s.connect(str(self.control))
            s.sendall(command.encode() + b"\n")
            with s.makefile("r") as f:
                return dict(json.loads(f.readline()))

    def cut(self) -> dict[str, Any]:
        """Power off now; returns counts of what was synced and of what is lost."""
        return self.request("cut")

    def unmount(self, timeout: float = 20.0) -> None:
        if self.proc is None:
            return
        if self.mounted():
            if subprocess.run(["umount", str(self.mountpoint)], capture_output=True).returncode != 0:
                self.proc.kill()
                subprocess.run(["umount", "-l", str(self.mountpoint)], capture_output=True)
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.proc = None

    def close(self) -> None:
        """Best-effort cleanup, also after a failure: no mount or process is left behind."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.proc = None
        if self.mounted():
            subprocess.run(["umount", "-l", str(self.mountpoint)], capture_output=True)
