"""Cluster membership from the client side: add a server, drain one, remove one.

Scaling out: start the new server with ``--peer`` naming the members' Raft addresses (and the
cluster's secrets), then :func:`add_member`; the leader checks that it answers as a server of
this cluster, adds it to Raft and to the ring, and re-replication moves its share of the chunks
to it. Taking a server out: :func:`drain` marks it ``leaving`` (the ring stops placing chunks on
it; re-replication on every member, the leaving one included, copies what the new ring wants),
:func:`drain_status` tells when every member's last clean re-replication pass was on the ring
without it, then it is stopped and :func:`remove_member` drops it from Raft and the member list.

``drain_status`` is pure (members and their ServerStatus replies in, a verdict out), so the
rules are unit-tested without servers; the other functions do the calls.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import grpc

from paramserver.client.cluster_view import ClusterView
from paramserver.client.errors import NotFound, TransferError, rpc_code
from paramserver.wire.proto import pb
from paramserver.wire.status_keys import PLACEMENT_AT_KEY, PLACEMENT_RING_KEY

UP, LEAVING = "up", "leaving"


@dataclass(frozen=True)
class Placement:
    """One member's answer to "are your chunks placed on the current ring?"."""

    server_id: str
    state: str  # its member state: up or leaving
    answered: bool
    placed: bool  # its last clean re-replication pass was on the current ring
    detail: str  # what it said, for people


@dataclass(frozen=True)
class DrainStatus:
    target: str
    target_state: str
    ring: tuple[str, ...]  # the up members
    members: tuple[Placement, ...]

    @property
    def pending(self) -> list[Placement]:
        """Members whose chunks are not (known to be) placed on the ring; the target may be silent (stopped)."""
        return [p for p in self.members if not p.placed and (p.answered or p.server_id != self.target)]

    @property
    def target_answers(self) -> bool:
        return any(p.answered for p in self.members if p.server_id == self.target)

    @property
    def drained(self) -> bool:
        """The target is leaving and every member has its chunks on the ring without it.

        A target that does not answer (stopped, or dead) counts as drained once the others are:
        chunks only it held cannot be copied by anyone, and waiting for it would never end."""
        return self.target_state == LEAVING and not self.pending

    def summary(self) -> str:
        if self.target_state != LEAVING:
            return f"{self.target} is {self.target_state}, not draining: run 'paramctl member drain {self.target}' first"
        if self.drained:
            silent = "" if self.target_answers else f" ({self.target} does not answer: chunks only it held could not be copied)"
            return f"{self.target} is drained: every member's chunks are on the ring {','.join(self.ring)}{silent}"
        return (f"{self.target} is not drained yet: " + "; ".join(f"{p.server_id} {p.detail}" for p in self.pending))


def drain_status(target: str, members: Sequence[pb.Member],
                 statuses: Mapping[str, pb.ServerStatusReply | str]) -> DrainStatus:
    """Whether ``target`` can be removed without losing a chunk copy that exists only on it.

    ``statuses``: each member's ServerStatus reply, or why it did not answer. A member is placed
    when the ring of its last clean re-replication pass (``placement_ring``) is the current ring,
    the up members: it then found every committed chunk it holds on all of their replicas there.
    """
    by_id = {m.server_id: m for m in members}
    if target not in by_id:
        raise NotFound(f"no member {target!r} in the cluster (members: {', '.join(sorted(by_id)) or 'none'})")
    ring = tuple(sorted(m.server_id for m in members if m.state == UP))
    want = ",".join(ring)
    out = []
    for m in members:
        st = statuses.get(m.server_id, "not asked")
        if isinstance(st, str):
            out.append(Placement(m.server_id, m.state, False, False, f"does not answer ({st})"))
            continue
        seen = st.extra.get(PLACEMENT_RING_KEY)
        if seen == want:
            when = float(st.extra.get(PLACEMENT_AT_KEY, "0") or 0)
            out.append(Placement(m.server_id, m.state, True, True, f"placed (checked {time.strftime('%H:%M:%S', time.localtime(when))})"))
        elif seen is None:
            out.append(Placement(m.server_id, m.state, True, False, "copying (no clean re-replication pass on this ring yet)"))
        else:
            out.append(Placement(m.server_id, m.state, True, False, f"copying (last clean pass was on the ring {seen or '(none)'})"))
    return DrainStatus(target, by_id[target].state, ring, tuple(out))


def server_statuses(view: ClusterView, members: Sequence[pb.Member]) -> dict[str, pb.ServerStatusReply | str]:
    """Each member's ServerStatus, asked all at once, or the status code name of why it did not answer."""
    def ask(m: pb.Member) -> pb.ServerStatusReply | str:
        try:
            return view.client(m.grpc_address).server_status()
        except grpc.RpcError as exc:
            return rpc_code(exc).name

    with ThreadPoolExecutor(max_workers=max(1, len(members))) as pool:
        return dict(zip((m.server_id for m in members), pool.map(ask, members)))


def current_members(view: ClusterView) -> list[pb.Member]:
    """The member list as the leader has it (a drain or an add that just returned is in it)."""
    return list(view.leader_call(lambda c: c.cluster_info()).members)


def check_drain(view: ClusterView, target: str) -> DrainStatus:
    members = current_members(view)
    return drain_status(target, members, server_statuses(view, members))


def add_member(view: ClusterView, server_id: str, grpc_address: str, raft_address: str, zone: str = "") -> list[pb.Member]:
    """Add a server (it must be running, with this cluster's secrets) or put a draining one back up."""
    member = pb.Member(server_id=server_id, grpc_address=grpc_address, raft_address=raft_address, state=UP, zone=zone)
    return list(view.leader_call(lambda c: c.add_member(member)).members)


def drain(view: ClusterView, target: str) -> bool:
    """Mark ``target`` leaving (placement moves off it); False when it already was."""
    members = {m.server_id: m for m in current_members(view)}
    if target not in members:
        raise NotFound(f"no member {target!r} in the cluster (members: {', '.join(sorted(members))})")
    m = members[target]
    if m.state == LEAVING:
        return False
    if not [x for x in members.values() if x.state == UP and x.server_id != target]:
        raise TransferError(f"{target} is the only member up: draining it would leave no server to hold the chunks",
                            grpc.StatusCode.FAILED_PRECONDITION)
    leaving = pb.Member(server_id=m.server_id, grpc_address=m.grpc_address, raft_address=m.raft_address, state=LEAVING,
                        zone=m.zone, bulk_address=m.bulk_address)
    view.leader_call(lambda c: c.add_member(leaving))
    return True


def wait_drained(view: ClusterView, target: str, timeout_s: float, poll_s: float = 1.0,
                 on_poll: Callable[[DrainStatus], None] | None = None) -> DrainStatus:
    """Poll :func:`check_drain` until it says drained or ``timeout_s`` passes; the last status."""
    end = time.monotonic() + timeout_s
    while True:
        status = check_drain(view, target)
        if on_poll is not None:
            on_poll(status)
        if status.drained or time.monotonic() >= end:
            return status
        time.sleep(min(poll_s, max(0.0, end - time.monotonic())))


def remove_member(view: ClusterView, target: str, *, force: bool = False) -> list[pb.Member]:
    """Drop ``target`` from Raft and the member list. Unless ``force``: it must be drained and stopped.

    Stopped first, because a removed server that keeps running still believes it is a member and
    would start elections; and a stopped server is never the leader, which cannot remove itself."""
    if not force:
        status = check_drain(view, target)
        if not status.drained:
            raise TransferError(f"{status.summary()}; or --force, and chunks whose only copies are on {target} are lost",
                                grpc.StatusCode.FAILED_PRECONDITION)
        if status.target_answers:
            raise TransferError(f"{target} is drained but still running: stop it, then run remove again "
                                "(a removed server that keeps running would disturb the cluster's elections)",
                                grpc.StatusCode.FAILED_PRECONDITION)
    return list(view.leader_call(lambda c: c.remove_member(target)).members)


__all__ = ["DrainStatus", "LEAVING", "Placement", "UP", "add_member", "check_drain", "current_members", "drain",
           "drain_status", "remove_member", "server_statuses", "wait_drained"]
