"""Checking a name must not load the Raft library: ``import consensus`` and the path paramctl takes
to validate a model name (``consensus.validation.check_name``) leave pysyncobj unimported; the Raft
node still imports, lazily, from the package."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _loads_pysyncobj(code: str) -> bool:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", f"import sys\n{code}\nprint('pysyncobj' in sys.modules)"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=120, check=True)
    return out.stdout.strip().splitlines()[-1] == "True"


def test_importing_consensus_and_its_light_names_leaves_pysyncobj_out() -> None:
    assert not _loads_pysyncobj(
        "import consensus\n"
        "from consensus import ConfigError, Invalid, MemberRecord, MetadataState, RaftConfig, VectorClock\n"
        "from consensus.validation import check_name\n"
        "check_name('model', 'llama-7b')")


def test_paramctls_name_check_leaves_pysyncobj_out() -> None:
    # paramctl validates names with consensus.validation.check_name (paramserver/client/ctl_commands.py, push.py)
    assert not _loads_pysyncobj(
        "import paramserver.client.ctl\n"
        "import paramserver.client.ctl_commands\nfrom paramserver.client.ctl_commands import check_name\n"
        "check_name('model', 'llama-7b')")


def test_the_raft_node_is_still_importable_from_the_package() -> None:
    assert _loads_pysyncobj("from consensus import MetadataNode, NodeNotStarted\n"
                            "import consensus\n"
                            "assert consensus.MetadataNode is MetadataNode")
