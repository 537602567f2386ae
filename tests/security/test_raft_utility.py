"""The Raft port refuses what is not a member: pysyncobj utility commands without the cluster secret,
read-only nodes, unknown first messages, frames that do not decrypt; each refusal is one WARNING
line naming the remote address, rate-limited per host.

pysyncobj's TCPTransport takes the first message of a connection as a utility command
(``syncobj_admin``: add, remove, transfer, set_version, status) from anyone who reaches the port,
and drops a frame that fails the secret check without a word. In-process nodes on loopback; a raw
client binds 127.0.0.2 / 127.0.0.3 as its source so that the per-host rate limit does not hide
the line a case looks for.
"""
from __future__ import annotations

import importlib.util
import logging
import pickle
import socket
import struct
import zlib
from pathlib import Path
from typing import Any, Iterator

import pytest
from pysyncobj.utility import TcpUtility, UtilityException

from consensus import MetadataNode, RaftConfig
from consensus.links import RefusalLog

from ..integration.consensus_harness import free_port

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]
needs_crypto = pytest.mark.skipif(importlib.util.find_spec("cryptography") is None,
                                  reason="a cluster secret needs the cryptography package")
SECRET = "correct horse battery staple"


def solo(tmp_path: Path, secret: str | None = None) -> MetadataNode:
    node = MetadataNode(RaftConfig("solo", f"127.0.0.1:{free_port()}", (), tmp_path / "solo", secret=secret,
                                   fsync=False))
    node.start()
    assert node.wait_ready(20)
    return node


@pytest.fixture
def plain(tmp_path: Path) -> Iterator[MetadataNode]:
    node = solo(tmp_path)
    try:
        yield node
    finally:
        node.close()


@pytest.fixture
def secured(tmp_path: Path) -> Iterator[MetadataNode]:
    node = solo(tmp_path, SECRET)
    try:
        yield node
    finally:
        node.close()


def frame(message: Any) -> bytes:
    """One message as pysyncobj's TcpConnection frames it without a secret: length, zlib, pickle."""
    data = zlib.compress(pickle.dumps(message, 2), 3)
    return struct.pack("i", len(data)) + data


def send_from(source: str, address: str, payload: bytes, wait: float = 3.0) -> bytes:
    """Connect from ``source``, send ``payload``, return what comes back before the server closes (b'' if nothing)."""
    host, port = address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=wait, source_address=(source, 0)) as sock:
        sock.sendall(payload)
        try:
            return sock.recv(4096)
        except TimeoutError:
            return b"(still open)"


def refusals(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == "consensus.links" and r.levelno == logging.WARNING and "refused Raft connection" in r.getMessage()]


def admin(address: str, command: list[Any], password: str | None = None) -> Any:
    """What pysyncobj's syncobj_admin does: one utility command over its own connection."""
    return TcpUtility(password=password, timeout=3.0).executeCommand(address, command)


def test_without_a_secret_every_utility_command_is_refused_and_logged_once(
        plain: MetadataNode, caplog: pytest.LogCaptureFixture) -> None:
    address = plain.config.raft_address
    caplog.set_level(logging.WARNING, logger="consensus.links")
    for command in (["add", "127.0.0.1:1"], ["remove", address], ["transfer", ""], ["set_version", 1], ["status"]):
        with pytest.raises(UtilityException):
            admin(address, command)
    assert plain.cluster_addresses() == [address]  # "add" changed nothing
    lines = refusals(caplog)
    assert len(lines) == 1, lines  # five refusals from one host within the interval: one line
    assert "from 127.0.0.1:" in lines[0] and "utility command 'add'" in lines[0] and "--cluster-secret" in lines[0]
    # The node still serves its members' business.
    assert plain.commit_version("m", "a" * 64, None, "p", 1, 1).number == 1


def test_read_only_nodes_and_unknown_first_messages_are_refused_and_logged(
        plain: MetadataNode, caplog: pytest.LogCaptureFixture) -> None:
    address = plain.config.raft_address
    caplog.set_level(logging.WARNING, logger="consensus.links")
    # A read-only pysyncobj node would be sent the whole log and could submit commands.
    assert send_from("127.0.0.2", address, frame("readonly")) == b""
    assert send_from("127.0.0.3", address, frame("10.9.9.9:4321")) == b""
    assert send_from("127.0.0.4", address, frame({"type": "append_entries"})) == b""  # unhashable for pysyncobj
    lines = refusals(caplog)
    assert len(lines) == 3, lines
    assert "from 127.0.0.2:" in lines[0] and "read-only" in lines[0]
    assert "from 127.0.0.3:" in lines[1] and "'10.9.9.9:4321' is not the Raft address of a member" in lines[1]
    assert "from 127.0.0.4:" in lines[2]
    assert plain.commit_version("m", "a" * 64, None, "p", 1, 1).number == 1


@needs_crypto
def test_with_a_secret_utility_commands_need_it_and_failed_secret_checks_are_logged(
        secured: MetadataNode, caplog: pytest.LogCaptureFixture) -> None:
    address = secured.config.raft_address
    caplog.set_level(logging.INFO, logger="consensus.links")
    with pytest.raises(UtilityException):
        admin(address, ["add", "127.0.0.1:1"], password="wrong secret")
    # A plaintext pysyncobj frame does not decrypt either.
    assert send_from("127.0.0.2", address, frame(["add", "127.0.0.1:1"])) == b""
    assert secured.cluster_addresses() == [address]
    lines = refusals(caplog)
    assert len(lines) == 2, lines
    assert all("does not decrypt with the cluster secret" in line for line in lines)
    assert "from 127.0.0.1:" in lines[0] and "from 127.0.0.2:" in lines[1]
    # With the secret, syncobj_admin works (and is logged as such).
    status = admin(address, ["status"], password=SECRET)
    assert isinstance(status, dict) and status["raft_term"] >= 1
    assert any("utility command 'status'" in r.getMessage() and r.levelno == logging.INFO for r in caplog.records)


def test_the_refusal_log_is_one_line_per_host_per_interval_and_bounded() -> None:
    now = [0.0]
    rl = RefusalLog(interval=10.0, max_hosts=2, clock=lambda: now[0])
    assert rl.refuse("10.0.0.1:5", "x") and not rl.refuse("10.0.0.1:6", "x") and not rl.refuse("10.0.0.1:7", "x")
    assert rl.refuse("10.0.0.2:5", "x")
    assert not rl.refuse("10.0.0.3:5", "x")  # table full of hosts within their interval: counted, not logged
    now[0] = 10.0
    with pytest.MonkeyPatch.context() as mp:
        seen: list[str] = []
        mp.setattr(logging.getLogger("consensus.links"), "warning", lambda fmt, *a: seen.append(fmt % a))
        assert rl.refuse("10.0.0.1:8", "again")
        assert rl.refuse("10.0.0.3:5", "x")  # the stale entries went, so there is room again
    assert "2 more from 10.0.0.1 not logged" in seen[0] and "1 from other hosts not logged" in seen[0]


@pytest.mark.parametrize("declared", [0x7FFFFFFF, 1 << 20, -5])
def test_a_frame_declared_over_the_limit_is_refused_as_its_length_arrives(
        secured: MetadataNode, caplog: pytest.LogCaptureFixture, declared: int) -> None:
    """pysyncobj buffered a frame of any declared length (up to 2 GiB) from anyone, copying the buffer
    on every read: 32 MiB of filler cost the leader 7 s of CPU and its leadership. Before a
    connection is a member's link a frame may declare at most MAX_HANDSHAKE_FRAME bytes."""
    from consensus.links import MAX_HANDSHAKE_FRAME

    address = secured.config.raft_address
    caplog.set_level(logging.WARNING, logger="consensus.links")
    host, port = address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=5, source_address=("127.0.0.5", 0)) as sock:
        sock.sendall(struct.pack("i", declared))
        sent = 0
        try:
            while sent < 8 << 20:  # the filler a stranger would go on sending
                sock.sendall(bytes(256 << 10))
                sent += 256 << 10
            closed = sock.recv(1) == b""
        except (ConnectionError, TimeoutError):
            closed = True
    assert closed
    assert sent < 8 << 20 or declared <= MAX_HANDSHAKE_FRAME  # cut off while still sending
    lines = refusals(caplog)
    assert lines and "from 127.0.0.5:" in lines[0] and f"declared {declared} bytes" in lines[0], lines
    assert secured.is_leader() and secured.commit_version("m", "b" * 64, None, "p", 1, 1).number == 1
