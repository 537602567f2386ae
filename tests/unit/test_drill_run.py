"""The drill entry point and the pieces added for it, without a cluster: options, CLI errors,
the steerable publisher, error classification, pausing loaders, restart configs."""
from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from deploy.drills.adapters import ModelSpec, Publisher, PublisherConfig
from deploy.drills.framework import DrillError, Loaded, Published, Workload, WorkloadConfig, wait_for
from deploy.drills.report import DrillReport, error_kind
from deploy.drills.restart import RestartConfig
from deploy.drills.run import DRILLS, DrillOptions, _cache_off, build_parser, main
from deploy.local import LocalCluster, LocalClusterConfig, ServerSlot
from paramserver.client.config import ClientSettings


def test_every_drill_is_a_cli_choice() -> None:
    assert set(DRILLS) == {"kill-leader", "partition", "corrupt-chunk", "restart-server", "restart-cluster"}
    args = build_parser().parse_args(["kill-leader", "--rounds", "3", "--json", "r.json", "--cluster-dir", "c"])
    assert (args.drill, args.rounds, args.json, args.cluster_dir) == ("kill-leader", 3, Path("r.json"), Path("c"))
    with pytest.raises(SystemExit):
        build_parser().parse_args(["no-such-drill"])


@pytest.mark.parametrize("opts, match", [
    (DrillOptions("nope"), "unknown drill"),
    (DrillOptions("kill-leader", rounds=0), "--rounds"),
    (DrillOptions("partition", hold_s=0), "--hold"),
    (DrillOptions("kill-leader", servers=2), "--servers"),
    (DrillOptions("kill-leader", publish_interval_s=-1), "--publish-interval"),
    (DrillOptions("kill-leader", cluster_dir=Path("a"), fresh_dir=Path("b")), "not both"),
])
def test_drill_options_say_what_to_fix(opts: DrillOptions, match: str) -> None:
    with pytest.raises(DrillError, match=match):
        opts.validate()


def test_corrupt_chunk_publishes_slower_by_default() -> None:
    assert DrillOptions("corrupt-chunk").interval == 1.0
    assert DrillOptions("kill-leader").interval == 0.2
    assert DrillOptions("kill-leader", publish_interval_s=0.5).interval == 0.5


def test_main_exits_2_with_a_clear_message_without_a_cluster(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["kill-leader", "--cluster-dir", str(tmp_path / "none")]) == 2
    err = capsys.readouterr().err
    assert "could not run" in err and "deploy.local up" in err


def test_cache_off_reads_the_servers_arguments(tmp_path: Path) -> None:
    cluster = LocalCluster(LocalClusterConfig(root=tmp_path))
    cluster.slots = [ServerSlot("ps1", "a:1", "a:2", "d", "l", args=["serve", "--cache-mb", "0"]),
                     ServerSlot("ps2", "b:1", "b:2", "d", "l", args=["serve", "--cache-mb", "0"])]
    assert _cache_off(cluster)
    cluster.slots[1].args = ["serve"]
    assert not _cache_off(cluster)


def test_publisher_prefer_reorders_seeds_and_restores() -> None:
    pub = Publisher(ClientSettings(cluster=("a:1", "b:1", "c:1")), ModelSpec())
    pub.prefer(["c:1", "zz:9"])  # unknown addresses are ignored
    assert pub.seeds == ["c:1", "a:1", "b:1"]
    pub.prefer(None)
    assert pub.seeds == ["a:1", "b:1", "c:1"]
    with pytest.raises(ValueError, match="rpc_timeout_s"):
        Publisher(ClientSettings(cluster=("a:1",)), ModelSpec(), PublisherConfig(rpc_timeout_s=0))
    with pytest.raises(ValueError, match="at least one"):
        Publisher(ClientSettings(), ModelSpec())


def test_drill_clients_take_the_clusters_tls_files_and_tokens(tmp_path: Path) -> None:
    """Publisher, loaders and probe all reach a --tls cluster with its CA, the client certificate and the
    right token (admin for writes, read for reads): no drill client is plaintext on a TLS cluster."""
    from deploy.drills.probe import ClusterProbe

    cluster = LocalCluster(LocalClusterConfig(root=tmp_path, tls=True, admin_token="adm", read_token="rd"))
    cluster.slots = [ServerSlot("ps1", "127.0.0.1:7000", "127.0.0.1:7001", "d", "l")]
    settings = cluster.client_settings()
    assert settings.tls and settings.tls_ca == cluster.tls_dir / "ca.pem"
    assert settings.tls_cert == cluster.tls_dir / "client.pem"
    write = Publisher(settings, ModelSpec()).settings.cluster_options(write=True)
    assert write.tls and write.token == "adm" and write.tls_cert == settings.tls_cert
    probe = ClusterProbe(cluster)
    assert probe.settings == settings
    read = settings.client_config("127.0.0.1:7000", write=False, timeout_s=probe.config.timeout_s)
    assert read.tls and read.token == "rd" and read.client_cert == settings.tls_cert and read.timeout_s == 2.0


def test_tls_flag_is_for_fresh_clusters_only(tmp_path: Path) -> None:
    with pytest.raises(DrillError, match="drop --tls"):
        DrillOptions(drill="kill-leader", cluster_dir=tmp_path, tls=True).validate()
    DrillOptions(drill="kill-leader", tls=True).validate()
    assert build_parser().parse_args(["restart-server", "--tls"]).tls


def test_error_kind_looks_through_worker_wrappers() -> None:
    from paramserver.client.errors import ChunkDataLoss, ChunkUnavailable
    from worker.errors import TensorFailed

    loss = ChunkDataLoss("ab" * 32, {"ps1": "DATA_LOSS: crc"})
    assert error_kind(loss) == "DATA_LOSS"
    assert error_kind(TensorFailed("layer0.weight", loss)) == "DATA_LOSS"
    assert error_kind(TensorFailed("layer0.weight", ChunkUnavailable("cd" * 32, {}))) == "ChunkUnavailable"
    assert error_kind(ValueError("x")) == "ValueError"


def test_pause_loaders_waits_for_in_flight_loads_and_holds_new_ones() -> None:
    r = DrillReport("d")
    in_load = threading.Event()
    release = threading.Event()
    calls: list[float] = []

    def load(k: int, i: int) -> Loaded:
        calls.append(time.monotonic())
        in_load.set()
        release.wait(5)
        return Loaded("m", "prod", 1)

    cfg = WorkloadConfig(loaders=1, load_interval_s=0.0, max_iterations=1000)
    with Workload(r, publish=lambda i: Published("m", i), load=load, config=cfg) as w:
        assert in_load.wait(5)
        assert w.pause_loaders(timeout=0.2) is False  # one load still in flight
        release.set()
        assert w.pause_loaders(timeout=5) is True
        n = len(calls)
        time.sleep(0.3)
        assert len(calls) == n  # nothing new while paused
        w.resume_loaders()
        wait_for(lambda: len(calls) > n, 5, what="loads after resume")
    assert [e.name for e in r.events].count("loaders_paused") == 2


@pytest.mark.parametrize("cfg, match", [
    (RestartConfig(down_s=0), "down_s"),
    (RestartConfig(load_s=0), "load_s"),
    (RestartConfig(min_versions=0), "min_versions"),
    (RestartConfig(max_verified_versions=0), "max_verified_versions"),
])
def test_restart_config_says_what_to_fix(cfg: RestartConfig, match: str) -> None:
    with pytest.raises(DrillError, match=match):
        cfg.validate()
