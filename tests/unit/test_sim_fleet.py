"""bench/sim_fleet.py: the fleet simulation over the real fetch planner and swarm policy (small, fast runs)."""
from __future__ import annotations

import importlib.util
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np

_PATH = Path(__file__).resolve().parents[2] / "bench" / "sim_fleet.py"
_SPEC = importlib.util.spec_from_file_location("sim_fleet", _PATH)
assert _SPEC is not None and _SPEC.loader is not None
sim_fleet = importlib.util.module_from_spec(_SPEC)
sys.modules["sim_fleet"] = sim_fleet  # dataclasses look their module up
_SPEC.loader.exec_module(sim_fleet)

SMALL = sim_fleet.SimConfig(workers=20, model_gb=1.0, link_gbit=100.0, servers=3, seed=5)


def test_with_peers_the_servers_send_about_one_copy_and_everyone_finishes() -> None:
    result = sim_fleet.simulate(SMALL)
    assert result.ready == 20 and result.unfinished == 0 and result.gave_up == 0
    assert result.server_copies < 1.5
    assert result.last_ready_s >= result.ideal_s  # nobody beats its own link


def test_without_peers_the_servers_send_one_copy_per_worker() -> None:
    result = sim_fleet.simulate(replace(SMALL, peers=False))
    assert result.ready == 20 and result.unfinished == 0
    assert abs(result.server_copies - 20.0) < 1e-9
    # three server links carry it all: the run cannot beat 20 copies over them
    assert result.last_ready_s >= 20 * SMALL.model_bytes / (3 * SMALL.link_gbit * sim_fleet.GBIT)


def test_killed_peers_do_not_stop_the_others() -> None:
    result = sim_fleet.simulate(replace(SMALL, fail=0.25, fail_at=0.5))
    assert result.killed == 5
    assert result.ready == 15 and result.unfinished == 0 and result.gave_up == 0
    assert result.peer_failed_reads > 0  # reads from the killed broke and failed over


def test_deterministic_for_a_seed() -> None:
    config = replace(SMALL, join_spread_s=0.05, fail=0.1)
    a, b = sim_fleet.simulate(config), sim_fleet.simulate(config)
    assert (a.last_ready_s, a.server_copies, a.events) == (b.last_ready_s, b.server_copies, b.events)
    c = sim_fleet.simulate(replace(config, seed=6))
    assert (c.last_ready_s, c.events) != (a.last_ready_s, a.events)


def test_links_are_shared_and_never_overfull() -> None:
    up = np.array([10.0, 10.0, 10.0])
    down = np.array([10.0, 10.0, 4.0])
    src = np.array([0, 0, 1])
    dst = np.array([1, 2, 2])
    rate = sim_fleet.share_rates(src, dst, up, down)
    assert np.bincount(src, weights=rate, minlength=3).max() <= 10.0 + 1e-9
    assert np.bincount(dst, weights=rate, minlength=3)[2] <= 4.0 + 1e-9
    # host 2's downlink (4) is split 2 + 2; host 0 gives its other flow what is left of its uplink (8)
    assert np.allclose(rate, [8.0, 2.0, 2.0])


def test_the_local_variant_policy_runs_and_keeps_uploads_near_one_copy() -> None:
    result = sim_fleet.simulate(replace(SMALL, variant=True))
    assert result.ready == 20 and result.unfinished == 0 and result.gave_up == 0
    assert result.server_copies < 1.5 and result.max_upload_copies <= 1.5
