"""Fault-injection drills: kill the leader, partition the network, corrupt a chunk, restart servers.

``report`` records what a drill saw; ``framework`` runs the background workload
and the invariant checks; ``adapters`` plugs in the real publisher and loaders;
drill modules (``kill_leader``, ``partition``, ``corrupt_chunk``, ``restart``)
drive a ``deploy.local.LocalCluster`` with real processes; ``run.main(argv)`` is
the CLI (``python -m deploy.drills``, and what ``paramctl drill`` calls).
"""
from __future__ import annotations

from .framework import (
    DrillError,
    Loaded,
    Published,
    Workload,
    WorkloadConfig,
    check_converged,
    check_loads_bit_exact,
    check_monotonic_reads,
    check_no_failed_loads,
    check_no_lost_commits,
    check_within,
    check_workload,
    committed_present,
    run_drill,
    wait_for,
)
from .report import DrillReport, load_report

__all__ = [
    "DrillError", "DrillReport", "Loaded", "Published", "Workload", "WorkloadConfig", "check_converged",
    "check_loads_bit_exact", "check_monotonic_reads", "check_no_failed_loads", "check_no_lost_commits",
    "check_within", "check_workload", "committed_present", "load_report", "run_drill", "wait_for",
]
