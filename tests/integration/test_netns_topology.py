"""NetnsTopology on a real kernel: who reaches whom before, during and after a partition."""
from __future__ import annotations

import subprocess
import sys
import time
from typing import Iterator

import pytest

from deploy.netns import HOST, Endpoint, NetnsConfig, NetnsError, NetnsTopology, cleanup_stale, netns_available

pytestmark = [pytest.mark.integration, pytest.mark.root, pytest.mark.timeout(120)]

_OK, _WHY = netns_available()
if not _OK:
    pytestmark.append(pytest.mark.skip(reason=f"namespace topology test skipped: {_WHY}"))

PORT = 9000
SERVER = (
    "import socket,sys\n"
    "s=socket.socket();s.setsockopt(socket.SOL_SOCKET,socket.SO_REUSEADDR,1);s.bind((sys.argv[1],%d));s.listen(16)\n"
    "while True:\n c,_=s.accept();c.sendall(b'hi');c.close()\n" % PORT
)
# One process per source probes every destination: 'hi' when reachable, '-' when not.
PROBE = (
    "import socket,sys\n"
    "out=[]\n"
    "for a in sys.argv[1:]:\n"
    " try:\n  s=socket.create_connection((a,%d),timeout=0.4);out.append(s.recv(2).decode());s.close()\n"
    " except OSError: out.append('-')\n"
    "print(' '.join(out))\n" % PORT
)


@pytest.fixture
def topo() -> Iterator[NetnsTopology]:
    t = NetnsTopology(NetnsConfig.fresh(3, clients=1))
    procs: list[subprocess.Popen[bytes]] = []
    try:
        t.create()
        for i in range(3):
            procs.append(subprocess.Popen(t.exec_args(i, [sys.executable, "-c", SERVER, t.address(i)])))
        yield t
    finally:
        for p in procs:
            p.kill()
            p.wait(10)
        t.destroy()


def reach(t: NetnsTopology) -> dict[Endpoint, str]:
    """For each source (host, each server, client c0): which servers answer, e.g. 'hi - -'."""
    dsts = [t.address(i) for i in range(t.n)]
    out: dict[Endpoint, str] = {}
    for src in [HOST, 0, 1, 2, "c0"]:
        argv = [sys.executable, "-c", PROBE, *dsts]
        if src == "c0":
            argv = t.client_exec_args(0, argv)
        elif src != HOST:
            argv = t.exec_args(int(src), argv)
        out[src] = subprocess.run(argv, capture_output=True, text=True, timeout=30).stdout.strip()
    return out


def test_partition_cuts_between_groups_only_and_heal_restores(topo: NetnsTopology) -> None:
    everyone = "hi hi hi"
    deadline = time.monotonic() + 10
    while reach(topo)[HOST] != everyone and time.monotonic() < deadline:
        time.sleep(0.2)  # the servers are still starting
    assert reach(topo) == {HOST: everyone, 0: everyone, 1: everyone, 2: everyone, "c0": everyone}

    # Server 0 and client c0 on one side; the host is in no group and still reaches everyone.
    topo.partition([{0, "c0"}, {1, 2}])
    assert reach(topo) == {HOST: everyone, 0: "hi - -", 1: "- hi hi", 2: "- hi hi", "c0": "hi - -"}
    assert topo.cuts()["0"] == ["1", "2"]

    # isolate() keeps the host with the majority; with_host=True puts it with the cut server.
    topo.isolate(2)
    assert reach(topo)[HOST] == "hi hi -"
    topo.isolate(2, with_host=True)
    assert reach(topo)[HOST] == "- - hi"

    topo.heal()
    assert reach(topo) == {HOST: everyone, 0: everyone, 1: everyone, 2: everyone, "c0": everyone}
    assert topo.cuts() == {}


def test_destroy_is_idempotent_and_a_second_topology_with_the_same_prefix_is_refused() -> None:
    cfg = NetnsConfig.fresh(2)
    t = NetnsTopology(cfg).create()
    try:
        with pytest.raises(NetnsError, match="already exists"):
            NetnsTopology(cfg).create()
    finally:
        t.destroy()
        t.destroy()
    assert cleanup_stale(cfg.prefix) == []
    with pytest.raises(NetnsError, match="does not exist"):
        t.heal()
