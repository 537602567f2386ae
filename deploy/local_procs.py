"""The launcher's view of its server processes: whether one is alive, a signal to it, its log's tail."""
from __future__ import annotations

import os
from pathlib import Path

from .local_layout import ServerSlot


def signal_slot(slot: ServerSlot, sig: int) -> bool:
    """Send ``sig`` to the slot's server when it is alive; whether it was."""
    if not (slot.pid and alive(slot.pid)):
        return False
    try:
        os.kill(slot.pid, sig)
    except ProcessLookupError:
        return False
    return True


def alive(pid: int | None) -> bool:
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


def log_tail(path: str, lines: int = 20) -> str:
    try:
        return "\n".join(Path(path).read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"
