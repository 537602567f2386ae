"""`paramctl member drain` / `remove` decide from ServerStatus replies alone: the rules, without servers."""
from __future__ import annotations

import pytest

from paramserver.client.errors import NotFound
from paramserver.client.members import drain_status
from paramserver.wire.proto import pb
from paramserver.wire.status_keys import PLACEMENT_AT_KEY, PLACEMENT_RING_KEY


def member(sid: str, state: str = "up") -> pb.Member:
    return pb.Member(server_id=sid, grpc_address=f"127.0.0.1:{len(sid)}", raft_address="127.0.0.1:9", state=state)


def placed(ring: str | None) -> pb.ServerStatusReply:
    reply = pb.ServerStatusReply()
    if ring is not None:
        reply.extra[PLACEMENT_RING_KEY] = ring
        reply.extra[PLACEMENT_AT_KEY] = "1700000000.0"
    return reply


MEMBERS = [member("ps1", "leaving"), member("ps2"), member("ps3"), member("ps4")]


def test_drained_when_every_member_was_clean_on_the_ring_without_the_target() -> None:
    st = drain_status("ps1", MEMBERS, {s: placed("ps2,ps3,ps4") for s in ("ps1", "ps2", "ps3", "ps4")})
    assert st.ring == ("ps2", "ps3", "ps4") and st.drained and st.target_answers
    assert "ps1 is drained" in st.summary() and not st.pending


def test_a_member_still_on_the_old_ring_or_without_a_clean_pass_keeps_it_pending() -> None:
    st = drain_status("ps1", MEMBERS, {"ps1": placed("ps2,ps3,ps4"), "ps2": placed("ps1,ps2,ps3,ps4"),
                                       "ps3": placed(None), "ps4": placed("ps2,ps3,ps4")})
    assert not st.drained and [p.server_id for p in st.pending] == ["ps2", "ps3"]
    assert "ps1,ps2,ps3,ps4" in st.summary() and "no clean re-replication pass" in st.summary()


def test_a_silent_target_counts_as_drained_once_the_others_are_but_a_silent_other_does_not() -> None:
    others = {s: placed("ps2,ps3,ps4") for s in ("ps2", "ps3", "ps4")}
    st = drain_status("ps1", MEMBERS, {**others, "ps1": "UNAVAILABLE"})
    assert st.drained and not st.target_answers and "does not answer" in st.summary()
    st = drain_status("ps1", MEMBERS, {**others, "ps1": placed("ps2,ps3,ps4"), "ps3": "DEADLINE_EXCEEDED"})
    assert not st.drained and "ps3 does not answer (DEADLINE_EXCEEDED)" in st.summary()


def test_a_member_that_is_up_is_not_drained_and_an_unknown_one_is_not_found() -> None:
    st = drain_status("ps2", MEMBERS, {s: placed("ps2,ps3,ps4") for s in ("ps1", "ps2", "ps3", "ps4")})
    assert not st.drained and "member drain ps2" in st.summary()
    with pytest.raises(NotFound, match="no member 'ps9'.*ps1, ps2, ps3, ps4"):
        drain_status("ps9", MEMBERS, {})
