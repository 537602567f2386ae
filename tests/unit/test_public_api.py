"""The public Python API's imports: ``from worker import load_state_dict, ...`` and ``from
paramserver.client import push, pull, ClusterClient`` give the functions, while ``import worker``,
``import paramserver.client`` and the cache algorithms stay light (no torch, no gRPC).

Each check runs in a fresh interpreter: this one has imported torch long ago.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HEAVY = ("torch", "grpc", "numpy")


def run(code: str) -> dict[str, object]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    result: dict[str, object] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def test_importing_the_packages_and_the_cache_algorithms_imports_no_torch_or_grpc() -> None:
    got = run(
        "import json, sys\n"
        "import worker, paramserver.client, worker.lru, worker.lru_k\n"
        f"print(json.dumps(sorted(m for m in {HEAVY!r} if m in sys.modules)))\n"
    )
    assert got == [], f"a light import pulled in {got}"


def test_importtime_of_the_packages_lists_no_heavy_module() -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-X", "importtime", "-c", "import worker, paramserver.client"],
                         capture_output=True, text=True, timeout=120, env=env, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    imported = {line.rsplit("|", 1)[-1].strip() for line in out.stderr.splitlines() if line.startswith("import time:")}
    assert not {m for m in imported if m.split(".")[0] in HEAVY}


def test_the_public_names_are_the_functions_whatever_was_imported_first() -> None:
    # paramctl's module imports paramserver.client.push and .pull first: the import system binds
    # those submodules on the package, which must still hand out the functions.
    got = run(
        "import json\n"
        "import paramserver.client.ctl\n"
        "from paramserver.client import push, pull, ClusterClient\n"
        "import paramserver.client as pc\n"
        "from worker import load_state_dict, load_into, empty_weights, start_load, stream_weights\n"
        "import worker\n"
        "from paramserver.client.push import PushOptions\n"
        "print(json.dumps({'push': [push.__module__, push.__name__], 'pull': [pull.__module__, pull.__name__],\n"
        "    'ClusterClient': ClusterClient.__module__, 'again': pc.push is push and pc.pull is pull,\n"
        "    'worker': sorted(f.__module__ + '.' + f.__name__\n"
        "                     for f in (load_state_dict, load_into, empty_weights, start_load, stream_weights)),\n"
        "    'all': [sorted(pc.__all__), sorted(worker.__all__)], 'options': PushOptions.__module__}))\n"
    )
    assert got == {
        "push": ["paramserver.client.push", "push"],
        "pull": ["paramserver.client.pull", "pull"],
        "ClusterClient": "paramserver.client.session",
        "again": True,
        "worker": ["worker.loader.load_into", "worker.loader.load_state_dict", "worker.loader.start_load",
                   "worker.module_fill.empty_weights", "worker.weight_stream.stream_weights"],
        "all": [["ClusterClient", "pull", "push"], ["empty_weights", "load_into", "load_state_dict", "start_load",
                                                    "stream_weights"]],
        "options": "paramserver.client.push",
    }


def test_an_unknown_name_is_an_attribute_error() -> None:
    got = run(
        "import json\n"
        "import paramserver.client, worker\n"
        "out = []\n"
        "for pkg in (paramserver.client, worker):\n"
        "    try:\n"
        "        getattr(pkg, 'no_such_name')\n"
        "    except AttributeError as exc:\n"
        "        out.append(str(exc))\n"
        "print(json.dumps(out))\n"
    )
    assert got == ["module 'paramserver.client' has no attribute 'no_such_name'", "module 'worker' has no attribute 'no_such_name'"]


def test_the_loader_names_stay_importable_from_worker_loader() -> None:
    from worker import loader, module_fill
    from worker.errors import FillError

    for name in ("FillError", "FillReport", "check_fillable", "empty_weights", "fill_module", "plan_fill"):
        assert getattr(loader, name) is getattr(module_fill, name)
    assert loader.FillError is FillError
    for name in loader.__all__:
        assert hasattr(loader, name), name
