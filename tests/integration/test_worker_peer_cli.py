"""Bad peer flags and environment of ``paramworker load`` / ``serve`` (issue 42): one line on stderr,
exit 2 (BAD_ARGUMENTS), no traceback, before the cluster is asked anything (the ``--cluster`` is
a loopback port nothing listens on). The peer port off loopback follows the one safe-default
rule (``paramserver.wire.exposure``): the read token, or ``--insecure``."""
from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest

from deploy.local import free_port
from paramserver.client.exit_codes import BAD_ARGUMENTS, UNAVAILABLE
from tests.integration.test_worker_cli_input import cli, one_line

pytestmark = pytest.mark.integration


@pytest.fixture
def dead_cluster() -> str:
    return f"127.0.0.1:{free_port()}"


@pytest.fixture
def taken_port() -> Iterator[int]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


def load(cluster: str, *args: str, extra_env: dict[str, str] | None = None) -> object:
    return cli("worker", "load", "m1:prod", "--cluster", cluster, "--no-progress", "--device", "cpu", *args,
               extra_env=extra_env)


def serve(cluster: str, *args: str, extra_env: dict[str, str] | None = None) -> object:
    return cli("worker", "serve", "--model", "m1:prod", "--cluster", cluster, "--factory", "torch.nn:Identity",
               "--device", "cpu", "--listen", "127.0.0.1:0", *args, extra_env=extra_env)


@pytest.mark.parametrize("command", [load, serve], ids=["load", "serve"])
@pytest.mark.parametrize(("args", "env", "words"), [
    (("--peer-listen", "nonsense"), {}, ("--peer-listen", "'nonsense'", "HOST:PORT")),
    (("--peer-listen", "127.0.0.1:99999"), {}, ("--peer-listen", "HOST:PORT")),
    (("--peer-listen", "0.0.0.0:7070"), {}, ("binds every address", "--peer-advertise")),
    (("--peer-listen", "127.0.0.1:0", "--peer-advertise", "0.0.0.0:7070"), {}, ("--peer-advertise", "wildcard")),
    ((), {"PARAMS_PEERS": "maybe"}, ("PARAMS_PEERS", "on or off")),
    ((), {"PARAMS_PEER_LISTEN": "nowhere"}, ("--peer-listen", "'nowhere'")),
    # Off loopback without the read token: refused, naming the flag and the fixes.
    (("--peer-listen", "0.0.0.0:7070", "--peer-advertise", "10.0.0.5:7070"), {},
     ("peer port", "--peer-listen 0.0.0.0:7070", "read token", "--insecure")),
    ((), {"PARAMS_PEER_LISTEN": "0.0.0.0:7070"}, ("binds every address",)),
])  # fmt: skip
def test_bad_peer_settings_are_one_line_exit_2(dead_cluster: str, command, args, env, words) -> None:  # type: ignore[no-untyped-def]
    line = one_line(command(dead_cluster, *args, extra_env=env), "paramworker", BAD_ARGUMENTS, *words)
    assert "UNAVAILABLE" not in line  # refused before the cluster was asked


@pytest.mark.parametrize("command", [load, serve], ids=["load", "serve"])
def test_peer_connections_per_source_out_of_range(dead_cluster: str, command) -> None:  # type: ignore[no-untyped-def]
    prog = "paramworker load" if command is load else "paramworker serve"  # argparse names the subcommand
    one_line(command(dead_cluster, "--peer-max-connections-per-source", "0"), prog, BAD_ARGUMENTS,
             "--peer-max-connections-per-source must be a whole number from 1 to 100000")


def test_no_peers_skips_the_peer_port_check(dead_cluster: str) -> None:
    """--no-peers (or PARAMS_PEERS=off): no peer port, so an open --peer-listen is not refused; the
    load goes on to the cluster (here: nothing listens, a different error)."""
    for args, env in ((("--no-peers",), {}), ((), {"PARAMS_PEERS": "off"})):
        r = load(dead_cluster, "--peer-listen", "0.0.0.0:7070", "--peer-advertise", "10.0.0.5:7070", *args, extra_env=env)
        one_line(r, "paramworker", UNAVAILABLE, "no server answered")  # type: ignore[arg-type]


def test_peer_port_in_use_is_one_line_exit_2(dead_cluster: str, taken_port: int) -> None:
    r = load(dead_cluster, "--peer-listen", f"127.0.0.1:{taken_port}")
    line = one_line(r, "paramworker", BAD_ARGUMENTS, str(taken_port), "--peer-listen")  # type: ignore[arg-type]
    assert "unrecognized" not in line and "in use" in line, line


@pytest.mark.parametrize("cmd", ["load", "serve"])
def test_help_documents_the_peer_flags(cmd: str) -> None:
    r = cli("worker", cmd, "--help")
    assert r.returncode == 0, r.stderr
    text = " ".join(r.stdout.split())
    for flag in ("--peer-listen", "--peer-advertise", "--no-peers", "--peer-max-connections-per-source", "PARAMS_PEER_LISTEN",
                 "PARAMS_PEERS=off", "--insecure"):
        assert flag in text, flag
