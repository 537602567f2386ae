"""The optional ``bulk_address`` of member records: validated, replicated, and absent in old records."""
from __future__ import annotations

import pytest

from consensus.codec import member_command, member_record, member_to_json
from consensus.errors import Invalid
from consensus.records import MemberRecord
from consensus.state import MetadataState
from paramserver.server.metaservice import _member_pb


def add(state: MetadataState, **extra: str) -> None:
    state.apply({"op": "add_member", "server_id": "ps1", "grpc_address": "127.0.0.1:7000",
                 "raft_address": "127.0.0.1:7100", **extra})


def test_bulk_address_round_trips_through_state_codec_and_proto() -> None:
    state = MetadataState()
    record = MemberRecord("ps1", "127.0.0.1:7000", "127.0.0.1:7100", "up", "z1", "127.0.0.1:7200")
    state.apply(member_command(record))
    stored = state.member("ps1")
    assert stored["bulk_address"] == "127.0.0.1:7200"
    assert member_record(stored) == record
    assert member_to_json(record)["bulk_address"] == "127.0.0.1:7200"
    assert _member_pb(record).bulk_address == "127.0.0.1:7200"


def test_member_without_bulk_address_gets_empty_string() -> None:
    state = MetadataState()
    add(state)
    assert state.member("ps1")["bulk_address"] == ""
    assert MemberRecord("ps1", "a:1", "b:2").bulk_address == ""


def test_old_snapshot_without_the_field_still_loads() -> None:
    state = MetadataState()
    add(state)
    snapshot = state.snapshot()
    for m in snapshot["members"]:
        del m["bulk_address"]  # as written before the field existed
    restored = MetadataState()
    restored.restore(snapshot)
    assert member_record(restored.member("ps1")).bulk_address == ""
    add(restored, bulk_address="127.0.0.1:7300")  # re-registration after the restart adds it
    assert restored.member("ps1")["bulk_address"] == "127.0.0.1:7300"


@pytest.mark.parametrize("bad", ["nonsense", "host:0", "host:99999", ":7000", 7000])
def test_bad_bulk_address_is_refused(bad: object) -> None:
    with pytest.raises(Invalid, match="bulk address"):
        add(MetadataState(), bulk_address=bad)  # type: ignore[arg-type]
