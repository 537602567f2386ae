"""A mutual-TLS cluster end to end: ``python -m deploy.local up --tls``, then the CLIs with only
``PARAMS_CONFIG`` set.

Three real ``paramserver`` processes with the certificates ``deploy.certs`` makes; servers call
each other (quorum check, re-replication, repair) over mutual TLS with their own certificates.
The bulk port stays off: chunk bytes go over gRPC GetChunks.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from chunking.manifest import Manifest
from deploy.certs import issue, make_ca
from deploy.local import LocalCluster, LocalClusterConfig
from paramserver.client.config import ClientSettings
from paramserver.client.rpc import ParamServerClient
from paramserver.server.segments import corrupt_stored, locate_on_disk
from paramserver.server.store import ChunkStore

pytestmark = pytest.mark.integration

ADMIN, READ = "tls-admin-token", "tls-read-token"
CLIENT_ENVS = ("PARAMS_CLUSTER", "PARAMS_ADMIN_TOKEN", "PARAMS_READ_TOKEN", "PARAMS_TLS_CA", "PARAMS_TLS_CERT", "PARAMS_TLS_KEY",
               "PARAMS_VERIFY", "PARAMS_CONFIG")


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in CLIENT_ENVS}
    env.update(extra)
    return env


def run(module: str, *args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", module, *args], env=env, capture_output=True, text=True, timeout=120)


def one_line_error(result: subprocess.CompletedProcess[str], prog: str) -> str:
    assert "Traceback" not in result.stderr, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip() and "ssl_transport_security" not in line]
    assert len(lines) == 1 and lines[0].startswith(f"{prog}: error: "), result.stderr
    return lines[0]


def wait_until(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")


@dataclass
class TlsCluster:
    cluster: LocalCluster
    config: Path  # client.toml
    up_stdout: str
    certs_before_restart: dict[str, bytes]

    @property
    def env(self) -> dict[str, str]:
        return clean_env(PARAMS_CONFIG=str(self.config))

    @property
    def settings(self) -> ClientSettings:
        return ClientSettings.load({}, {"PARAMS_CONFIG": str(self.config)})

    def client(self, server_id: str) -> ParamServerClient:
        return ParamServerClient(self.settings.client_config(self.cluster.slot(server_id).grpc, write=False))

    def data_dir(self, server_id: str) -> Path:
        return Path(self.cluster.slot(server_id).data_dir)

    def manifest(self, model: str, tag: str) -> Manifest:
        with self.client("ps1") as c:
            reply = c.get_manifest(model=model, tag=tag, linearizable=True)
        return Manifest.from_bytes(reply.data)

    def holders(self, chunk_id: str) -> set[str]:
        out = set()
        for s in self.cluster.slots:
            with self.client(s.server_id) as c:
                if c.has_chunks([chunk_id])[0]:
                    out.add(s.server_id)
        return out


@pytest.fixture(scope="module")
def tls(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TlsCluster]:
    root = tmp_path_factory.mktemp("tls-cluster")
    # 1. What a user runs: the launcher's CLI.
    # Tokens through the environment (the launcher generates the cluster secret): never on a command line.
    up = run("deploy.local", "up", "--tls", "--dir", str(root), "--timeout", "90",
             env=clean_env(PARAMS_ADMIN_TOKEN=ADMIN, PARAMS_READ_TOKEN=READ))
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        status = run("paramserver.client.ctl", "status", env=clean_env(PARAMS_CONFIG=str(root / "client.toml")))
        assert status.returncode == 0, status.stderr
    finally:
        run("deploy.local", "down", "--dir", str(root), env=clean_env())
    certs = {p.name: p.read_bytes() for p in sorted((root / "tls").iterdir()) if p.suffix in (".pem", ".key")}
    # 2. The same folder started again (its certificates reused), with fast background tasks and no
    #    server cache, so corrupt bytes are read from disk and repairs happen within the test.
    c = LocalCluster(LocalClusterConfig(
        root=root, servers=3, admin_token=ADMIN, read_token=READ, tls=True,
        generate_secrets=True,  # the cluster secret 'up' made, reused: the data dirs belong to that cluster
        extra_args=("--no-fsync", "--cache-mb", "0", "--anti-entropy-interval", "0.5", "--repair-interval", "0.5",
                    "--scrub-mb-per-s", "0"),
    ))  # fmt: skip
    try:
        c.up(wait=90)
        yield TlsCluster(c, root / "client.toml", up.stdout, certs)
    finally:
        c.down()


def state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"layer.weight": torch.randn(300, 700, generator=g), "layer.bias": torch.randn(700, generator=g).bfloat16(),
            "emb": torch.randn(50, 64, generator=g).half()}


def push(tls: TlsCluster, tmp_path: Path, model: str, seed: int) -> dict[str, torch.Tensor]:
    f = tmp_path / f"{model}.safetensors"
    weights = state(seed)
    save_file(weights, str(f))
    r = run("paramserver.client.ctl", "push", str(f), "--model", model, "--tag", "prod", env=tls.env)
    assert r.returncode == 0, r.stderr
    assert f"pushed {model} tag prod -> v1" in r.stdout
    return weights


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8)) for k in a)


def test_up_prints_one_export_line_and_restart_reuses_the_certificates(tls: TlsCluster) -> None:
    exports = [line for line in tls.up_stdout.splitlines() if "PARAMS_CONFIG" in line and line.startswith("export")]
    assert exports == [f"export PARAMS_CONFIG={tls.config}"], tls.up_stdout
    text = tls.config.read_text()
    assert ADMIN not in text and READ not in text  # the config names token files, never tokens
    for key in ("cluster", "admin_token_file", "read_token_file", "tls_ca", "tls_cert", "tls_key"):
        assert key in text, key
    secrets = tls.config.parent / "secrets"
    assert oct(secrets.stat().st_mode & 0o777) == "0o700"
    assert oct((secrets / "admin.token").stat().st_mode & 0o777) == "0o600"
    assert (secrets / "admin.token").read_text().strip() == ADMIN
    now = {p.name: p.read_bytes() for p in sorted((tls.config.parent / "tls").iterdir()) if p.suffix in (".pem", ".key")}
    assert now == tls.certs_before_restart and {"ca.pem", "client.pem", "ps1.pem", "ps3.key"} <= set(now)
    with tls.client("ps1") as c:
        members = c.cluster_info().members
    assert len(members) == 3 and all(m.bulk_address == "" for m in members)  # no plaintext bulk port under TLS


def test_push_commit_pull_and_load_bit_exact_with_only_params_config(tls: TlsCluster, tmp_path: Path) -> None:
    weights = push(tls, tmp_path, "tlsmodel", 1)  # the commit needs the leader's quorum check over mutual TLS
    out = tmp_path / "pulled.safetensors"
    r = run("paramserver.client.ctl", "pull", "tlsmodel:prod", "--out", str(out), "--verify", "content", env=tls.env)
    assert r.returncode == 0, r.stderr
    assert same(load_file(str(out)), weights)
    r = run("paramserver.client.ctl", "ls", "tlsmodel", env=tls.env)
    assert r.returncode == 0 and "prod" in r.stdout, r.stderr
    r = run("worker", "load", "tlsmodel:prod", "--no-progress", "--verify", "content", "--device", "cpu", env=tls.env)
    assert r.returncode == 0, r.stderr
    assert "tlsmodel v1" in r.stdout
    # The same settings in-process: the worker's loader, tensors compared bit for bit.
    from worker.loader import load_state_dict

    assert same(load_state_dict(tls.settings, "tlsmodel:prod", device="cpu"), weights)


def test_anti_entropy_restores_deleted_replicas_after_a_restart(tls: TlsCluster, tmp_path: Path) -> None:
    push(tls, tmp_path, "rerep", 2)
    ids = [tls.manifest("rerep", "prod").id, *dict.fromkeys(tls.manifest("rerep", "prod").chunk_ids())]
    tls.cluster.kill("ps2")
    offline = ChunkStore(tls.data_dir("ps2"), cache_bytes=0)  # ps2 is down: its data dir is free to write
    removed = [cid for cid in ids if offline.delete(cid)]
    offline.close()
    assert removed, "ps2 held none of the model's chunks"
    time.sleep(1.0)  # the others' passes find ps2 unreachable meanwhile
    tls.cluster.restart("ps2")
    tls.cluster.wait_ready(60)

    def restored() -> bool:
        with tls.client("ps2") as c:
            return all(c.has_chunks(removed))

    wait_until(restored, 40, f"ps2 to get its {len(removed)} deleted chunks back from its peers over mutual TLS")


def test_a_corrupt_replica_is_repaired_from_a_good_one(tls: TlsCluster, tmp_path: Path) -> None:
    weights = push(tls, tmp_path, "repairme", 3)
    manifest = tls.manifest("repairme", "prod")
    ref = manifest.chunks[0]
    victim = sorted(tls.holders(ref.id))[0]
    location = locate_on_disk(tls.data_dir(victim), ref.id)
    assert location is not None
    corrupt_stored(location, at=10, xor=0xFF)
    with tls.client(victim) as c:
        answers = list(c.get_chunks_partial([ref.id]))
    assert not hasattr(answers[0], "data"), "the server served a corrupt chunk"  # a CORRUPT ack, never the bytes

    def repaired() -> bool:
        with tls.client(victim) as c:
            got = [a for a in c.get_chunks_partial([ref.id]) if hasattr(a, "data")]
        return bool(got) and got[0].crc32c == ref.crc32c

    wait_until(repaired, 40, f"{victim} to repair chunk {ref.id} from a peer over mutual TLS")
    out = tmp_path / "after-repair.safetensors"
    r = run("paramserver.client.ctl", "pull", "repairme:prod", "--out", str(out), env=tls.env)
    assert r.returncode == 0, r.stderr
    assert same(load_file(str(out)), weights)


def test_load_without_a_client_certificate_or_with_a_foreign_one_exits_5(tls: TlsCluster, tmp_path: Path) -> None:
    s = tls.settings
    flags = ["--cluster", ",".join(s.cluster), "--tls-ca", str(s.tls_ca), "--token", READ]
    r = run("worker", "load", "tlsmodel:prod", "--no-progress", *flags, env=clean_env())
    line = one_line_error(r, "paramworker")
    assert r.returncode == 5 and "requires a client certificate" in line, line
    r = run("paramserver.client.ctl", *flags, "ls", env=clean_env())
    assert r.returncode == 5 and "requires a client certificate" in one_line_error(r, "paramctl")

    rogue_ca = make_ca(tmp_path / "rogue", name="another CA")
    rogue = issue(tmp_path / "rogue", rogue_ca, "intruder", hosts=[], server=False, client=True)
    r = run("worker", "load", "tlsmodel:prod", "--no-progress", *flags, "--tls-cert", str(rogue.cert), "--tls-key", str(rogue.key),
            env=clean_env())
    line = one_line_error(r, "paramworker")
    assert r.returncode == 5 and "refused the client certificate" in line, line

    r = run("worker", "load", "tlsmodel:prod", "--no-progress", "--cluster", ",".join(s.cluster), "--token", READ, env=clean_env())
    line = one_line_error(r, "paramworker")
    assert r.returncode == 5 and "plaintext" in line, line
