"""A heat report reaches every up member even when one refuses it for a moment (a lagging follower)."""
from __future__ import annotations


import grpc
import pytest

from paramserver.client.rpc import ParamServerClient

from paramserver.client import session as session_mod
from paramserver.client.session import ClusterClient
from paramserver.wire.proto import pb


class _Refused(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode) -> None:
        self._code = code

    def code(self) -> grpc.StatusCode:
        return self._code


class _Server:
    def __init__(self, refusals: list[grpc.StatusCode]) -> None:
        self.refusals = list(refusals)
        self.accepted: list[list[tuple[int, int, int]]] = []

    def report_heat_encoded(self, request: bytes) -> None:
        if self.refusals:
            raise _Refused(self.refusals.pop(0))
        parsed = pb.ReportHeatRequest.FromString(request)  # what a server reads: protobuf's own parser
        assert (parsed.model, parsed.version) == ("m", 1)
        self.accepted.append([(e.chunk_index, e.count, e.first_access_order) for e in parsed.entries])


def _client(monkeypatch: pytest.MonkeyPatch, servers: dict[str, _Server], states: dict[str, str]) -> ClusterClient:
    client = ClusterClient(["127.0.0.1:9"])
    members = {sid: pb.Member(server_id=sid, grpc_address=sid, state=states[sid]) for sid in servers}
    monkeypatch.setattr(client, "members", lambda: members)
    monkeypatch.setattr(client, "server", lambda address: servers[address])
    monkeypatch.setattr(session_mod, "HEAT_RETRY_DELAYS_S", (0.0, 0.0, 0.0))
    return client


def test_a_member_that_does_not_know_the_version_yet_gets_the_report_again(monkeypatch: pytest.MonkeyPatch) -> None:
    servers = {
        "a": _Server([]),
        "b": _Server([grpc.StatusCode.NOT_FOUND, grpc.StatusCode.UNAVAILABLE]),  # lagging, then busy
        "c": _Server([grpc.StatusCode.INVALID_ARGUMENT]),  # a refusal that a retry cannot change
        "d": _Server([]),
    }
    client = _client(monkeypatch, servers, {"a": "up", "b": "up", "c": "up", "d": "down"})
    entries = [(0, 2, 0), (1, 1, 1)]
    try:
        assert client.report_heat("m", 1, entries) == 2
    finally:
        client.close()
    assert servers["a"].accepted == [entries] and servers["b"].accepted == [entries]
    assert servers["c"].accepted == [] and servers["c"].refusals == []  # tried once, not again
    assert servers["d"].accepted == []  # a member that is not up is not asked


def test_retries_are_bounded_and_resend_only_the_slices_not_yet_accepted(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(session_mod, "HEAT_ENTRIES_PER_CALL", 2)
    flaky = _Server([])
    calls = {"n": 0}
    real = flaky.report_heat_encoded

    def second_slice_fails_once(request: bytes) -> None:
        calls["n"] += 1
        if calls["n"] == 2:
            raise _Refused(grpc.StatusCode.DEADLINE_EXCEEDED)
        real(request)

    flaky.report_heat_encoded = second_slice_fails_once  # type: ignore[method-assign]
    dead = _Server([grpc.StatusCode.UNAVAILABLE] * 10)
    client = _client(monkeypatch, {"a": flaky, "b": dead}, {"a": "up", "b": "up"})
    entries = [(i, 1, i) for i in range(5)]
    try:
        assert client.report_heat("m", 1, entries) == 1
    finally:
        client.close()
    assert flaky.accepted == [entries[0:2], entries[2:4], entries[4:5]]  # the first slice was not sent twice
    assert len(dead.refusals) == 10 - (len(session_mod.HEAT_RETRY_DELAYS_S) + 1)


def test_a_negative_entry_is_refused_before_anything_is_sent() -> None:
    client = ParamServerClient("127.0.0.1:9")  # nothing listens there: a call would fail otherwise
    try:
        with pytest.raises(ValueError, match="negative"):
            client.report_heat("m", 1, "w", [(-3, 1, 1)])
    finally:
        client.close()
