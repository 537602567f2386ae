"""Out-of-range integers on the command line end in exit 2 and one line, never a traceback."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ENV = {**{k: v for k, v in os.environ.items() if not k.startswith("PARAMS_")}, "PARAMS_CLUSTER": "127.0.0.1:1"}


def run(module: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True, timeout=60, env=ENV)


@pytest.mark.parametrize("args", [
    ("tag", "m", "prod", "-1"),
    ("tag", "m", "prod", "0"),
    ("tag", "m", "prod", str(2**64)),
    ("tag", "m", "prod", "1e3"),
    ("pull", f"m@{2**64}", "--out", "/tmp/never-written.safetensors"),
    ("pull", "m@-1", "--out", "/tmp/never-written.safetensors"),
    ("pull", "m:prod", "--out", "/tmp/never-written.safetensors", "--streams", "0"),
    ("push", "x.safetensors", "--model", "m", "--parent", str(2**64)),
    ("--timeout", "nan", "status"),
    ("--timeout", "-5", "status"),
])  # fmt: skip
def test_paramctl_refuses_bad_integers_in_one_line(args: tuple[str, ...]) -> None:
    proc = run("paramserver.client.ctl", *args)
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if "error" in line.lower()]
    assert len(errors) == 1, proc.stderr


@pytest.mark.parametrize("args", [
    ("load", "m:prod", "--cache-mb", "-1"),
    ("load", "m:prod", "--streams", str(2**64)),
    ("load", "m:prod", "--repeat", "0"),
    ("load", f"m@{2**64}"),
    ("serve", "--model", "m:prod", "--poll-s", "inf"),
])  # fmt: skip
def test_paramworker_refuses_bad_integers_in_one_line(args: tuple[str, ...]) -> None:
    proc = run("worker.cli", *args)
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr


SERVE = ("serve", "--model", "m:prod", "--factory", "tests.integration.serve_models:slow_net")


@pytest.mark.parametrize("args,why", [
    ((*SERVE, "--result-cache-redis", "http://h:1/0"), "redis://"),
    ((*SERVE, "--result-cache-redis", "redis://h:notaport/0"), "--result-cache-redis"),
    ((*SERVE, "--result-cache-redis", "redis://:secret@h:6379/0"), "PARAMS_RESULT_CACHE_REDIS"),
    ((*SERVE, "--max-queue", "-1"), "--max-queue"),
    ((*SERVE, "--result-cache-ttl", "0"), "--result-cache-ttl"),
])  # fmt: skip
def test_paramworker_serve_refuses_bad_cache_settings_in_one_line(args: tuple[str, ...], why: str) -> None:
    proc = run("worker.cli", *args)
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr and why in proc.stderr, proc.stderr
    assert "secret" not in proc.stderr  # a password in the URL is never echoed


def test_paramworker_serve_refuses_a_missing_or_open_result_cache_key_in_one_line(tmp_path: Path) -> None:
    """L2 needs the workers' shared key (issue 41): from a file other users cannot read."""
    key = tmp_path / "key"
    key.write_text("k" * 43)
    key.chmod(0o600)
    loose = tmp_path / "loose"
    loose.write_text("k" * 43)
    loose.chmod(0o644)
    redis = ("--result-cache-redis", "redis://h:6379/0")
    for args, why in (((*SERVE, *redis), "needs --result-cache-key-file"),
                      ((*SERVE, *redis, "--result-cache-key-file", str(loose)), "chmod 600"),
                      ((*SERVE, *redis, "--result-cache-key-file", str(tmp_path / "none")), "--result-cache-key-file"),
                      ((*SERVE, "--result-cache-redis", "redis://h:notaport/0", "--result-cache-key-file", str(key)),
                       "give redis://HOST:PORT/DB")):
        proc = run("worker.cli", *args)
        assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
        assert "Traceback" not in proc.stderr and why in proc.stderr, proc.stderr
        assert len([line for line in proc.stderr.splitlines() if line.strip()]) == 1, proc.stderr
