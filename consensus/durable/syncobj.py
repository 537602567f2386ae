"""pysyncobj integration: the acknowledgement gate, the two patched module globals, and the SyncObj
that syncs at every tick."""
from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable

import pysyncobj.serializer as _pso_serializer
import pysyncobj.syncobj as _pso_syncobj
from pysyncobj import SyncObj
from pysyncobj.syncobj import _RAFT_STATE
from pysyncobj.version import VERSION as PYSYNCOBJ_VERSION

from ..errors import JournalFailure
from .append_entries import trim
from .files import replace_durably
from .journal import DurableJournal

log = logging.getLogger("consensus.durable")

# The patches below rely on pysyncobj internals (module globals, tick order, message names);
# re-read syncobj.py, journal.py and serializer.py of a new version before adding it here.
SUPPORTED_PYSYNCOBJ = ("0.3.17",)


ACK_MESSAGE_TYPES = frozenset({"next_node_idx"})  # a follower's answer to AppendEntries



# ------------------------------------------------------------------ acknowledgement gate
class AckGate:
    """Holds AppendEntries answers until the journal records they acknowledge are durable."""

    def __init__(self, journal: DurableJournal) -> None:
        self.journal = journal
        self._held: list[tuple[Any, Any]] = []
        self._send: Callable[[Any, Any], Any] | None = None

    def attach(self, send: Callable[[Any, Any], Any]) -> None:
        self._send = send

    def holds(self, message: Any) -> bool:
        """Whether ``message`` must wait; later answers queue behind held ones to keep their order."""
        if not self.journal.fsync:
            return False
        is_ack = isinstance(message, dict) and message.get("type") in ACK_MESSAGE_TYPES
        return is_ack and (self.journal.dirty or bool(self._held))

    def hold(self, node: Any, message: Any) -> None:
        self._held.append((node, message))

    @property
    def held(self) -> int:
        return len(self._held)

    def flush(self) -> None:
        """Sync the journal, then send what was held (in order). Raises JournalFailure, holding on."""
        self.journal.sync()
        if not self._held or self._send is None:
            return
        held, self._held = self._held, []
        for node, message in held:
            self._send(node, message)  # a link that broke meanwhile drops it, like any lost message


# ------------------------------------------------------------------ pysyncobj patches
_lock = threading.Lock()
_installed = False
_pending_journals: dict[str, DurableJournal] = {}
_durable_dumps: dict[str, int] = {}
_original_create_journal: Callable[..., Any] | None = None
_original_atomic_replace: Callable[[str, str], Any] | None = None
# pysyncobj's private state setter and pending-reply failer (name-mangled), used to step down once
# the journal failed; install() checks that they exist on this version.
_STEP_DOWN = "_SyncObj__setState"
_LEADER_CHANGED = "_SyncObj__onLeaderChanged"


def check_pysyncobj_version(version: str = PYSYNCOBJ_VERSION) -> None:
    if version not in SUPPORTED_PYSYNCOBJ:
        raise RuntimeError(
            f"consensus/durable patches pysyncobj {', '.join(SUPPORTED_PYSYNCOBJ)} to make Raft state durable, "
            f"but pysyncobj {version} is installed: pin pysyncobj==0.3.17, or re-check the patches against the "
            "new version's syncobj.py, journal.py and serializer.py and add it to SUPPORTED_PYSYNCOBJ"
        )


def install() -> None:
    """Patch pysyncobj's journal factory and dump rename (idempotent; refuses unknown versions)."""
    global _installed, _original_create_journal, _original_atomic_replace
    with _lock:
        if _installed:
            return
        check_pysyncobj_version()
        for module, name in ((_pso_syncobj, "createJournal"), (_pso_serializer, "atomicReplace")):
            if not callable(getattr(module, name, None)):
                raise RuntimeError(f"pysyncobj {PYSYNCOBJ_VERSION} has no {module.__name__}.{name} to patch")
        for cls, name in ((SyncObj, "_onTick"), (SyncObj, "_doDestroy"), (SyncObj, _STEP_DOWN),
                          (SyncObj, _LEADER_CHANGED), (SyncObj, "_SyncObj__onMessageReceived"),
                          (SyncObj, "_SyncObj__getEntries")):
            if not callable(getattr(cls, name, None)):
                raise RuntimeError(f"pysyncobj {PYSYNCOBJ_VERSION} has no SyncObj.{name} to extend")
        _original_create_journal = _pso_syncobj.createJournal
        _original_atomic_replace = _pso_serializer.atomicReplace
        _pso_syncobj.createJournal = _create_journal
        _pso_serializer.atomicReplace = _atomic_replace
        _installed = True


def _create_journal(journalFile: str | None = None) -> Any:  # noqa: N803 - pysyncobj's name
    with _lock:
        journal = _pending_journals.pop(journalFile, None) if journalFile is not None else None
    if journal is not None:
        return journal
    assert _original_create_journal is not None
    return _original_create_journal(journalFile)


def _atomic_replace(oldPath: str, newPath: str) -> Any:  # noqa: N803 - pysyncobj's names
    with _lock:
        durable = newPath in _durable_dumps
    if durable:
        replace_durably(oldPath, newPath)
        return True
    assert _original_atomic_replace is not None
    return _original_atomic_replace(oldPath, newPath)


class DurableSyncObj(SyncObj):  # type: ignore[misc]
    """A SyncObj whose journal is ``journal`` and whose ticks keep the Raft state durable."""

    def __init__(self, self_node: str, other_nodes: list[str], conf: Any, *, journal: DurableJournal,
                 gate: AckGate, **kwargs: Any) -> None:
        install()
        if conf.journalFile != journal.path:
            raise ValueError(f"conf.journalFile {conf.journalFile!r} is not the journal's path {journal.path!r}")
        # Set before SyncObj.__init__, whose tick thread starts inside it, and which leaves
        # attributes that exist by then out of its full dumps.
        self._pdparams_journal = journal
        self._pdparams_gate = gate
        self._pdparams_dump = conf.fullDumpFile if journal.fsync else None
        self._pdparams_stopped_logged = False
        with _lock:
            _pending_journals[journal.path] = journal
            if self._pdparams_dump is not None:
                _durable_dumps[self._pdparams_dump] = _durable_dumps.get(self._pdparams_dump, 0) + 1
        try:
            super().__init__(self_node, other_nodes, conf, **kwargs)
        except BaseException:
            self._pdparams_release()
            raise
        finally:
            with _lock:
                _pending_journals.pop(journal.path, None)

    def _onTick(self, timeToWait: float = 0.0) -> None:  # noqa: N802, N803 - overrides pysyncobj
        journal = self._pdparams_journal
        if journal.failure is None:
            try:
                # Entries added during the last poll (a new leader's no-op, a follower's appends)
                # are durable before this tick's commit count includes this node.
                self._pdparams_gate.flush()
            except JournalFailure:
                pass
        if journal.failure is None:
            try:
                super()._onTick(timeToWait)
            except JournalFailure:
                # Raised from inside pysyncobj (an append, a vote's term, the meta timer), which
                # left that step half done: the branch below stops the node before anything more
                # of it runs. The journal logged why; a traceback per tick would add nothing.
                pass
            else:
                return
        # Fail-stop: no votes, no acknowledgements, no heartbeats, no more truncation; the others
        # elect without us, and the process exits (it polls MetadataNode.failure()).
        if not self._pdparams_stopped_logged:
            self._pdparams_stopped_logged = True
            log.critical("Raft stopped on this server: %s", journal.failure)
            self._pdparams_step_down()
        time.sleep(timeToWait)

    def _SyncObj__onMessageReceived(self, node: Any, message: Any) -> None:  # noqa: N802 - pysyncobj's (mangled) name
        """Every message from a peer (the transport's callback, set in SyncObj.__init__ by this name):
        an AppendEntries re-sending entries this follower holds keeps them (append_entries.trim)."""
        if isinstance(message, dict) and message.get("type") == "append_entries":
            log_ = self._SyncObj__raftLog

            def term_at(index: int) -> int | None:
                found = self._SyncObj__getEntries(index, 1)
                return found[0][2] if found and found[0][1] == index else None

            message = trim(message, term_at, log_[-1][1])
        SyncObj._SyncObj__onMessageReceived(self, node, message)

    def _pdparams_step_down(self) -> None:
        """Leave the leader (or candidate) role: callers stop seeing this node as leader.

        pysyncobj has no public way to do it; its own step-down (leaderFallbackTimeout) is these
        two steps, and pending forwarded commands fail as on any leader change."""
        try:
            self._SyncObj__raftLeader = None
            getattr(self, _STEP_DOWN)(_RAFT_STATE.FOLLOWER)
            getattr(self, _LEADER_CHANGED)()
        except Exception:  # a callback of pysyncobj's (onStateChanged); the node is stopped regardless
            log.exception("stepping down after a Raft journal failure")

    def _doDestroy(self) -> None:  # noqa: N802 - overrides pysyncobj
        try:
            super()._doDestroy()
        finally:
            self._pdparams_release()

    def _pdparams_release(self) -> None:
        dump = self._pdparams_dump
        if dump is None:
            return
        self._pdparams_dump = None
        with _lock:
            left = _durable_dumps.get(dump, 0) - 1
            if left > 0:
                _durable_dumps[dump] = left
            else:
                _durable_dumps.pop(dump, None)
