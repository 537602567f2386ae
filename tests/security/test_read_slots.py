"""Stalled read streams cannot stop pulls (issue 41, read-slot exhaustion).

11 read-token ``GetChunks`` streams per server, each reading one message and then stalling, held
every read slot for the 30 s idle timeout, renewably: on a ``--tls`` cluster (no bulk port: chunk
bytes go over gRPC) every ``paramctl pull`` failed with exit 6; on plaintext, ``--no-bulk`` pulls
did. Now one client identity holds at most its share of the slots, and a stalled reader is cut as
soon as another stream needs its slot (paramserver.server.stream_slots).

Real clusters (deploy.local) and the real CLI; the stalled streams use the cluster's own read
token and, under TLS, the same client certificate paramctl uses (the worst case: the same
identity as the puller, from the same address).
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch
from safetensors.torch import load_file, save_file

from chunking.hashing import content_id
from deploy.local import LocalCluster
from paramserver.client.channel import channel_credentials, token_interceptor
from paramserver.client.rpc import ParamServerClient, make_chunk
from paramserver.wire.proto import SERVICE_NAME, pb
from tests.conftest import local_cluster

pytestmark = pytest.mark.integration

ADMIN, READ = "read-slots-admin-token", "read-slots-read-token"
STALLED = 11  # the read slots of a server with the default 16 gRPC workers
FILLER = 64  # 256 KiB chunks per server: 16 MiB a stream, far past the attacker's flow-control window
CLIENT_ENVS = ("PARAMS_CLUSTER", "PARAMS_ADMIN_TOKEN", "PARAMS_READ_TOKEN", "PARAMS_TLS_CA", "PARAMS_TLS_CERT", "PARAMS_TLS_KEY",
               "PARAMS_VERIFY", "PARAMS_CONFIG")


def ctl(*args: str, config: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in CLIENT_ENVS}
    env["PARAMS_CONFIG"] = str(config)
    return subprocess.run([sys.executable, "-m", "paramserver.client.ctl", *args], env=env, capture_output=True, text=True,
                          timeout=180)


def weights(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(512, 1024, generator=g), "b": torch.randn(1024, generator=g).bfloat16()}


def bit_exact(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8))
                                        for k in a)


class Stalled:
    """``STALLED`` GetChunks streams per server, each on its own connection, each reading one message."""

    def __init__(self, cluster: LocalCluster, per_server: int = STALLED, ids: dict[str, list[str]] | None = None) -> None:
        """``ids``: the filler chunks to ask for, by server (None: put new ones on every server first)."""
        settings = cluster.client_settings()
        self.channels: list[grpc.Channel] = []
        self.calls: list[Any] = []
        self.ids: dict[str, list[str]] = dict(ids or {})
        for slot in cluster.slots if ids is None else ():
            blobs = [os.urandom(256 << 10) for _ in range(FILLER)]
            ids = [content_id(b) for b in blobs]
            with ParamServerClient(settings.client_config(slot.grpc, write=True)) as admin:
                for k in range(0, FILLER, 16):
                    admin.put_chunks([make_chunk(cid, b) for cid, b in zip(ids[k:k + 16], blobs[k:k + 16])])
            self.ids[slot.grpc] = ids
        for slot in cluster.slots:
            for _ in range(per_server):
                # The attacker's own channel options: HTTP/2 windows that do not grow (no BDP probe), so a
                # stream stops for good once the first 64 KiB window is full.
                options = [("grpc.http2.bdp_probe", 0), ("grpc.max_receive_message_length", 64 << 20)]
                if settings.tls_ca is not None:
                    creds = channel_credentials(settings.tls_ca, READ, settings.tls_cert, settings.tls_key)
                    ch = grpc.secure_channel(slot.grpc, creds, options=options)
                else:
                    ch = grpc.intercept_channel(grpc.insecure_channel(slot.grpc, options=options), token_interceptor(READ))
                get = ch.unary_stream(f"/{SERVICE_NAME}/GetChunks", request_serializer=pb.GetChunksRequest.SerializeToString,
                                      response_deserializer=lambda b: b)
                call = get(pb.GetChunksRequest(ids=self.ids[slot.grpc]), timeout=300)
                self.channels.append(ch)
                self.calls.append(call)
        self.first = 0
        for call in self.calls:
            try:
                next(call)  # one message, then never another
                self.first += 1
            except grpc.RpcError:
                pass

    def close(self) -> None:
        for call in self.calls:
            call.cancel()
        for ch in self.channels:
            ch.close()


@pytest.fixture()
def tls_cluster(tmp_path: Path) -> Iterator[LocalCluster]:
    with local_cluster(tmp_path / "c", servers=3, admin_token=ADMIN, read_token=READ, tls=True, generate_secrets=True,
                       extra_args=("--no-fsync",)) as c:
        yield c


@pytest.fixture()
def plain_cluster(tmp_path: Path) -> Iterator[LocalCluster]:
    with local_cluster(tmp_path / "c", servers=1, admin_token=ADMIN, read_token=READ, generate_secrets=True,
                       extra_args=("--no-fsync",)) as c:
        yield c


def pull_while_stalled(cluster: LocalCluster, tmp_path: Path, *pull_flags: str) -> None:
    config = cluster.client_config_path
    source = tmp_path / "m.safetensors"
    want = weights(7)
    save_file(want, str(source))
    pushed = ctl("push", str(source), "--model", "slots", "--tag", "prod", config=config)
    assert pushed.returncode == 0, pushed.stderr
    stalled = Stalled(cluster)
    try:
        # Each took one message: all of them before issue 41; now a client's share (9 of the 11) per server.
        assert stalled.first >= 9 * len(cluster.slots), stalled.first
        time.sleep(3.0)  # past the stalled-reader threshold (2 s), far short of the 30 s idle timeout
        out = tmp_path / "pulled.safetensors"
        t0 = time.monotonic()
        pulled = ctl("pull", "slots:prod", "--out", str(out), "--verify", "content", *pull_flags, config=config)
        took = time.monotonic() - t0
        assert pulled.returncode == 0, f"exit {pulled.returncode} after {took:.1f}s: {pulled.stderr}"
        assert bit_exact(load_file(str(out)), want)
        # More streams of the same client: each is served at once, a stalled one cut for it (before
        # issue 41, RESOURCE_EXHAUSTED until the idle timeout), and the server says so.
        more = Stalled(cluster, per_server=3, ids=stalled.ids)
        try:
            assert more.first == 3 * len(cluster.slots)
        finally:
            more.close()
        logs = "".join(Path(s.log_file).read_text() for s in cluster.slots if s.log_file)
        assert "stalled read stream cut" in logs
    finally:
        stalled.close()


def test_a_pull_succeeds_while_11_stalled_read_streams_per_server_hold_a_tls_cluster(tls_cluster: LocalCluster,
                                                                                      tmp_path: Path) -> None:
    pull_while_stalled(tls_cluster, tmp_path)


def test_a_no_bulk_pull_succeeds_while_11_stalled_read_streams_hold_a_plaintext_server(plain_cluster: LocalCluster,
                                                                                        tmp_path: Path) -> None:
    pull_while_stalled(plain_cluster, tmp_path, "--no-bulk")


def test_one_client_holds_its_share_and_another_client_still_gets_a_stream(tmp_path: Path) -> None:
    """In-process, with the client address mapped (``ChunkService.source_of``, what a connection gate
    in front of gRPC sets): client A's stalled streams take its share only, at once; client B, from
    another address, is served at once too, before anything counts as stalled."""
    from paramserver.server.config import ServerConfig
    from paramserver.server.service import start_server
    from paramserver.wire.auth import token_metadata

    running = start_server(ServerConfig(server_id="ps1", data_dir=tmp_path, listen="127.0.0.1:0", fsync=False, workers=8,
                                        admin_token=ADMIN, read_token=READ))
    chunks = running.servicer.chunks
    # 8 workers: 7 stream slots, 1 of them for admin-token calls; a client's share of the other 6 is 5
    blobs = [os.urandom(256 << 10) for _ in range(FILLER)]
    ids = [content_id(b) for b in blobs]
    channels: list[grpc.Channel] = []
    try:
        with ParamServerClient(running.address, token=ADMIN) as admin:
            for k in range(0, FILLER, 16):
                admin.put_chunks([make_chunk(cid, b) for cid, b in zip(ids[k:k + 16], blobs[k:k + 16])])
        sources = iter(["10.0.0.1"] * 6 + ["10.0.0.2"] * 10)  # in the order the streams arrive (opened one at a time)
        chunks.source_of = lambda _peer: next(sources)

        def open_stream() -> Any:
            ch = grpc.insecure_channel(running.address, options=[("grpc.http2.bdp_probe", 0),
                                                                 ("grpc.max_receive_message_length", 64 << 20)])
            channels.append(ch)
            get = ch.unary_stream(f"/{SERVICE_NAME}/GetChunks", request_serializer=pb.GetChunksRequest.SerializeToString,
                                  response_deserializer=lambda b: b)
            return get(pb.GetChunksRequest(ids=ids), metadata=token_metadata(READ), timeout=60)

        held = []
        for _ in range(5):
            call = open_stream()
            next(call)  # served, one message read, then stalled
            held.append(call)
        t0 = time.monotonic()
        with pytest.raises(grpc.RpcError) as info:
            next(open_stream())  # A's sixth: past its share, and none of its streams is stalled long enough yet
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "to this client" in (info.value.details() or "")
        assert time.monotonic() - t0 < 2.0
        t0 = time.monotonic()
        b = open_stream()
        assert len(next(b)) > 0 and time.monotonic() - t0 < 2.0  # B: the slot A could not take
        for call in (*held, b):
            call.cancel()
    finally:
        for ch in channels:
            ch.close()
        running.stop(0)
