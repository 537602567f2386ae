"""The Python API with nothing but ``PARAMS_CONFIG``, as a newcomer runs it (issue 40's Done-when):
``python -m deploy.local up --dir D --tls``, the ``export PARAMS_CONFIG=...`` line it prints, then a
fresh ``python -c`` script whose two lines are ``from paramserver.client import push`` (push a state
dict of odd dtypes and shapes) and ``from worker import load_state_dict`` (load it back by tag),
compared byte for byte; no token, TLS or address anywhere in the script or its environment. The
same without ``--tls``, and the runnable example of docs/python-api.md, executed as it is.
"""
from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
CLIENT_ENVS = ("PARAMS_CLUSTER", "PARAMS_ADMIN_TOKEN", "PARAMS_READ_TOKEN", "PARAMS_TLS_CA", "PARAMS_TLS_CERT", "PARAMS_TLS_KEY",
               "PARAMS_VERIFY", "PARAMS_CONFIG", "PARAMS_CLUSTER_SECRET")

# The state dict: bf16, int8, a 0-d tensor, an empty one, odd shapes; the script prints how many
# tensors came back bit-exact (bytes compared through uint8 views, so -0.0 and NaN bits count too).
SCRIPT = """
import json, torch
g = torch.Generator().manual_seed(40)
state = {
    "block.0.weight": torch.randn(3, 5, 7, generator=g).bfloat16(),
    "block.0.scale": torch.randint(-128, 127, (13,), dtype=torch.int8, generator=g),
    "step": torch.tensor(7.25),
    "empty": torch.empty(0, 4, dtype=torch.float16),
    "odd": torch.randn(1, 1, 9973, generator=g, dtype=torch.float64),
    "signs": torch.tensor([-0.0, float("nan"), float("inf")]).bfloat16(),
}
from paramserver.client import push; report = push(state, model="api", tag="prod")
from worker import load_state_dict; loaded = load_state_dict("api:prod")
raw = lambda t: t.contiguous().reshape(-1).view(torch.uint8)
same = [n for n in state if loaded[n].dtype == state[n].dtype and loaded[n].shape == state[n].shape
        and torch.equal(raw(loaded[n]), raw(state[n]))]
print(json.dumps({"version": report.version, "same": sorted(same), "names": sorted(loaded)}))
"""


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in CLIENT_ENVS}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    env.update(extra)
    return env


def run(args: list[str], env: dict[str, str], timeout: float = 180) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True, timeout=timeout, cwd=ROOT)


@contextmanager
def up(folder: Path, *flags: str) -> Iterator[str]:
    """``deploy.local up --dir folder``; yields the PARAMS_CONFIG its export line names; always down."""
    started = run(["-m", "deploy.local", "up", "--dir", str(folder), "--timeout", "90", *flags], clean_env())
    try:
        assert started.returncode == 0, started.stdout + started.stderr
        exports = [line for line in started.stdout.splitlines() if line.startswith("export PARAMS_CONFIG=")]
        assert len(exports) == 1, started.stdout
        yield shlex.split(exports[0].removeprefix("export "))[0].removeprefix("PARAMS_CONFIG=")
    finally:
        run(["-m", "deploy.local", "down", "--dir", str(folder)], clean_env(), timeout=60)


@pytest.fixture(scope="module")
def tls_config(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with up(tmp_path_factory.mktemp("api-tls"), "--tls") as config:
        yield config


def check_script(config: str) -> None:
    got = run(["-c", SCRIPT], clean_env(PARAMS_CONFIG=config))
    assert got.returncode == 0, got.stderr
    result = json.loads(got.stdout.strip().splitlines()[-1])
    assert result["version"] == 1
    assert result["same"] == result["names"] == sorted(["block.0.weight", "block.0.scale", "step", "empty", "odd", "signs"])


def test_two_line_script_pushes_and_loads_bit_exact_over_tls_with_only_params_config(tls_config: str) -> None:
    text = Path(tls_config).read_text()
    assert "tls_ca" in text and "admin_token_file" in text  # TLS and tokens on: the script gave neither
    check_script(tls_config)


def test_the_documented_example_runs_as_it_is(tls_config: str) -> None:
    doc = (ROOT / "docs" / "python-api.md").read_text()
    blocks = re.findall(r"<!-- example: python-api -->\s*```python\n(.*?)```", doc, re.S)
    assert len(blocks) == 1, "docs/python-api.md must hold one block marked '<!-- example: python-api -->'"
    got = run(["-c", blocks[0]], clean_env(PARAMS_CONFIG=tls_config))
    assert got.returncode == 0, got.stderr
    assert "bit-exact" in got.stdout


def test_two_line_script_without_tls(tmp_path: Path) -> None:
    with up(tmp_path / "plain", "--servers", "1", "--replication", "1") as config:
        assert "tls_ca" not in Path(config).read_text()
        check_script(config)
