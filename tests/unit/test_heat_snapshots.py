"""Heat survives a server restart: HeatAggregator.save/load and HeatSnapshots (the data dir's heat.npz)."""
from __future__ import annotations

import io
import logging
import random
from pathlib import Path

import numpy as np
import pytest

from paramserver.server.heat import HEAT_FILE, HeatAggregator, HeatSnapshots
from paramserver.wire.heat_entries import HeatEntry


def _filled(seed: int = 1, versions: int = 3, size: int = 40) -> HeatAggregator:
    rng = random.Random(seed)
    heat = HeatAggregator()
    for v in range(1, versions + 1):
        for _ in range(rng.randrange(1, 6)):
            entries = [HeatEntry(rng.randrange(size), rng.randrange(1, 100), rng.randrange(size)) for _ in range(rng.randrange(0, 30))]
            heat.report("m", v, entries, size=size)
    heat.report("other", 7, [HeatEntry(0, 1, 0)], size=1)
    return heat


def test_a_saved_aggregator_loads_back_to_the_same_replies(tmp_path: Path) -> None:
    heat = _filled()
    path = tmp_path / HEAT_FILE
    assert heat.save(path)
    again = HeatAggregator()
    assert again.load(path) == heat.versions == 4
    assert again.entries == heat.entries
    for key in [("m", 1), ("m", 2), ("m", 3), ("other", 7)]:
        assert again.get_reply(*key) == heat.get_reply(*key)
    # reports keep adding to what was loaded
    heat.report("m", 1, [HeatEntry(3, 5, 0)], size=40)
    again.report("m", 1, [HeatEntry(3, 5, 0)], size=40)
    assert again.get_reply("m", 1) == heat.get_reply("m", 1)


def test_save_writes_only_after_a_report(tmp_path: Path) -> None:
    heat = HeatAggregator()
    path = tmp_path / HEAT_FILE
    assert not heat.save(path) and not path.exists()
    heat.report("m", 1, [HeatEntry(0, 1, 0)], size=4)
    assert heat.save(path) and not heat.save(path)
    heat.report("m", 1, [HeatEntry(1, 1, 1)], size=4)
    assert heat.save(path)
    assert not list(tmp_path.glob("*.tmp"))
    loaded = HeatAggregator()
    loaded.load(path)
    assert not loaded.save(path)  # nothing new since the load


def test_load_keeps_within_the_bounds_the_most_recently_reported(tmp_path: Path) -> None:
    heat = HeatAggregator()
    for v in range(1, 6):
        heat.report("m", v, [HeatEntry(0, v, 0)], size=10)
    path = tmp_path / HEAT_FILE
    heat.save(path)
    small = HeatAggregator(max_versions=2)
    assert small.load(path) == 2
    assert small.get("m", 5)[1] == 1 and small.get("m", 4)[1] == 1 and small.get("m", 3)[1] == 0
    tiny = HeatAggregator(max_entries=25)
    tiny.load(path)
    assert tiny.entries <= 25 and tiny.get("m", 5)[1] == 1


def _npz(path: Path, **arrays: np.ndarray) -> None:
    buf = io.BytesIO()
    np.savez(buf, **arrays)
    path.write_bytes(buf.getvalue())


@pytest.mark.parametrize("damage", ["garbage", "empty", "truncated", "pickled", "lengths", "meta", "types"])
def test_a_damaged_snapshot_is_refused_and_the_server_starts_without_it(tmp_path: Path, damage: str,
                                                                        caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / HEAT_FILE
    good = tmp_path / "good.npz"
    _filled().save(good)
    meta = np.frombuffer(b'[{"model": "m", "version": 1, "size": 3, "reports": 1}]', np.uint8)
    if damage == "garbage":
        path.write_bytes(b"\x00not a snapshot" * 100)
    elif damage == "empty":
        path.write_bytes(b"")
    elif damage == "truncated":
        path.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    elif damage == "pickled":
        buf = io.BytesIO()
        np.savez(buf, meta=np.array([{"a": 1}], dtype=object), count=np.zeros(3, np.int64),
                 order_sum=np.zeros(3, np.int64), hits=np.zeros(3, np.uint32))
        path.write_bytes(buf.getvalue())
    elif damage == "lengths":
        _npz(path, meta=meta, count=np.zeros(4, np.int64), order_sum=np.zeros(4, np.int64), hits=np.zeros(4, np.uint32))
    elif damage == "meta":
        _npz(path, meta=np.frombuffer(b'{"model": 1}', np.uint8), count=np.zeros(3, np.int64),
             order_sum=np.zeros(3, np.int64), hits=np.zeros(3, np.uint32))
    else:
        _npz(path, meta=meta, count=np.zeros(3, np.float64), order_sum=np.zeros(3, np.int64), hits=np.zeros(3, np.uint32))
    with pytest.raises(ValueError):
        HeatAggregator().load(path)
    snapshots = HeatSnapshots(HeatAggregator(), tmp_path)
    caplog.set_level(logging.INFO, logger="paramserver.server.heat")
    snapshots.restore()
    assert snapshots.heat.versions == 0
    assert any("heat: cannot read" in r.getMessage() and r.levelno == logging.WARNING for r in caplog.records)


def test_a_failed_write_is_logged_once_until_it_works_again(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    heat = HeatAggregator()
    snapshots = HeatSnapshots(heat, tmp_path / "missing-dir")
    caplog.set_level(logging.INFO, logger="paramserver.server.heat")
    for i in range(3):
        heat.report("m", 1, [HeatEntry(i, 1, i)], size=4)
        assert not snapshots.step()
    assert sum("heat: cannot write" in r.getMessage() for r in caplog.records) == 1
    (tmp_path / "missing-dir").mkdir()
    assert snapshots.step()
    assert any("written again" in r.getMessage() for r in caplog.records)
    fresh = HeatSnapshots(HeatAggregator(), tmp_path / "missing-dir")
    fresh.restore()
    assert fresh.heat.get_reply("m", 1) == heat.get_reply("m", 1)
