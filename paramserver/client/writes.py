"""Writes through the leader, for the client session: push's head and commit, paramctl's tag moves.

Every write follows the leader through an election (``ClusterView.leader_call``, whose notices
the CLIs print). A commit is never sent twice blindly (``commit``); a tag move is sent once, to a
member that has just answered as the leader (``write_once``). ``ClusterClient`` offers these as
methods; ``push`` and ``paramctl`` call them on the session's view.
"""
from __future__ import annotations

from typing import Callable, Collection, TypeVar

import grpc

from chunking.manifest import Manifest
from paramserver.client.cluster_view import RETRYABLE, ClusterView
from paramserver.client.errors import ClusterUnreachable, NoLongerLeads, PushConflict, PushError, TransferError, rpc_code, rpc_details
from paramserver.client.manifests import read_manifest
from paramserver.client.rpc import ParamServerClient
from paramserver.wire.proto import pb

T = TypeVar("T")


def head_version(view: ClusterView, model: str) -> int | None:
    """The latest version number of ``model`` (asked of the leader), None for a new model."""
    try:
        versions = view.leader_call(lambda c: c.list_versions(model)).versions
    except ClusterUnreachable as exc:
        raise TransferError(f"cannot list the versions of {model}: {exc}", grpc.StatusCode.UNAVAILABLE) from None
    except grpc.RpcError as exc:
        if rpc_code(exc) == grpc.StatusCode.NOT_FOUND:
            return None
        raise TransferError(f"cannot list the versions of {model}: {rpc_details(exc)}", rpc_code(exc)) from None
    return max((v.number for v in versions), default=None)


def fetch_manifest(view: ClusterView, model: str, version: int) -> Manifest:
    """The manifest of ``model`` v``version``: named by the leader (a version just committed is
    there), read by the client's one manifest reader (``manifests.read_manifest``: cached, its
    parts from the leader first, then the other members)."""
    try:
        reply = view.leader_call(lambda c: c.get_manifest(model=model, version=version))
    except grpc.RpcError as exc:
        raise TransferError(f"cannot read the manifest of {model} v{version}: {rpc_details(exc)}", rpc_code(exc)) from None
    return read_manifest(reply.manifest_id, leader_first(view), view.client, root=reply.data)


def leader_first(view: ClusterView) -> list[str]:
    """The leader's address (when the view knows it), then the other members that are up."""
    up = [m.grpc_address for m in view.members.values() if m.state == "up"]
    return list(dict.fromkeys([view.info.leader_grpc_address, *up] if view.info.leader_grpc_address else up))


def _find_committed(view: ClusterView, model: str, manifest_id: str, parent: int | None, publisher: str) -> pb.Version | None:
    """A version an earlier CommitVersion try committed before its reply was lost."""
    try:
        versions = view.leader_call(lambda c: c.list_versions(model)).versions
    except (grpc.RpcError, TransferError):
        return None
    for v in versions:
        same_parent = (v.parent if v.HasField("parent") else None) == parent
        if v.manifest_id == manifest_id and v.publisher == publisher and same_parent:
            return v
    return None


def commit(
    view: ClusterView,
    *,
    model: str,
    manifest_id: str,
    parent: int | None,
    publisher: str,
    tag: str | None,
    nbytes: int,
    chunk_count: int,
    force: bool,
    deadline_s: float,
    suspects: Collection[str] = (),
) -> pb.Version:
    """CommitVersion at the leader, following it through an election (``ClusterView.leader_call``):
    a leader that went silent costs the election, not a deadline.

    Never commits twice: a try whose reply was lost, whose deadline passed, or that was abandoned
    because a member named a newer leader may still have committed, so before sending again (and
    before reporting a failure) the leader's versions are checked for it (``_find_committed``). A
    try that cannot be checked is sent again only under the same parent, which the state machine
    refuses once a first try landed (ABORTED, resolved by the same check). ``suspects``: server ids
    that just failed this push (a broken stream); when the leader is one, the other members are
    asked who leads with the first try.
    """
    sent = 0

    def send(c: ParamServerClient) -> pb.Version:
        nonlocal sent
        sent += 1
        return c.commit_version(
            model, manifest_id, parent=parent, publisher=publisher, tag=tag or "", force=force, nbytes=nbytes, chunk_count=chunk_count
        ).version

    def landed() -> pb.Version | None:
        return _find_committed(view, model, manifest_id, parent, publisher)

    try:
        return view.leader_call(send, deadline_s, before_resend=landed, suspect=view.info.leader_id in suspects)
    except ClusterUnreachable as exc:
        code, details = grpc.StatusCode.UNAVAILABLE, str(exc)
    except grpc.RpcError as exc:
        code, details = rpc_code(exc), rpc_details(exc)
    if code == grpc.StatusCode.ABORTED:
        if sent > 1:  # an earlier try may have landed after all, making our parent stale
            found = landed()
            if found is not None:
                return found
        head = head_version(view, model)
        raise PushConflict(
            f"push of {model} was based on version {parent if parent is not None else '(none)'} but version {head} "
            f"was committed first; pull {model} v{head}, apply the change on it and push again with --parent {head} "
            f"(or without --parent to push on the head). Server: {details}",
            model=model, parent=parent, head=head,
        ) from None  # fmt: skip
    if code in RETRYABLE:
        # A commit that timed out may still have landed (Raft applied it, the reply was lost).
        found = landed()
        if found is not None:
            return found
    outcome = "nothing was committed" if code not in RETRYABLE else (
        "no committed version was found for it, but the outcome is unknown until the cluster answers again: "
        "check with 'paramctl ls " + model + "' before pushing again")  # fmt: skip
    raise PushError(f"CommitVersion of {model} failed ({code.name}): {details}; {outcome}", code) from None


def leader_status(client: ParamServerClient) -> pb.ServerStatusReply:
    status = client.server_status()
    if not status.is_leader:
        raise NoLongerLeads(client.address)
    return status


def write_once(view: ClusterView, call: Callable[[ParamServerClient], T]) -> T:
    """``call(leader)`` once a member answers as the leader. Found with ``leader_call`` (through an
    election, with its notice and its ClusterUnreachable when there is none), the write itself is
    sent once: a rollback sent again after a lost answer would move the tag back twice."""
    view.leader_call(leader_status)
    return call(view.leader_client())


__all__ = ["NoLongerLeads", "commit", "fetch_manifest", "head_version", "leader_first", "leader_status", "write_once"]
