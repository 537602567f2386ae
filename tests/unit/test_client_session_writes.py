"""ClusterClient as the one session for writes: the options' timeouts and notice kept, a tag move
sent once, to a member that has just answered as the leader (writes.write_once)."""
from __future__ import annotations

import time
from typing import Any, Callable

import pytest

from paramserver.client.cluster_view import ClusterOptions
from paramserver.client.session import ClusterClient
from paramserver.client.writes import NoLongerLeads, leader_status
from paramserver.wire.proto import pb


class Leader:
    address = "127.0.0.1:1"

    def __init__(self, leads: bool = True) -> None:
        self.leads = leads
        self.sent: list[tuple[str, ...]] = []

    def server_status(self) -> pb.ServerStatusReply:
        return pb.ServerStatusReply(server_id="ps1", is_leader=self.leads)

    def set_tag(self, model: str, tag: str, version: int, who: str = "") -> pb.TagReply:
        self.sent.append((model, tag, str(version), who))
        return pb.TagReply(tag=pb.Tag(model=model, tag=tag, version=version))


class View:
    """What the session's writes use of a ClusterView."""

    def __init__(self, leader: Leader) -> None:
        self.leader, self.asked = leader, 0

    def leader_call(self, fn: Callable[[Any], Any], deadline_s: float | None = None, **_kw: Any) -> Any:
        self.asked += 1
        return fn(self.leader)

    def leader_client(self) -> Leader:
        return self.leader

    def close(self) -> None:
        pass


def test_a_session_for_options_keeps_their_timeouts_and_notice() -> None:
    def notice(line: str) -> None:
        pass

    options = ClusterOptions(("127.0.0.1:1",), timeout_s=30.0, discovery_timeout_s=2.0, notice=notice)
    with ClusterClient.for_options(options) as session:
        assert session.options == options and session.options.notice is notice
        assert session.options.timeout_s == session.config.call_timeout_s == 30.0


def test_a_tag_move_goes_once_to_the_member_that_answers_as_the_leader() -> None:
    leader = Leader()
    session = ClusterClient("127.0.0.1:1")
    view = View(leader)
    session._view, session._refreshed_at = view, time.monotonic()  # type: ignore[assignment]
    with session:
        reply = session.set_tag("m", "prod", 2, who="me")
    assert reply.tag.version == 2 and leader.sent == [("m", "prod", "2", "me")] and view.asked == 1
    with pytest.raises(NoLongerLeads):
        leader_status(Leader(leads=False))  # type: ignore[arg-type]
