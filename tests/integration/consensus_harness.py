"""The metadata-node processes of ``deploy.devcluster`` under the names the consensus tests use.

The classes live in ``deploy/`` so that ``bench/bench_consensus.py`` drives the same ones
without importing tests/.
"""
from __future__ import annotations

from pathlib import Path

from deploy.devcluster import DevCluster as Cluster
from deploy.devcluster import DevNode, wait_until
from deploy.local import free_port

REPO_ROOT = Path(__file__).resolve().parents[2]

__all__ = ["REPO_ROOT", "Cluster", "DevNode", "free_port", "wait_until"]
