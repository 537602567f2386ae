"""Bad input to ``paramworker`` and ``paramrouter``: one line on stderr, an exit code from the
documented set, no traceback.

The CLIs run as subprocesses, as a user runs them. None of these cases needs a cluster: the
``--cluster`` given is a loopback port nothing listens on (refused at once), or, for the
interrupted load, a socket that accepts and never answers, so the load is surely under way.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from deploy.local import free_port
from paramserver.client.exit_codes import BAD_ARGUMENTS, INTERRUPTED

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[2]


def env(**extra: str) -> dict[str, str]:
    out = {k: v for k, v in os.environ.items() if not k.startswith("PARAMS_")}
    out.update(extra)
    return out


def cli(module: str, *args: str, extra_env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", module, *args], env=env(**(extra_env or {})), capture_output=True,
                          text=True, timeout=120, cwd=REPO)


def one_line(result: subprocess.CompletedProcess[str], prog: str, code: int, *words: str) -> str:
    assert "Traceback" not in result.stderr, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == code, (result.returncode, result.stderr)
    assert len(lines) == 1 and lines[0].startswith(f"{prog}: error: "), result.stderr
    for w in words:
        assert w in lines[0], lines[0]
    return lines[0]


@pytest.fixture
def dead_cluster() -> str:
    return f"127.0.0.1:{free_port()}"


@pytest.fixture
def taken_port() -> Iterator[int]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


def load(cluster: str, *args: str) -> subprocess.CompletedProcess[str]:
    return cli("worker", "load", "m1:prod", "--cluster", cluster, "--no-progress", *args)


def serve(cluster: str, *args: str, extra_env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return cli("worker", "serve", "--model", "m1:prod", "--cluster", cluster, *args, extra_env=extra_env)


# ---------------------------------------------------------------- --device


def test_load_unknown_device(dead_cluster: str) -> None:
    one_line(load(dead_cluster, "--device", "bogus"), "paramworker", BAD_ARGUMENTS, "'bogus'", "cpu, cuda, cuda:N")


def test_serve_unknown_device(dead_cluster: str) -> None:
    r = serve(dead_cluster, "--factory", "torch.nn:Identity", "--device", "bogus", "--listen", "127.0.0.1:0")
    one_line(r, "paramworker", BAD_ARGUMENTS, "'bogus'", "cpu, cuda, cuda:N")


def test_load_device_torch_knows_but_the_loader_does_not(dead_cluster: str) -> None:
    one_line(load(dead_cluster, "--device", "meta"), "paramworker", BAD_ARGUMENTS, "'meta'", "cpu, cuda, cuda:N")


# ---------------------------------------------------------------- --monotonic-file


def test_monotonic_file_is_a_directory(dead_cluster: str, tmp_path: Path) -> None:
    line = one_line(load(dead_cluster, "--device", "cpu", "--monotonic-file", str(tmp_path)), "paramworker", BAD_ARGUMENTS,
                    str(tmp_path), "is a directory", "--monotonic-file")
    assert "UNAVAILABLE" not in line


@pytest.mark.parametrize("content", ["garbage", "[1, 2]", '{"model": "m"}', '[{"model": "m"}]'])
def test_monotonic_file_unparsable(dead_cluster: str, tmp_path: Path, content: str) -> None:
    bad = tmp_path / "seen.json"
    bad.write_text(content)
    line = one_line(load(dead_cluster, "--device", "cpu", "--monotonic-file", str(bad)), "paramworker", BAD_ARGUMENTS,
                    str(bad), "unreadable", "delete it")
    assert "UNAVAILABLE" not in line
    assert bad.read_text() == content  # left for the operator to look at


# ---------------------------------------------------------------- serve --listen


def test_serve_listen_port_in_use(dead_cluster: str, taken_port: int) -> None:
    r = serve(dead_cluster, "--factory", "torch.nn:Identity", "--device", "cpu", "--listen", f"127.0.0.1:{taken_port}")
    one_line(r, "paramworker", BAD_ARGUMENTS, f"port {taken_port} is in use", "pick another --listen")


def test_serve_listen_port_out_of_range(dead_cluster: str) -> None:
    r = serve(dead_cluster, "--factory", "torch.nn:Identity", "--device", "cpu", "--listen", "127.0.0.1:99999")
    one_line(r, "paramworker", BAD_ARGUMENTS, "port must be 0..65535")


# ---------------------------------------------------------------- serve --factory


FACTORIES = '''
def notmodule():
    return 1


def needs_args(width):
    raise AssertionError("never called with an argument")


def raises():
    raise RuntimeError("the factory's own failure")
'''


@pytest.mark.parametrize(("spec", "words"), [
    ("fac", ("'fac'", "package.module:function")),
    ("nomod_pdparams_test:build", ("No module named", "PYTHONPATH")),
    ("fac_pdparams_test:missing", ("cannot be imported", "missing")),
    ("math:pi", ("not callable",)),
    ("fac_pdparams_test:notmodule", ("returned int", "torch.nn.Module")),
    ("fac_pdparams_test:needs_args", ("TypeError", "no arguments")),
    ("fac_pdparams_test:raises", ("RuntimeError", "the factory's own failure")),
])  # fmt: skip
def test_serve_bad_factory(dead_cluster: str, tmp_path: Path, spec: str, words: tuple[str, ...]) -> None:
    (tmp_path / "fac_pdparams_test.py").write_text(FACTORIES)
    path = os.pathsep.join(p for p in (str(tmp_path), os.environ.get("PYTHONPATH", "")) if p)
    r = serve(dead_cluster, "--factory", spec, "--device", "cpu", "--listen", "127.0.0.1:0", extra_env={"PYTHONPATH": path})
    one_line(r, "paramworker", BAD_ARGUMENTS, f"--factory {spec!r}", *words)


# ---------------------------------------------------------------- interrupted load


def test_load_interrupted_says_so() -> None:
    with socket.socket() as silent:  # accepts the load's connection and never answers it
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        silent.settimeout(60)
        proc = subprocess.Popen([sys.executable, "-m", "worker", "load", "m1:prod", "--cluster",
                                 f"127.0.0.1:{silent.getsockname()[1]}", "--device", "cpu", "--no-progress"],
                                env=env(), cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            conn, _ = silent.accept()  # the load is asking the cluster: past imports and argument checks
            with conn:
                proc.send_signal(signal.SIGINT)
                out, err = proc.communicate(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.communicate(timeout=30)
    result = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    one_line(result, "paramworker", INTERRUPTED, "interrupted")


# ---------------------------------------------------------------- paramrouter


def test_router_listen_port_in_use(dead_cluster: str, taken_port: int) -> None:
    r = cli("worker.router", "--listen", f"127.0.0.1:{taken_port}", "--cluster", dead_cluster)
    one_line(r, "paramrouter", BAD_ARGUMENTS, f"port {taken_port} is in use", "pick another --listen")
    assert "Unclosed" not in r.stderr


def test_router_listen_port_in_use_without_cluster(taken_port: int) -> None:
    # The no-cluster warning comes once listening, so a failed start is still one line.
    r = cli("worker.router", "--listen", f"127.0.0.1:{taken_port}")
    one_line(r, "paramrouter", BAD_ARGUMENTS, f"port {taken_port} is in use")


def test_router_help_says_what_happens_without_a_cluster() -> None:
    r = cli("worker.router", "--help")
    assert r.returncode == 0, r.stderr
    text = " ".join(r.stdout.split())
    assert "one must be given" not in text
    assert "resolved from what the workers report" in text


def test_serve_body_budget_below_the_largest_body(dead_cluster: str) -> None:
    r = serve(dead_cluster, "--factory", "torch.nn:Identity", "--device", "cpu", "--listen", "127.0.0.1:0",
              "--max-body-bytes", "1000", "--body-budget-bytes", "999")
    one_line(r, "paramworker", BAD_ARGUMENTS, "--body-budget-bytes 999 is below --max-body-bytes (1000)")
