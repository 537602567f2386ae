"""Bad input to ``python -m deploy.local`` and ``python -m deploy.drills``: one line on stderr, an exit
code from the documented set, no traceback, and nothing a running cluster relies on is touched.

The CLIs run as subprocesses, as a user runs them; only the refused-``up`` test starts a server
(one, on 127.0.0.1), and it always stops it.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from deploy import local
from paramserver.server.data_dir import lock_data_dir
from deploy.drills.framework import DrillError
from deploy.drills.report import DrillReport
from deploy.drills.run import _write_report, check_report_path

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[2]


def cli(module: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PARAMS_")}
    return subprocess.run([sys.executable, "-m", module, *args], env=env, capture_output=True, text=True,
                          timeout=timeout, cwd=REPO)


def one_line(result: subprocess.CompletedProcess[str], code: int, *words: str) -> str:
    assert "Traceback" not in result.stderr, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == code, (result.returncode, result.stderr)
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    for w in words:
        assert w in lines[0], lines[0]
    return lines[0]


def pid_gone(pid: int, timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not local._alive(pid):
            return True
        time.sleep(0.1)
    return False


def test_exit_codes_are_the_clis_table() -> None:
    from paramserver.client import exit_codes

    assert (local.EXIT_OTHER, local.EXIT_BAD_ARGUMENTS, local.EXIT_NOT_FOUND, local.EXIT_CONFLICT,
            local.EXIT_UNAVAILABLE, local.EXIT_INTERRUPTED) == (
        exit_codes.OTHER, exit_codes.BAD_ARGUMENTS, exit_codes.NOT_FOUND, exit_codes.CONFLICT,
        exit_codes.UNAVAILABLE, exit_codes.INTERRUPTED)  # fmt: skip


def test_refused_up_leaves_the_running_cluster_alone(tmp_path: Path) -> None:
    root = tmp_path / "c"
    first = cli("deploy.local", "up", "--servers", "1", "--dir", str(root), "--timeout", "90")
    assert first.returncode == 0, first.stderr
    state = root / local.STATE_FILE
    pid = json.loads(state.read_text())["slots"][0]["pid"]
    try:
        before = state.read_bytes()
        again = cli("deploy.local", "up", "--servers", "1", "--dir", str(root))
        one_line(again, local.EXIT_CONFLICT, "already running", "down --dir")
        assert state.read_bytes() == before
        assert local._alive(pid)
        status = cli("deploy.local", "status", "--dir", str(root))
        assert status.returncode == 0 and "ps1  running" in status.stdout, status.stdout + status.stderr
        # one crashed server is started again on its own ('up' refuses while any runs)
        one_line(cli("deploy.local", "start", "--dir", str(root), "ps1"), local.EXIT_CONFLICT, "ps1 is still running")
        one_line(cli("deploy.local", "start", "--dir", str(root), "ps9"), local.EXIT_NOT_FOUND, "no server 'ps9'")
        os.kill(pid, signal.SIGKILL)
        assert pid_gone(pid)
        # A start the server refuses (its data dir held) fails with the server's own reason, not exit 0.
        held = lock_data_dir(Path(json.loads(state.read_text())["slots"][0]["data_dir"]))
        try:
            one_line(cli("deploy.local", "start", "--dir", str(root), "ps1"), local.EXIT_BAD_ARGUMENTS,
                     "ps1 exited during start-up (exit 2)", "is in use by another paramserver")
        finally:
            os.close(held)
        started = cli("deploy.local", "start", "--dir", str(root), "ps1")
        assert started.returncode == 0 and "started ps1" in started.stdout, started.stderr
        pid = json.loads(state.read_text())["slots"][0]["pid"]
        assert local._alive(pid)
    finally:
        down = cli("deploy.local", "down", "--dir", str(root))
        if not pid_gone(pid):
            os.kill(pid, signal.SIGKILL)
    assert down.returncode == 0, down.stderr
    assert pid_gone(pid, 1.0), "down left the server running"


def test_up_refuses_a_file_as_its_folder(tmp_path: Path) -> None:
    weights = tmp_path / "m.safetensors"
    weights.write_bytes(b"not a folder")
    one_line(cli("deploy.local", "up", "--dir", str(weights)), local.EXIT_BAD_ARGUMENTS, str(weights), "is a file")
    one_line(cli("deploy.local", "up", "--dir", str(weights / "c")), local.EXIT_BAD_ARGUMENTS, str(weights / "c"))
    assert weights.read_bytes() == b"not a folder"


@pytest.mark.parametrize("content", [
    '{"config": {"root": "/x", "servers": 3, "ho',  # truncated by a crash or a full disk
    "\x00\x01 not json at all",
    "[]",
    '{"config": {}, "slots": []}',
    '{"config": {"root": "/x", "servers": 1, "host": "127.0.0.1", "base_port": 0}, "slots": [{"nope": 1}]}',
], ids=["truncated", "binary", "list", "no-fields", "bad-slot"])
def test_a_damaged_state_file_is_named_with_what_to_do(tmp_path: Path, content: str) -> None:
    root = tmp_path / "c"
    root.mkdir()
    state = root / local.STATE_FILE
    state.write_text(content)
    for cmd in ("status", "down", "up"):
        one_line(cli("deploy.local", cmd, "--dir", str(root)), local.EXIT_BAD_ARGUMENTS, str(state), "damaged", "another --dir")
    drill = cli("deploy.drills", "kill-leader", "--cluster-dir", str(root), "--quiet")
    one_line(drill, 2, str(state), "damaged")
    assert state.read_text() == content  # a refused 'up' or 'down' writes nothing over it


@pytest.mark.parametrize(("args", "flag", "words"), [
    (["--servers", "0"], "--servers", "from 1 to 15"),
    (["--servers", "16"], "--servers", "from 1 to 15"),
    (["--replication", "0"], "--replication", "from 1 to 15"),
    (["--timeout", "0"], "--timeout", "above 0"),
    (["--timeout", "-5"], "--timeout", "above 0"),
    (["--timeout", "nan"], "--timeout", "above 0"),
    (["--client-namespaces", "-1"], "--client-namespaces", "from 0 to 16"),
])
def test_up_refuses_out_of_range_numbers_before_starting(tmp_path: Path, args: list[str], flag: str, words: str) -> None:
    root = tmp_path / "c"
    r = cli("deploy.local", "up", "--dir", str(root), *args)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("python -m deploy.local up: error: ") and flag in last and words in last, r.stderr
    assert not root.exists()


@pytest.mark.parametrize("where", ["proc", "folder", "under-a-file"])
def test_drill_refuses_an_unwritable_report_path_before_running(tmp_path: Path, where: str) -> None:
    plain = tmp_path / "plain"
    plain.write_text("x")
    path = {"proc": Path("/proc/pdparams-drill-report.json"), "folder": tmp_path,
            "under-a-file": plain / "r.json"}[where]
    fresh = tmp_path / "fresh"  # the fresh cluster the drill would start: it must not be started
    started = time.monotonic()
    r = cli("deploy.drills", "kill-leader", "--rounds", "1", "--dir", str(fresh), "--json", str(path), "--quiet")
    one_line(r, 2, "could not run", f"--json {path}")
    assert not fresh.exists() and time.monotonic() - started < 60


def test_report_path_check_leaves_nothing_behind(tmp_path: Path) -> None:
    check_report_path(tmp_path / "new" / "deeper" / "r.json")  # write_json makes the folders
    check_report_path(tmp_path / "r.json")
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(DrillError, match="is a folder"):
        check_report_path(tmp_path)


def test_report_goes_to_a_spare_file_when_its_path_fails_late(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    gone = tmp_path / "plain"
    gone.write_text("x")  # a file where the report's folder should be: writing fails
    where = _write_report(DrillReport("kill-leader"), gone / "r.json", "kill-leader")
    try:
        assert json.loads(where.read_text())["drill"] == "kill-leader"
        assert str(where) in capsys.readouterr().err
    finally:
        where.unlink()


def test_a_secret_that_cannot_be_read_is_one_line(tmp_path: Path) -> None:
    """A secret file that exists but cannot be read ended status/down in a traceback."""
    root = tmp_path / "c"
    (root / local.SECRETS_DIR / local.SECRET_FILES["admin_token"]).mkdir(parents=True)  # a folder where the file goes
    (root / local.STATE_FILE).write_text(
        '{"config": {"root": "%s", "servers": 1, "host": "127.0.0.1", "base_port": 0}, "slots": []}' % root)
    for cmd in ("status", "down"):
        one_line(cli("deploy.local", cmd, "--dir", str(root)), local.EXIT_BAD_ARGUMENTS, "cannot read the cluster's secret",
                 local.SECRET_FILES["admin_token"])
