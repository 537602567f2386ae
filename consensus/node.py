"""MetadataNode: the MetadataPlane (consensus/api.py) on pysyncobj.

A node whose Raft state cannot be written (``failure()`` is set: disk full, I/O error) has left
Raft for good: it reports no leader, refuses reads and writes with RaftStopped, and its process
is expected to exit with the reason. Leader changes are logged at INFO from the tick thread.
"""
from __future__ import annotations

import logging
import threading
import time
import uuid
from typing import Any, Callable, Mapping, Sequence, TypeVar

from pysyncobj import SyncObj, SyncObjConf
from pysyncobj.config import FAIL_REASON

from .codec import member_command, member_record, tag_record, version_record
from .config import RaftConfig
from .durable import (AckGate, DurableJournal, DurableSyncObj, check_dump, dump_log_tail, fsync_path_and_ancestors,
                      install)
from .errors import CommitTimeout, Conflict, NodeNotStarted, NoQuorum, NotLeader, RaftStopped, Unavailable
from .links import transport_class
from .records import MemberRecord, ReadResult, TagRecord, VersionRecord
from .replica import StateReplica, unwrap
from .state import MetadataState
from .sync import SyncFacts, SyncVerdict, judge_sync
from .validation import check_name

log = logging.getLogger(__name__)
T = TypeVar("T")

# Failures after which the command certainly or possibly did not commit. Resending is
# safe: every write carries a request id and the state machine applies an id once.
_RETRYABLE = {
    FAIL_REASON.QUEUE_FULL,
    FAIL_REASON.MISSING_LEADER,
    FAIL_REASON.DISCARDED,
    FAIL_REASON.NOT_LEADER,
    FAIL_REASON.LEADER_CHANGED,
    FAIL_REASON.UNKNOWN_OUTCOME,
}
_BIND_RETRIES = 20
_BIND_RETRY_TIME = 0.25
# How often a caller waiting for a commit looks at failure(): a node that stopped answers
# within this, not at the commit timeout.
_FAILURE_POLL = 0.05


def _racy(read: Callable[[], T]) -> T:
    """Read pysyncobj's sets from a caller thread while its tick thread may be changing them."""
    for _ in range(100):
        try:
            return read()
        except RuntimeError:  # "changed size during iteration"
            time.sleep(0.001)
    return read()


class _Progress:
    """What ``sync_state`` needs that only pysyncobj's tick thread may read (its log, its per-peer
    answer times): kept up to date by a tick callback, read by any thread (plain attributes)."""

    def __init__(self, so: SyncObj) -> None:
        self._so = so
        self.applied_term = -1  # the newest term of an entry this node has applied
        self.heard_at: float | None = None  # time.monotonic() (pysyncobj's clock) the leader last spoke; leading: a majority
        self._deadline: float | None = None

    def tick(self) -> None:
        try:
            self._observe()
        except Exception:  # an error here must never stop Raft's tick thread; sync_state stays conservative
            log.debug("sync progress not observed this tick", exc_info=True)

    def _observe(self) -> None:
        so = self._so
        term = so.raftCurrentTerm
        if self.applied_term != term:
            # Once an entry of this term is applied, so is everything earlier leaders committed.
            applied = so._SyncObj__getEntries(so.raftLastApplied, 1)
            if applied and applied[0][2] == term:
                self.applied_term = term
        if so._isLeader():
            # A leader stays sure it leads while a majority (itself included) answered within an election timeout.
            others = list(so._SyncObj__otherNodes)
            need = (len(others) + 1) // 2
            answered = sorted((so._SyncObj__lastResponseTime.get(n, 0.0) for n in others), reverse=True)
            self.heard_at = time.monotonic() if need == 0 else answered[need - 1]
            self._deadline = None
            return
        # pysyncobj moves a follower's election deadline on every AppendEntries from its leader (and on a
        # vote it grants, when it names no leader anyway): a moved deadline means the leader was just heard.
        deadline = so._SyncObj__raftElectionDeadline
        if deadline != self._deadline:
            self._deadline = deadline
            self.heard_at = time.monotonic()


class MetadataNode:
    """One member of the metadata cluster. Thread-safe; writes block until committed."""

    def __init__(self, config: RaftConfig, *, clock: Callable[[], float] = time.time) -> None:
        config.validate()
        self._config = config
        self._clock = clock  # stamps created_at / when on the proposer; apply never reads a clock
        self._replica = StateReplica()
        self._syncobj: SyncObj | None = None
        self._journal: DurableJournal | None = None
        self._progress: _Progress | None = None

    # ------------------------------------------------------------- lifecycle
    def start(self) -> None:
        if self._syncobj is not None:
            return
        cfg = self._config
        install()  # refuses a pysyncobj version its patches were not written for
        cfg.data_dir.mkdir(parents=True, exist_ok=True)
        if cfg.fsync:
            fsync_path_and_ancestors(str(cfg.data_dir))
        # Damaged state files stop start-up here, with DamagedState naming the file.
        check_dump(str(cfg.dump_file))
        dump_tail = dump_log_tail(str(cfg.dump_file))
        # A journal cut below its own commit index stops start-up too (DamagedState naming the
        # file), before anything in it changes, instead of a server serving a state it cannot apply.
        journal = DurableJournal(str(cfg.journal_file), fsync=cfg.fsync, dump_tail=dump_tail, check_commit_index=True)
        gate = AckGate(journal)
        conf = SyncObjConf(
            password=cfg.secret,
            raftMinTimeout=cfg.election_min_timeout,
            raftMaxTimeout=cfg.election_max_timeout,
            appendEntriesPeriod=cfg.append_entries_period,
            appendEntriesUseBatch=cfg.batch_appends,
            connectionTimeout=cfg.connection_timeout,
            connectionRetryTime=cfg.connection_retry,
            leaderFallbackTimeout=cfg.leader_fallback_timeout,
            tcp_keepalive=cfg.tcp_keepalive,
            journalFile=str(cfg.journal_file),
            fullDumpFile=str(cfg.dump_file),
            logCompactionMinEntries=cfg.log_compaction_min_entries,
            logCompactionMinTime=cfg.log_compaction_min_time,
            dynamicMembershipChange=True,
            # Bind to the configured host only, not pysyncobj's default 0.0.0.0: peers' messages are unpickled.
            bindAddress=cfg.raft_address,
            bindRetryTime=_BIND_RETRY_TIME,
            maxBindRetries=_BIND_RETRIES,
            # Forking a process that runs gRPC threads is unsafe; the dump is small anyway.
            useFork=False,
        )
        try:
            # A power loss between the full dump's rename and the journal's compaction leaves a
            # journal that pysyncobj would throw away, entries after the dump and all.
            journal.resume_compaction(dump_tail)
            syncobj = DurableSyncObj(
                cfg.raft_address,
                list(cfg.peers),
                conf,
                journal=journal,
                gate=gate,
                consumers=[self._replica],
                transportClass=transport_class(cfg.link_keepalive_period, gate),
            )
        except BaseException:
            journal._destroy()
            raise
        try:
            syncobj.waitBinded()
        except Exception as exc:
            syncobj.destroy_synchronous()
            raise Unavailable(f"cannot listen on {cfg.raft_address} for Raft: {exc}; is the port in use?") from exc
        syncobj.addOnTickCallback(self._leader_observer(syncobj))
        progress = _Progress(syncobj)
        syncobj.addOnTickCallback(progress.tick)
        self._progress = progress
        self._syncobj = syncobj
        self._journal = journal

    def _leader_observer(self, so: SyncObj) -> Callable[[], None]:
        """A tick callback that logs each change of the leader this node knows (two reads per tick)."""
        me = self._config.raft_address
        seen: list[str | None] = [None]  # a node starts knowing no leader: nothing to log until it learns one

        def observe() -> None:
            leader = so._getLeader()
            address = leader.address if leader is not None else None
            if address != seen[0]:
                seen[0] = address
                log.info("raft leader changed: term=%d leader=%s self=%s", so.raftCurrentTerm, address or "none", me)

        return observe

    def failure(self) -> str | None:
        """None while this node's Raft state is written fine; else the one-line reason it left Raft.

        Set by the first failed write or sync of the journal or the term/vote file and never
        cleared (a retried fsync could report success for data that is gone); it outlives
        close(). None before start().
        """
        journal = self._journal
        return journal.failure if journal is not None else None

    def close(self) -> None:
        syncobj, self._syncobj = self._syncobj, None
        if syncobj is not None:
            syncobj.destroy_synchronous()

    def wait_ready(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while True:
            so = self._syncobj
            if self.failure() is not None:
                return False
            if so is not None and so._getLeader() is not None and so.isReady() \
                    and so.raftLastApplied >= so.raftCommitIndex:
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.02)

    def in_sync(self) -> bool:
        """True while this node's local reads miss nothing committed before its last heartbeat
        (``sync_state``). A node alone, starting from an empty or restored journal, cut off, or a
        new leader whose first entry has not committed yet, is not in sync."""
        return self.sync_state().in_sync

    def sync_state(self) -> SyncVerdict:
        """Whether this node's local state may answer a serializable read, and why not
        (``consensus.sync.judge_sync``; servers refuse such reads while it is not)."""
        so, progress = self._syncobj, self._progress
        if so is None or progress is None:
            return SyncVerdict(False, "its Raft node is not running")
        # A follower caps its own commit index at the log it holds, so while it is still catching up
        # raftCommitIndex == raftLastApplied says nothing; the leader's commit index (from its
        # last AppendEntries, or our own as leader) is what must have been applied.
        leader_commit = getattr(so, "_SyncObj__leaderCommitIndex", None)
        heard_at = progress.heard_at
        facts = SyncFacts(
            leading=bool(so._isLeader()),
            leader_known=self.leader_raft_address() is not None,
            ready=bool(so.isReady()),
            last_applied=int(so.raftLastApplied),
            leader_commit=leader_commit if isinstance(leader_commit, int) else None,
            term=int(so.raftCurrentTerm),
            applied_term=progress.applied_term,
            heard_age_s=None if heard_at is None else max(0.0, time.monotonic() - heard_at),
            failure=self.failure(),
        )
        return judge_sync(facts, self._config.election_max_timeout)

    # ------------------------------------------------------ identity, status
    @property
    def server_id(self) -> str:
        return self._config.server_id

    @property
    def config(self) -> RaftConfig:
        return self._config

    def is_leader(self) -> bool:
        so = self._syncobj
        return bool(so is not None and self.failure() is None and so._isLeader())

    def leader_raft_address(self) -> str | None:
        so = self._syncobj
        if so is None or self.failure() is not None:
            return None  # a stopped node hears no one: whatever it last knew may be stale
        leader = so._getLeader()
        if leader is None:
            return None
        if not so._isLeader() and not so.isNodeConnected(leader):
            # pysyncobj starts no election while it is connected to no one, so a member whose
            # peers all went away keeps naming its last leader for good; unreachable, it is none.
            return None
        return str(leader.address)

    def term(self) -> int:
        return int(self._require()._getTerm())

    def commit_index(self) -> int:
        return int(self._require().raftCommitIndex)

    def cluster_addresses(self) -> list[str]:
        """Raft addresses of the current Raft configuration, this node included."""
        so = self._require()
        return _racy(lambda: sorted({so.selfNode.address} | {n.address for n in so.otherNodes}))

    def status(self) -> Mapping[str, object]:
        so = self._require()
        return {
            "server_id": self.server_id,
            "raft_address": self._config.raft_address,
            "is_leader": self.is_leader(),
            "leader": self.leader_raft_address(),
            "term": so.raftCurrentTerm,
            "commit_index": so.raftCommitIndex,
            "last_applied": so.raftLastApplied,
            "has_quorum": _racy(lambda: so.hasQuorum),
            "ready": so.isReady(),
            "cluster": self.cluster_addresses(),
            # Group commits of the journal so far (each one fdatasync) and the time they took.
            "fsync": self._config.fsync,
            "journal_syncs": self._journal.sync_count if self._journal is not None else 0,
            "journal_sync_seconds": self._journal.sync_seconds if self._journal is not None else 0.0,
            # Set once a write or sync of the Raft state failed: this node then takes no part in Raft.
            "raft_failure": self.failure(),
        }

    # ---------------------------------------------------------------- writes
    def commit_version(
        self,
        model: str,
        manifest_id: str,
        parent: int | None,
        publisher: str,
        nbytes: int,
        chunk_count: int,
        *,
        created_at: float | None = None,
        force: bool = False,
        tag: str | None = None,
    ) -> VersionRecord:
        with self._replica.lock:
            rule = self._replica.state.proposal_clock_rule()
        result = self._propose({
            "op": "commit_version",
            "model": model,
            "manifest_id": manifest_id,
            "parent": parent,
            "publisher": publisher,
            "nbytes": nbytes,
            "chunk_count": chunk_count,
            "created_at": self._clock() if created_at is None else created_at,
            "force": force,
            "tag": tag,
            "clock_rule": rule,
        })
        return version_record(result)

    def set_tag(self, model: str, tag: str, version: int, who: str) -> TagRecord:
        return tag_record(self._propose(
            {"op": "set_tag", "model": model, "tag": tag, "version": version, "who": who, "when": self._clock()}
        ))

    def rollback_tag(self, model: str, tag: str, who: str) -> TagRecord:
        return tag_record(self._propose(
            {"op": "rollback_tag", "model": model, "tag": tag, "who": who, "when": self._clock()}
        ))

    def delete_tag(self, model: str, tag: str, who: str) -> None:
        self._propose({"op": "delete_tag", "model": model, "tag": tag, "who": who, "when": self._clock()})

    def delete_version(self, model: str, version: int) -> None:
        self._propose({"op": "delete_version", "model": model, "version": version})

    def add_member(self, member: MemberRecord) -> None:
        """Upsert the member record; a Raft address new to the cluster joins Raft first."""
        command = member_command(member)
        with self._replica.lock:
            self._replica.state.check_add_member(command)
        deadline = time.monotonic() + self._config.commit_timeout
        if member.raft_address not in self.cluster_addresses():
            self._change_membership("add", member.raft_address, deadline)
        self._propose(command, deadline=deadline)

    def remove_member(self, server_id: str) -> None:
        """Drop the member from Raft, then its record. Call it on another member, not on the one leaving."""
        with self._replica.lock:
            member = self._replica.state.member(check_name("server id", server_id))
        address = member["raft_address"]
        if address == self._config.raft_address:
            raise Conflict(f"member {server_id} cannot remove itself; call remove_member on another member")
        if address == self.leader_raft_address():
            # pysyncobj's leader refuses to remove itself from the configuration.
            raise Conflict(
                f"member {server_id} is the Raft leader; call transfer_leadership() on it (or stop it) "
                "and then remove it from another member"
            )
        deadline = time.monotonic() + self._config.commit_timeout
        if address in self.cluster_addresses():
            self._change_membership("remove", address, deadline)
        self._propose({"op": "remove_member", "server_id": server_id}, deadline=deadline)

    # ----------------------------------------------------------------- reads
    def resolve_tag(self, model: str, tag: str, *, linearizable: bool = False) -> ReadResult[VersionRecord]:
        return self._read(lambda s: version_record(s.resolve_tag(model, tag)), linearizable)

    def get_version(self, model: str, number: int, *, linearizable: bool = False) -> ReadResult[VersionRecord]:
        return self._read(lambda s: version_record(s.get_version(model, number)), linearizable)

    def list_models(self) -> ReadResult[Sequence[str]]:
        return self._read(lambda s: tuple(s.list_models()), False)

    def list_versions(self, model: str) -> ReadResult[Sequence[VersionRecord]]:
        return self._read(lambda s: tuple(version_record(v) for v in s.list_versions(model)), False)

    def list_tags(self, model: str) -> ReadResult[Sequence[TagRecord]]:
        return self._read(lambda s: tuple(tag_record(t) for t in s.list_tags(model)), False)

    def members(self) -> ReadResult[Sequence[MemberRecord]]:
        return self._read(lambda s: tuple(member_record(m) for m in s.members()), False)

    def head(self, model: str, *, linearizable: bool = False) -> ReadResult[VersionRecord | None]:
        """The version a new push should name as parent (the newest non-forced one)."""
        def read(s: MetadataState) -> VersionRecord | None:
            head = s.head(model)
            return version_record(head) if head is not None else None
        return self._read(read, linearizable)

    def transfer_leadership(self, timeout: float | None = None) -> str:
        """Hand leadership to the most caught-up follower; return the new leader's Raft address.

        Call it on the leader, e.g. before stopping it or removing it from the cluster.
        """
        so = self._healthy()
        if not so._isLeader():
            raise NotLeader(f"{self.server_id} is not the leader; call transfer_leadership on it",
                            leader=self.leader_raft_address())
        deadline = time.monotonic() + (timeout or self._config.commit_timeout)
        box: list[int] = []
        fired = threading.Event()

        def on_tick() -> None:
            # pysyncobj's internals belong to its tick thread, so the request is made there.
            if not fired.is_set():
                fired.set()
                so.transferLeadership(callback=lambda _res, reason: box.append(reason))

        so.addOnTickCallback(on_tick)
        try:
            while not box and time.monotonic() < deadline:
                self._healthy()  # a node that stopped ticking never runs on_tick
                time.sleep(0.01)
        finally:
            so.removeOnTickCallback(on_tick)
        if not box or box[0] != FAIL_REASON.SUCCESS:
            raise Unavailable(f"no follower is caught up enough to take over from {self.server_id}; retry shortly")
        while time.monotonic() < deadline:
            leader = self.leader_raft_address()
            if leader is not None and leader != self._config.raft_address:
                return leader
            time.sleep(0.01)
        raise CommitTimeout(f"leadership did not move away from {self.server_id} in time; check status()")

    def barrier(self) -> None:
        """Return once every write committed before the call is applied on this node."""
        self._propose({"op": "barrier"}, dedupe=False)

    # -------------------------------------------------------------- plumbing
    def _require(self) -> SyncObj:
        so = self._syncobj
        if so is None:
            raise NodeNotStarted(f"metadata node {self.server_id} is not running; call start() first")
        return so

    def _healthy(self) -> SyncObj:
        """The SyncObj, for reads and writes: RaftStopped once the node left Raft (its state no longer advances)."""
        so = self._require()
        failure = self.failure()
        if failure is not None:
            raise RaftStopped(f"metadata node {self.server_id} stopped: {failure}")
        return so

    def _read(self, fn: Callable[[MetadataState], T], linearizable: bool) -> ReadResult[T]:
        so = self._healthy()
        if linearizable:
            # A no-op through the leader: once it is applied here, so is every earlier commit.
            self.barrier()
        with self._replica.lock:
            value = fn(self._replica.state)
            last_applied = so.raftLastApplied
        return ReadResult(
            value=value,
            # What the state read reflects: a follower catching up may know of commits it has not
            # applied, and a client comparing reads (paramserver.client.monotonic) must not take
            # its older state for a later one.
            commit_index=last_applied,
            server_id=self.server_id,
            linearizable=linearizable,
            extra={"last_applied": last_applied, "term": so.raftCurrentTerm, "leader": self.leader_raft_address()},
        )

    def _propose(self, command: dict[str, Any], *, deadline: float | None = None, dedupe: bool = True) -> Any:
        if dedupe:
            command = dict(command, request_id=uuid.uuid4().hex)
        outcome = self._submit(lambda callback: self._replica.apply(command, callback=callback), deadline)
        return unwrap(outcome)

    def _change_membership(self, kind: str, address: str, deadline: float) -> None:
        so = self._healthy()
        submit = so.addNodeToCluster if kind == "add" else so.removeNodeFromCluster

        def settled() -> bool:
            # The leader denies a change it already has; our view catches up when it replicates.
            return (address in self.cluster_addresses()) == (kind == "add")

        self._submit(lambda callback: submit(address, callback=callback), deadline,
                     denied_is_retryable=True, settled=settled)

    def _submit(
        self, send: Callable[[Callable[[Any, int], None]], None], deadline: float | None,
        *, denied_is_retryable: bool = False, settled: Callable[[], bool] | None = None,
    ) -> Any:
        so = self._healthy()
        if deadline is None:
            deadline = time.monotonic() + self._config.commit_timeout
        last_reason: int | None = None
        pause = 0.01
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise self._unavailable(so, last_reason)
            so = self._healthy()
            done = threading.Event()
            box: list[tuple[Any, int]] = []

            def callback(result: Any, reason: int, box: list[tuple[Any, int]] = box, done: threading.Event = done) -> None:
                box.append((result, reason))
                done.set()

            send(callback)
            while not done.wait(min(_FAILURE_POLL, max(0.0, deadline - time.monotonic()))):
                if self.failure() is not None:
                    # The node left Raft with this command in flight: it may still commit on the others.
                    raise RaftStopped(f"metadata node {self.server_id} stopped before confirming the write (it may "
                                      f"still commit on the other members; read it back): {self.failure()}")
                if time.monotonic() >= deadline:
                    raise self._unavailable(so, last_reason)
            result, reason = box[0]
            if reason == FAIL_REASON.SUCCESS:
                return result
            retryable = reason in _RETRYABLE or (denied_is_retryable and reason == FAIL_REASON.REQUEST_DENIED)
            if not retryable:
                raise Conflict(f"the cluster refused the request (pysyncobj reason {reason}); retry later")
            last_reason = reason
            if settled is not None and settled():
                return None
            time.sleep(min(pause, max(0.0, deadline - time.monotonic())))
            pause = min(pause * 2, 0.2)

    def _unavailable(self, so: SyncObj, last_reason: int | None) -> Unavailable:
        timeout = self._config.commit_timeout
        leader = so._getLeader()
        if leader is None or not _racy(lambda: so.hasQuorum):
            return NoQuorum(
                f"no leader reachable from {self.server_id} within {timeout}s: a majority of the metadata "
                "servers is down or partitioned away; retry when they are back"
            )
        if last_reason in (FAIL_REASON.NOT_LEADER, FAIL_REASON.LEADER_CHANGED):
            return NotLeader(
                f"leadership kept changing for {timeout}s; retry, or send the write to {leader.address}",
                leader=leader.address,
            )
        if last_reason == FAIL_REASON.REQUEST_DENIED:
            return CommitTimeout(
                f"another membership change was still in progress after {timeout}s; retry when it has finished"
            )
        return CommitTimeout(
            f"the write was not confirmed committed within {timeout}s (leader {leader.address}); "
            "it may still commit: read it back before retrying"
        )
