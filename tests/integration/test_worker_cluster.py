"""The worker against a real 3-server cluster (real Raft, real gRPC, separate processes)."""
from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

from typing import Any

import grpc
import pytest
import torch

from chunking.diff import diff
from chunking.manifest import Manifest
from chunking.synthetic import finetune
from paramserver.client.rpc import ParamServerClient
from paramserver.wire.proto import pb, pb_grpc
from paramserver.server.segments import ChunkLocation, corrupt_stored
from tests.conftest import stop_process
from tests.integration.test_worker_harness import REPO, Cluster
from paramserver.client.session import ClusterClient
from chunking.chunk_table import ChunkRows
from paramserver.client.fetch_plan import FetchPlanner, Read
from paramserver.client.session import SessionConfig
from worker.config import CacheConfig, PrefetchConfig
from worker.prefetch import unique_order
from paramserver.client.errors import ChunkDataLoss, StaleRead
from worker.loader import LoadedModel, load, load_into, load_state_dict, start_load
from paramserver.client.monotonic import Resolution
from worker.swap import HotSwapper
from worker.tiered_cache import TieredCache

pytestmark = pytest.mark.integration
MiB = 1 << 20


def mem_cache(mb: int = 256) -> TieredCache:
    return TieredCache.from_config(CacheConfig(memory_bytes=mb * MiB))


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def assert_bit_exact(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert set(got) == set(want)
    bad = [k for k in want if not same(got[k], want[k])]
    assert not bad, f"tensors differ: {bad}"


def mixed(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "enc.weight": torch.randn(513, 257, generator=g),  # float32, odd shape, spans chunks
        "enc.bias": torch.randn(257, generator=g),
        "half": torch.randn(3, 5, 7, generator=g).half(),
        "bf16": torch.randn(300, 301, generator=g).bfloat16(),
        "int8": torch.randint(-128, 127, (999,), generator=g, dtype=torch.int8),
        "scalar": torch.tensor(3.25),
        "empty": torch.empty(0, 7),
        "unicodé.名前": torch.arange(10, dtype=torch.int64),
    }


def layers(n: int, rows: int = 256, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"layers.{i}.weight": torch.randn(rows, 1024, generator=g) for i in range(n)}


def test_load_by_tag_is_bit_exact(cluster: Cluster, client: ClusterClient) -> None:
    sd = mixed()
    cluster.push(sd, "mixed", tag="prod")
    loaded = load(client, "mixed:prod")
    assert_bit_exact(loaded.tensors, sd)
    assert loaded.report.bytes_network == loaded.manifest.raw_bytes and loaded.report.version == 1
    assert_bit_exact(load_state_dict(cluster.seed, "mixed@1"), sd)  # by exact version, from seed strings


def test_load_into_meta_module(cluster: Cluster, client: ClusterClient) -> None:
    torch.manual_seed(0)
    ref = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.BatchNorm1d(32), torch.nn.Linear(32, 4)).eval()
    cluster.push(ref.state_dict(), "seq", tag="prod")
    with torch.device("meta"):
        module = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.BatchNorm1d(32), torch.nn.Linear(32, 4))
    report = load_into(module, client, "seq:prod")
    module.eval()
    assert report.chunks >= 1
    assert_bit_exact(module.state_dict(), ref.state_dict())
    x = torch.randn(5, 16)
    assert torch.equal(module(x), ref(x))


def test_second_load_moves_zero_network_bytes(cluster: Cluster, client: ClusterClient) -> None:
    sd = layers(8)
    cluster.push(sd, "again", tag="prod")
    cache = mem_cache()
    first = load(client, "again:prod", cache=cache).report
    before = dict(client.stats.by_server)
    second = load(client, "again:prod", cache=cache)
    assert first.bytes_network == second.report.bytes_total > 0
    assert second.report.bytes_network == 0 and second.report.bytes_network_stored == 0
    assert second.report.bytes_memory == second.report.bytes_total
    assert client.stats.by_server == before  # not one chunk byte crossed the wire
    assert_bit_exact(second.tensors, sd)


def test_memory_tier_hands_its_arena_to_the_next_load_once_the_tensors_are_gone(cluster: Cluster, client: ClusterClient) -> None:
    sd = {**layers(6), **mixed(seed=1)}  # another seed: no chunk of mixed() repeats one of layers()
    cluster.push(sd, "adopt", tag="prod")
    cache = mem_cache()
    first = load(client, "adopt:prod", cache=cache)
    big = "layers.0.weight"
    at = first.tensors[big].data_ptr()
    # While the first tensors are alive, a memory-tier load copies into memory of its own.
    second = load(client, "adopt:prod", cache=cache)
    assert second.report.bytes_memory == second.report.bytes_total
    assert second.tensors[big].data_ptr() != at
    assert_bit_exact(second.tensors, sd)
    for done in (first, second):
        assert done.handle is not None and done.handle.heat_sent(10)
    del first, second
    # Nothing uses the first load's memory now but the tier: the next load is given it, verified in place.
    third = load(client, "adopt:prod", cache=cache)
    assert third.tensors[big].data_ptr() == at
    assert third.report.bytes_memory == third.report.bytes_total and third.report.bytes_network == 0
    assert_bit_exact(third.tensors, sd)
    # A caller that wrote into a tensor before dropping it: that chunk fails its CRC32C where it
    # lies and is fetched again into place; the rest is still not copied.
    third.tensors[big].view(-1)[5] += 1.0
    assert third.handle is not None and third.handle.heat_sent(10)
    del third
    fourth = load(client, "adopt:prod", cache=cache)
    assert fourth.tensors[big].data_ptr() == at
    assert 0 < fourth.report.bytes_network <= fourth.manifest.chunk_size
    assert_bit_exact(fourth.tensors, sd)


def test_host_staged_load_goes_up_tensor_by_tensor_and_the_next_load_takes_its_arena_back(
        cluster: Cluster, client: ClusterClient) -> None:
    """The path a CUDA load of a model the tier holds takes (host_staging="always" runs it on cpu):
    chunks land in a host arena, each tensor is copied up whole, and the tier keeps the arena."""
    from paramserver.client.hostmem import default_pool

    sd = {**layers(6, seed=3), **mixed(seed=4)}
    cluster.push(sd, "staged", tag="prod")
    cache = mem_cache()
    staged = PrefetchConfig(host_staging="always")
    handle = start_load(client, "staged:prod", "cpu", cache, config=staged)
    assert handle.upload is not None  # the staged path, not the arena tensors handed out
    first_name = next(iter(sd))
    early = handle.wait(first_name, timeout=60)
    tensors, report = handle.result(timeout=60)
    assert early is tensors[first_name]
    assert report.bytes_network == report.bytes_total > 0
    assert_bit_exact(tensors, sd)
    group = cache._groups[handle.manifest.id]
    assert group.private and group.arena is not None
    # The caller holds its tensors and the handle: the arena is the tier's alone all the same.
    assert default_pool().free_but_for(group.arena.view)
    arena_id = id(group.arena.view.obj)  # not the object: a reference would keep the arena in use
    # The next load is given that arena and takes its chunks without a lookup or a CRC each.
    second = start_load(client, "staged:prod", "cpu", cache, config=staged)
    assert second.prefetcher._trusted
    again, report2 = second.result(timeout=60)
    assert report2.bytes_memory == report2.bytes_total == report.bytes_total and report2.bytes_network == 0
    assert id(cache._groups[handle.manifest.id].arena.view.obj) == arena_id
    assert_bit_exact(again, sd)
    assert_bit_exact(tensors, sd)  # the first load's tensors are its own
    # A plain cpu load given the private arena hands it out: no longer private.
    del second
    plain = load(client, "staged:prod", cache=cache)
    assert plain.report.bytes_memory == plain.report.bytes_total
    assert_bit_exact(plain.tensors, sd)
    assert not cache._groups[handle.manifest.id].private


def test_failed_host_staged_load_fails_its_device_tensors(cluster: Cluster, client: ClusterClient) -> None:
    from worker.errors import TensorFailed

    def boom(_ref: object) -> None:
        raise RuntimeError("planted failure of the local source")

    cluster.push(layers(3, seed=15), "stagedfail", tag="prod")
    handle = start_load(client, "stagedfail:prod", "cpu", mem_cache(), config=PrefetchConfig(host_staging="always"),
                        local=boom)
    with pytest.raises(RuntimeError, match="planted"):
        handle.result(timeout=60)
    with pytest.raises(TensorFailed):
        handle.wait("layers.0.weight", timeout=10)


def test_a_failed_host_staged_load_does_not_make_a_group_it_did_not_verify_trusted(
        cluster: Cluster, client: ClusterClient) -> None:
    """A staged load given a plain load's arena (whose caller wrote into a tensor) that fails
    before re-verifying it must leave the group unverified: the next load checks every chunk."""
    import gc

    sd = layers(4, seed=21)
    cluster.push(sd, "privfail", tag="prod")
    cache = mem_cache()
    first = load(client, "privfail:prod", cache=cache)
    first.tensors["layers.0.weight"].view(-1)[5] += 1.0  # written in place, then dropped
    assert first.handle is not None and first.handle.heat_sent(10)
    manifest = first.manifest
    del first
    gc.collect()
    group = cache._groups[manifest.id]
    assert not group.private
    # one chunk of another tensor no longer held: a miss, asked of the local source first
    row = manifest.plan.tensor_chunks[[t.name for t in manifest.tensors].index("layers.3.weight")][0]
    group.discard(manifest.chunks.ids[int(row)])

    def boom(_ref: object) -> None:
        raise RuntimeError("planted failure of the local source")

    staged = start_load(client, "privfail:prod", "cpu", cache, config=PrefetchConfig(host_staging="always"), local=boom)
    assert staged.prefetcher._adopted is group
    with pytest.raises(RuntimeError, match="planted"):
        staged.result(timeout=60)
    assert not group.private
    assert staged.heat_sent(10)
    del staged
    gc.collect()
    again = load(client, "privfail:prod", cache=cache)
    assert again.handle is not None and not again.handle.prefetcher._trusted
    assert_bit_exact(again.tensors, sd)  # the written chunk failed its CRC and came again


def test_an_upload_that_raises_in_the_pin_thread_fails_the_load(
        cluster: Cluster, client: ClusterClient, monkeypatch: pytest.MonkeyPatch) -> None:
    """Copies held back while the arena is pinned go up from the pinning thread: if they raise,
    result() raises and the device tensors fail, instead of uninitialised tensors passing."""
    import worker.loader as loader
    from worker.errors import TensorFailed
    from worker.staging import Copier

    real_pin = loader._pin_then_go

    def slow_then_broken(host: Any, upload: Any, errors: list[BaseException]) -> None:
        time.sleep(1.0)  # tensors land meanwhile and are held back

        def broken(self: Copier, pairs: Any) -> None:
            raise RuntimeError("planted copy failure")

        monkeypatch.setattr(Copier, "copy_many", broken)
        real_pin(host, upload, errors)
        # The error's traceback keeps the frames above it, this one too: it must not keep the targets.
        del host, upload, errors

    monkeypatch.setattr(loader, "_pin_then_go", slow_then_broken)
    cluster.push(layers(3, seed=5), "pinfail", tag="prod")
    cache = mem_cache()
    handle = start_load(client, "pinfail:prod", "cpu", cache, config=PrefetchConfig(host_staging="always"))
    with pytest.raises(RuntimeError, match="planted copy failure"):
        handle.result(timeout=60)
    with pytest.raises(TensorFailed):
        handle.wait("layers.0.weight", timeout=10)
    # What landed is kept, and the failed handle (its error's traceback included) holds none of it.
    from paramserver.client.hostmem import default_pool

    group = cache._groups[handle.manifest.id]
    assert group.arena is not None and group.private  # every host chunk landed verified; only the upload failed
    assert default_pool().free_but_for(group.arena.view)


def test_host_staging_setting_is_checked() -> None:
    with pytest.raises(Exception, match="host_staging must be one of auto, always, never"):
        PrefetchConfig(host_staging="sometimes").validate()


def test_version_sharing_90_percent_fetches_only_the_rest(cluster: Cluster, client: ClusterClient) -> None:
    base = layers(20, seed=1)
    tuned = finetune(base, fraction=0.1, seed=2)
    v1 = cluster.push(base, "tuned", tag="prod").version.number
    v2 = cluster.push(tuned, "tuned", parent=v1).version.number
    cache = mem_cache()
    old = load(client, f"tuned@{v1}", cache=cache)
    new = load(client, f"tuned@{v2}", cache=cache)
    d = diff(old.manifest, new.manifest)
    assert d.shared_fraction >= 0.85
    assert new.report.bytes_network == d.added_bytes
    assert new.report.bytes_memory == d.shared_bytes
    assert_bit_exact(new.tensors, tuned)


def test_hot_swap_fetches_only_changed_chunks_and_swaps_atomically(cluster: Cluster, client: ClusterClient) -> None:
    base = layers(10, seed=5)
    tuned = finetune(base, fraction=0.2, seed=6)
    v1 = cluster.push(base, "swap", tag="live").version.number
    swaps: list[int] = []
    swapper = HotSwapper(client, "swap:live", "cpu", cache=None, on_swap=lambda new, old: swaps.append(new.info.number))
    first = swapper.start()
    assert swapper.check() is None  # tag did not move
    v2 = cluster.push(tuned, "swap", parent=v1, tag="live").version.number
    old_tensors = swapper.current.tensors
    new = swapper.check()
    assert new is not None and new.info.number == v2 and swaps == [v1, v2]
    d = diff(first.manifest, new.manifest)
    assert new.report.bytes_network == d.added_bytes and new.report.bytes_local == d.shared_bytes
    assert_bit_exact(swapper.current.tensors, tuned)
    assert_bit_exact(old_tensors, base)  # the old version was never written to


def test_a_swap_whose_module_cannot_be_built_keeps_the_old_version_and_is_tried_again(cluster: Cluster, client: ClusterClient) -> None:
    base = layers(4, seed=8)
    v1 = cluster.push(base, "swapfail", tag="live").version.number
    refuse = [True]

    def on_swap(new: LoadedModel, old: LoadedModel | None) -> None:
        if old is not None and refuse[0]:
            raise RuntimeError("the new shapes do not fit the module")

    swapper = HotSwapper(client, "swapfail:live", "cpu", cache=None, on_swap=on_swap)
    swapper.start()
    v2 = cluster.push(finetune(base, fraction=0.5, seed=9), "swapfail", parent=v1, tag="live").version.number
    with pytest.raises(RuntimeError, match="do not fit"):
        swapper.check()
    assert swapper.current.info.number == v1 and swapper.swaps == 0  # still what is served
    refuse[0] = False
    new = swapper.check()  # not taken as installed: tried again
    assert new is not None and new.info.number == v2 and swapper.current.info.number == v2 and swapper.swaps == 1


def test_server_killed_mid_load_does_not_fail_it(cluster: Cluster) -> None:
    sd = layers(24, rows=512, seed=7)  # 48 MiB
    cluster.push(sd, "big", tag="prod")
    victim = "ps2"
    config = SessionConfig(max_read_bytes=1 * MiB, grpc_streams_per_server=2)
    with ClusterClient(cluster.seed, config=config) as c:
        c.refresh()
        killer: list[threading.Thread] = []
        landed = [0]

        def progress(n: int) -> None:
            landed[0] += n
            if landed[0] > 8 * MiB and not killer:
                killer.append(threading.Thread(target=cluster.kill, args=(victim,)))
                killer[0].start()

        try:
            handle = start_load(c, "big:prod", "cpu", None, on_progress=progress)
            tensors, report = handle.result(timeout=120)
            assert killer, "the load ended before the kill"
            assert_bit_exact(tensors, sd)
            assert report.bytes_network == report.bytes_total
            assert report.failovers > 0  # calls to the dead server were re-planned onto live replicas
            served = c.stats.by_server
            assert served.get(victim, 0) < report.bytes_network  # the others took over its share
        finally:
            for t in killer:
                t.join(30)
            cluster.restart(victim)


def _rewrite_stored(location: ChunkLocation | None, flip_at: int, fix_crc: bool) -> None:
    assert location is not None, "the replica holds no record of the chunk"
    # fix_crc: the server's own CRC check passes: only the worker's check against the manifest can catch it
    corrupt_stored(location, at=flip_at, xor=0x5A, fix_crc=fix_crc)


def test_corrupt_replica_is_detected_read_elsewhere_and_reported(cluster: Cluster) -> None:
    sd = layers(4, seed=9)
    cluster.push(sd, "corrupt", tag="prod")
    with ClusterClient(cluster.seed) as c:
        info = c.resolve("corrupt", "prod")
        manifest: Manifest = c.manifest(info.manifest_id)
        victim_chunk = manifest.chunks[2].id
        # The planner is deterministic: corrupt the copy on the replica it will read first.
        order = ChunkRows.of(manifest.chunks, unique_order(manifest, None))
        first = FetchPlanner(c.view().wants(order), sorted(c.members())).start()
        victim_slot = [r.id for r in order.refs()].index(victim_chunk)
        bad = next(d.server for d in first if isinstance(d, Read) and victim_slot in d.slots.tolist())
        _rewrite_stored(cluster.chunk_location(bad, victim_chunk), 1000, fix_crc=True)
        loaded = load(c, "corrupt:prod")
        assert_bit_exact(loaded.tensors, sd)
        assert loaded.report.corrupt_reports >= 1 and loaded.report.failovers >= 1
        deadline = time.monotonic() + 10
        quarantined = 0
        with ParamServerClient(cluster.slot(bad).grpc) as ps:
            while time.monotonic() < deadline:
                quarantined = ps.server_status().quarantined
                if quarantined:
                    break
                time.sleep(0.1)
        assert quarantined >= 1, "the bad replica was not reported (ReportCorrupt makes it quarantine the chunk)"
        assert c.corrupt_reports_sent >= 1


def test_data_loss_on_every_replica_names_the_chunk(cluster: Cluster, client: ClusterClient) -> None:
    sd = layers(3, seed=11)
    cluster.push(sd, "lost", tag="prod")
    info = client.resolve("lost", "prod")
    victim = client.manifest(info.manifest_id).chunks[1].id
    for sid in client.replicas(victim):
        _rewrite_stored(cluster.chunk_location(sid, victim), 7, fix_crc=False)
    with pytest.raises(ChunkDataLoss, match=victim) as err:
        load(client, "lost:prod")
    assert "DATA_LOSS" in str(err.value) and "re-push" in str(err.value)


class StaleServer(pb_grpc.ParamServerServicer):
    """A server stuck in the past: answers ResolveTag with an old resolution, nothing else."""

    def __init__(self, reply: pb.VersionReply) -> None:
        self.reply = reply
        self.asked = 0

    def ResolveTag(self, request: pb.ResolveTagRequest, context: grpc.ServicerContext) -> pb.VersionReply:  # noqa: N802 - the RPC's name
        self.asked += 1
        return self.reply


@pytest.fixture()
def stale_server() -> Iterator[tuple[str, StaleServer]]:
    servicer = StaleServer(pb.VersionReply())
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    pb_grpc.add_ParamServerServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield f"127.0.0.1:{port}", servicer
    finally:
        server.stop(0)


def test_stale_server_cannot_roll_the_worker_back(cluster: Cluster, stale_server: tuple[str, StaleServer], tmp_path: Path) -> None:
    fake, servicer = stale_server
    old_sd, new_sd = layers(2, seed=20), layers(2, seed=21)
    v1 = cluster.push(old_sd, "mono", tag="stable").version.number
    with ParamServerClient(cluster.addresses[0]) as ps:
        servicer.reply = ps.resolve_tag("mono", "stable")  # what a lagging server will keep saying
    cluster.push(new_sd, "mono", parent=v1, tag="stable")
    memory = str(tmp_path / "seen.json")
    with ClusterClient(cluster.seed, config=SessionConfig(monotonic_path=memory)) as fresh:
        assert fresh.resolve("mono", "stable").number == v1 + 1
    # A restarted worker whose nearest server is stale: the old answer is refused, the next server asked.
    with ClusterClient([fake, *cluster.addresses], config=SessionConfig(monotonic_path=memory)) as c:
        got = load_state_dict(c, "mono:stable")
        assert servicer.asked >= 1
        assert_bit_exact(got, new_sd)
    # Only the stale server reachable: a clear staleness error, never the old version.
    with ClusterClient([fake], config=SessionConfig(monotonic_path=memory)) as c:
        with pytest.raises(StaleRead, match="older"):
            c.resolve("mono", "stable")
    # Feeding a resolution with an older clock than one remembered is refused by every real server too.
    with ClusterClient(cluster.seed) as c:
        c.monotonic.remember(Resolution("mono", "stable", 99, "0" * 64, {"tests": 10_000}, 10**9, "future"))
        with pytest.raises(StaleRead):
            c.resolve("mono", "stable")


def test_deliberate_rollback_is_followed(cluster: Cluster, client: ClusterClient) -> None:
    v1 = cluster.push(layers(1, seed=30), "rb", tag="prod").version.number
    cluster.push(layers(1, seed=31), "rb", parent=v1, tag="prod")
    assert client.resolve("rb", "prod").number == v1 + 1
    cluster.rollback_tag("rb", "prod")
    assert client.resolve("rb", "prod").number == v1  # a later commit proves it is a rollback, not staleness
    with ClusterClient(cluster.seed, config=SessionConfig(allow_rollback=False)) as strict:
        strict.monotonic.remember(Resolution("rb", "prod", v1 + 1, "0" * 64, {"tests": 10_000}, 0, "x"))
        with pytest.raises(StaleRead):
            strict.resolve("rb", "prod")


def test_heat_is_reported_and_served(cluster: Cluster, client: ClusterClient) -> None:
    cluster.push(layers(4, seed=40), "heat", tag="prod")
    loaded = load(client, "heat:prod", config=PrefetchConfig(use_heatmap=True))
    assert loaded.handle is not None and loaded.handle.heat_sent(10)
    entries = client.get_heat("heat", loaded.info.number)
    assert entries is not None
    assert {i for i, _, _ in entries} == set(range(len(loaded.manifest.chunks)))


def test_cli_load_prints_tiers(cluster: Cluster) -> None:
    cluster.push(layers(4, seed=50), "cli", tag="prod")
    out = subprocess.run(
        [sys.executable, "-m", "worker", "load", "cli:prod", "--cluster", cluster.seed, "--device", "cpu",
         "--cache-mb", "64", "--repeat", "2", "--json"],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )
    assert out.returncode == 0, out.stderr
    first, second = (json.loads(line) for line in out.stdout.strip().splitlines())
    assert first["bytes_network"] == first["bytes_total"] > 0
    assert second["bytes_network"] == 0 and second["bytes_memory"] == second["bytes_total"]
    assert first["bytes_peer"] == second["bytes_peer"] == 0  # no other worker holds it: nothing from peers
    bad = subprocess.run([sys.executable, "-m", "worker", "load", "nope", "--cluster", cluster.seed],
                         cwd=REPO, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 3 and "does not exist" in bad.stderr  # "nope" names its latest version
    bad = subprocess.run([sys.executable, "-m", "worker", "load", "nope:", "--cluster", cluster.seed],
                         cwd=REPO, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "MODEL:TAG" in bad.stderr


def small_net() -> torch.nn.Module:
    """Factory for the serve test (built on the meta device by paramworker serve)."""
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))


def _post(address: str, body: object) -> dict[str, object]:
    req = urllib.request.Request(f"http://{address}/infer", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=10) as r:
        return json.loads(r.read())  # type: ignore[no-any-return]


def test_serve_answers_and_follows_tag(cluster: Cluster) -> None:
    torch.manual_seed(1)
    a, b = small_net(), small_net()
    v1 = cluster.push(a.state_dict(), "net", tag="prod").version.number
    proc = subprocess.Popen(
        [sys.executable, "-m", "worker", "serve", "--model", "net:prod", "--factory",
         "tests.integration.test_worker_cluster:small_net", "--cluster", cluster.seed, "--listen", "127.0.0.1:0",
         "--poll-s", "0.2", "--device", "cpu", "--cache-mb", "16"],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.startswith("LISTENING"), line + proc.stdout.read()[-2000:] if proc.poll() is not None else line
        address = line.split()[1]
        x = [[1.0, 2.0, 3.0, 4.0], [0.5, -1.0, 0.0, 2.0]]
        with torch.no_grad():
            want_a, want_b = a(torch.tensor(x)).tolist(), b(torch.tensor(x)).tolist()
        got = _post(address, {"input": x})
        assert got["output"] == want_a and got["version"] == v1
        cluster.push(b.state_dict(), "net", parent=v1, tag="prod")
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            got = _post(address, x)
            if got["version"] != v1:
                break
            time.sleep(0.1)
        assert got["version"] == v1 + 1 and got["output"] == want_b
        with urllib.request.urlopen(f"http://{address}/healthz", timeout=5) as r:
            health = json.loads(r.read())
        assert health["swaps"] == 1 and health["version"] == v1 + 1
        # The swap sent v1's forward-pass heat: on top of the load's report, every chunk of the
        # net was read again by the forward passes served on v1.
        heat: dict[int, int] = {}
        with ClusterClient(cluster.seed) as c:
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline:
                heat = {index: count for index, count, _rank in c.get_heat("net", v1) or []}
                if heat and all(count >= 2 for count in heat.values()):
                    break
                time.sleep(0.2)
        assert heat and all(count >= 2 for count in heat.values()), heat
    finally:
        stop_process(proc)


def test_a_request_taken_before_a_swap_still_counts_in_the_old_versions_heat(cluster: Cluster) -> None:
    """A request holds the module it took; the swap's heat report waits for it (forward_heat)."""
    from worker.serve import ModelServer

    torch.manual_seed(2)
    a, b = small_net(), small_net()
    v1 = cluster.push(a.state_dict(), "heat-net", tag="prod").version.number
    x = [[1.0, 2.0, 3.0, 4.0]]
    with ClusterClient(cluster.seed) as client:
        server = ModelServer(client, "heat-net:prod", small_net, heat_report_s=600.0)
        try:
            server.start("127.0.0.1:0", poll_s=0.2)
            assert server.wait_loaded(30)

            def heat_of_v1() -> dict[int, int]:
                return {index: count for index, count, _rank in client.get_heat("heat-net", v1) or []}

            deadline = time.monotonic() + 20
            while not heat_of_v1() and time.monotonic() < deadline:  # the load's own report
                time.sleep(0.1)
            loaded = heat_of_v1()
            assert loaded, "the load reported no heat"
            taken = server.target_for(f"heat-net@{v1}", exact=True)  # a request that took v1, not yet run
            cluster.push(b.state_dict(), "heat-net", parent=v1, tag="prod")
            deadline = time.monotonic() + 30
            while server.swapper.swaps < 1 and time.monotonic() < deadline:
                time.sleep(0.1)
            assert server.swapper.swaps == 1
            time.sleep(0.5)
            assert heat_of_v1() == loaded  # the swap did not report v1's heat yet: a request holds it
            answer, served = server.infer(x, use_cache=False, target=taken)
            assert answer.status == 200 and served.info.number == v1
            with torch.no_grad():
                assert json.loads(answer.body)["output"] == a(torch.tensor(x)).tolist()
            deadline = time.monotonic() + 20
            heat = heat_of_v1()
            while time.monotonic() < deadline and not all(heat.get(i, 0) > loaded[i] for i in loaded):
                time.sleep(0.1)
                heat = heat_of_v1()
            assert all(heat.get(i, 0) > loaded[i] for i in loaded), (loaded, heat)
        finally:
            server.stop()


def test_answers_of_a_module_still_being_filled_are_not_cached(cluster: Cluster) -> None:
    """A cold start's forward may read a weight past the pre-hooks (outside its owner's forward):
    its answer is served, never kept, so a wrong one cannot outlive the load."""
    from worker.serve import ModelServer

    torch.manual_seed(3)
    cluster.push(small_net().state_dict(), "cold-net", tag="prod")
    x = [[1.0, 2.0, 3.0, 4.0]]
    with ClusterClient(cluster.seed) as client:
        server = ModelServer(client, "cold-net:prod", small_net, heat_report_s=600.0, cold_start=False)
        try:
            server.start("127.0.0.1:0", poll_s=0)
            assert server.wait_loaded(30)
            module, _ = server.snapshot()

            class Filling:  # what _start_cold holds while the weights arrive
                pass

            cold = Filling()
            cold.module = module  # type: ignore[attr-defined]
            server.models._cold = cold  # type: ignore[assignment]
            outcomes = [server.infer(x)[0].outcome for _ in range(2)]
            assert outcomes == ["computed", "computed"]
            server.models._cold = None
            outcomes = [server.infer(x)[0].outcome for _ in range(2)]
            assert outcomes == ["computed", "hit_l1"]
        finally:
            server.models._cold = None
            server.stop()


def test_help_documents_options() -> None:
    out = subprocess.run([sys.executable, "-m", "worker", "serve", "--help"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0
    for opt in ("--model", "--factory", "--listen", "--cluster", "--token", "--device", "--cache-mb", "--disk-cache", "default"):
        assert opt in out.stdout
