"""``paramctl`` on input a reviewer found mishandled: text that rich read as markup or emoji, a
table printed before a NOT_FOUND, local path errors as tracebacks, pulled files only their owner
could read, and messages that said the wrong thing about an interrupt or about ``untag latest``.
A real one-server cluster; the CLI in subprocesses.
"""
from __future__ import annotations

import os
import re
import stat
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import pytest
import torch
from safetensors.torch import save_file

from deploy.local import LocalCluster
from paramserver.client import ctl
from tests.conftest import local_cluster

pytestmark = pytest.mark.integration

ADMIN, READ = "admin-token-input", "read-token-input"
ODD_NAMES = ("x[/y].txt", "[red]a.txt", ":smile:.txt")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    with local_cluster(tmp_path_factory.mktemp("ctl-input"), servers=1, admin_token=ADMIN, read_token=READ,
                       extra_args=("--no-fsync",)) as c:
        yield c


def paramctl(cluster: LocalCluster, *args: str, umask: int | None = None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PARAMS_")}
    env.update(PARAMS_CLUSTER=cluster.seed, PARAMS_ADMIN_TOKEN=ADMIN)

    def set_umask() -> None:
        if umask is not None:
            os.umask(umask)

    return subprocess.run([sys.executable, "-m", "paramserver.client.ctl", *args], env=env, capture_output=True, text=True,
                          timeout=120, preexec_fn=set_umask)


def one_line_error(result: subprocess.CompletedProcess[str]) -> str:
    assert "Traceback" not in result.stderr, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("paramctl: error: "), result.stderr
    return lines[0]


@pytest.fixture(scope="module")
def folder_model(cluster: LocalCluster, tmp_path_factory: pytest.TempPathFactory) -> str:
    folder = tmp_path_factory.mktemp("odd-names") / "model"
    folder.mkdir()
    save_file({"w": torch.arange(12, dtype=torch.float32).reshape(3, 4)}, str(folder / "model.safetensors"))
    for name in ODD_NAMES:  # "x[/y].txt" is y].txt in a folder x[
        (folder / name).parent.mkdir(exist_ok=True)
        (folder / name).write_text(name)
    pushed = paramctl(cluster, "push", str(folder), "--model", "odd", "--tag", "prod")
    assert pushed.returncode == 0, pushed.stderr
    # a folder's file chunks count in the total as in the distinct ones (it said "chunks 1 (4 distinct)")
    total, distinct = map(int, re.search(r"chunks (\d+) \((\d+) distinct\)", pushed.stdout).groups())  # type: ignore[union-attr]
    assert total == distinct == 1 + len(ODD_NAMES), pushed.stdout
    return "odd"


def test_file_names_are_printed_as_text_not_markup(cluster: LocalCluster, folder_model: str) -> None:
    listed = paramctl(cluster, "ls", f"{folder_model}:prod")
    assert listed.returncode == 0 and "Traceback" not in listed.stderr, listed.stderr
    for name in ODD_NAMES:
        assert name in listed.stdout, (name, listed.stdout)


def test_a_model_reference_is_not_turned_into_emoji(cluster: LocalCluster, tmp_path: Path) -> None:
    line = one_line_error(paramctl(cluster, "pull", "m1:a:b", "--out", str(tmp_path / "q.safetensors")))
    assert "m1:a:b" in line, line


@pytest.mark.parametrize("ref", ["nope", "@99"])
def test_ls_of_an_unknown_tag_or_version_prints_no_tables(cluster: LocalCluster, folder_model: str, ref: str) -> None:
    full = f"{folder_model}{ref if ref.startswith('@') else ':' + ref}"
    result = paramctl(cluster, "ls", full)
    assert result.returncode == 3 and result.stdout == "", result.stdout
    assert ("no tag 'nope'" if ref == "nope" else "no version 99") in one_line_error(result)


def test_a_local_path_that_cannot_be_written_is_one_line_exit_2(cluster: LocalCluster, folder_model: str,
                                                                tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    for args in (("--out-dir", str(blocker / "sub" / "model")), ("--out", str(blocker / "m.safetensors"))):
        result = paramctl(cluster, "pull", f"{folder_model}:prod", *args)
        assert result.returncode == 2, result.stderr
        assert str(blocker) in one_line_error(result)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file"]


def test_pulled_files_follow_the_umask(cluster: LocalCluster, folder_model: str, tmp_path: Path) -> None:
    single = tmp_path / "one.safetensors"
    assert paramctl(cluster, "pull", f"{folder_model}:prod", "--out", str(single), umask=0o022).returncode == 0
    assert stat.S_IMODE(single.stat().st_mode) == 0o644
    folder = tmp_path / "folder"
    assert paramctl(cluster, "pull", f"{folder_model}:prod", "--out-dir", str(folder), umask=0o027).returncode == 0
    assert stat.S_IMODE(folder.stat().st_mode) == 0o750
    assert stat.S_IMODE((folder / "model.safetensors").stat().st_mode) == 0o640


def test_untag_latest_says_it_is_unpinned_not_deleted(cluster: LocalCluster, folder_model: str) -> None:
    assert paramctl(cluster, "tag", folder_model, "latest", "1").returncode == 0
    result = paramctl(cluster, "untag", folder_model, "latest")
    assert result.returncode == 0 and "unpinned" in result.stdout and "deleted" not in result.stdout, result.stdout
    assert "latest=v1" in paramctl(cluster, "ls").stdout  # still there, following the newest version


def test_an_interrupted_push_does_not_claim_nothing_was_committed(monkeypatch: pytest.MonkeyPatch,
                                                                  capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """The commit can land just before the interrupt: the message must not say it did not."""
    weights = tmp_path / "m.safetensors"
    save_file({"w": torch.zeros(2)}, str(weights))

    def interrupted(*_args: object) -> int:
        raise KeyboardInterrupt

    monkeypatch.setitem(ctl.COMMANDS, "push", interrupted)
    monkeypatch.setitem(ctl.COMMANDS, "pull", interrupted)
    monkeypatch.setenv("PARAMS_CLUSTER", "127.0.0.1:1")
    assert ctl.main(["push", str(weights), "--model", "m"]) == 130
    err = capsys.readouterr().err
    assert "if the push reached its commit" in err and "paramctl ls m" in err and "nothing was committed" not in err
    assert ctl.main(["pull", "m:prod", "--out", str(tmp_path / "o.safetensors")]) == 130
    assert "nothing was written" in capsys.readouterr().err


def test_status_without_a_reachable_leader_says_so_and_exits_6(tmp_path: Path) -> None:
    """With two of three servers down, the survivor still names the last leader it knew: status
    showed it in the header, exit 0, while that server's own row said unavailable."""
    with local_cluster(tmp_path, servers=3, admin_token=ADMIN, read_token=READ, extra_args=("--no-fsync",)) as c:
        healthy = paramctl(c, "status")
        assert healthy.returncode == 0 and "(none reachable" not in healthy.stdout, healthy.stderr
        leader = c.leader_id()
        survivor = next(s.server_id for s in c.slots if s.server_id != leader)
        for slot in c.slots:
            if slot.server_id != survivor:
                c.kill(slot.server_id)
        seed = next(s.grpc for s in c.slots if s.server_id == survivor)
        # Once the survivor sees its link to the dead leader drop, it names none (pysyncobj kept
        # naming it for good); until then status says the named leader is not reachable.
        deadline = time.monotonic() + 30
        result = paramctl(c, "--cluster", seed, "status")
        while "leader (none: no member names one" not in result.stdout and time.monotonic() < deadline:
            assert result.returncode == 6 and "(none reachable" in result.stdout, (result.stdout, result.stderr)
            time.sleep(0.5)
            result = paramctl(c, "--cluster", seed, "status")
        assert result.returncode == 6, (result.stdout, result.stderr)
        assert "leader (none: no member names one" in result.stdout, result.stdout
        assert "no reachable server is the Raft leader (1 of 3 members answer)" in one_line_error(result)
        # A push with the quorum lost is not silent while it waits for an election, and ends saying why.
        weights = tmp_path / "w.safetensors"
        save_file({"w": torch.arange(10, dtype=torch.float32)}, str(weights))
        pushed = paramctl(c, "--cluster", seed, "--timeout", "2", "push", str(weights), "--model", "m")
        assert pushed.returncode == 6, (pushed.stdout, pushed.stderr)
        notice, error = pushed.stderr.strip().splitlines()
        assert notice.startswith("paramctl: no leader answers yet; 1 of 3 members answer") and survivor in notice
        assert "no cluster member named a leader within 6.0s; 1 of 3 members answer" in error
        assert "majority of the members up" in error and "Traceback" not in pushed.stderr
        tagged = paramctl(c, "--cluster", seed, "--timeout", "2", "tag", "m", "canary", "1")  # tag, rollback, untag alike
        assert tagged.returncode == 6, (tagged.stdout, tagged.stderr)
        assert "no leader answers yet" in tagged.stderr and "no cluster member named a leader within 6.0s" in tagged.stderr


@pytest.mark.parametrize(("tensors", "why"), [
    ({"z": torch.zeros(3, dtype=torch.complex128), "w": torch.ones(2)}, "safetensors has no dtype for complex128"),
    ({"__metadata__": torch.ones(5), "x": torch.ones(2)}, "a tensor is named __metadata__"),
])  # fmt: skip
def test_a_version_safetensors_cannot_hold_is_refused_before_anything_is_written(
        cluster: LocalCluster, tmp_path: Path, tensors: dict[str, torch.Tensor], why: str) -> None:
    """A complex128 tensor was 'check the path and its permissions'; a tensor named __metadata__ was
    written into the header's metadata slot, a file nothing could read, with exit 0."""
    weights = tmp_path / "w.pt"
    torch.save(tensors, weights)
    model = "odd-dtype" if "z" in tensors else "meta-name"
    assert paramctl(cluster, "push", str(weights), "--model", model).returncode == 0
    out = tmp_path / "out"
    out.mkdir()
    for args in (("--out", str(out / "m.safetensors")), ("--out-dir", str(out / "folder"))):
        result = paramctl(cluster, "pull", model, *args)
        assert result.returncode == 2, (result.stdout, result.stderr)
        line = one_line_error(result)
        assert why in line and "as .safetensors" in line and "paramworker load" in line and "permissions" not in line
    assert list(out.iterdir()) == []


def test_a_pulled_folder_keeps_each_shards_metadata(cluster: LocalCluster, tmp_path: Path) -> None:
    """Every shard came back with {"format": "pt"} and provenance only: a PEFT marker, a custom key
    or another format the shard held was dropped."""
    from safetensors import safe_open

    folder = tmp_path / "meta-folder"
    folder.mkdir()
    # "model" and "version" as a pull of another model wrote them: this pull's provenance wins.
    stale = {"peft": "yes", "format": "tf", "model": "elsewhere", "version": "9"}
    save_file({"a": torch.ones(3)}, str(folder / "a.safetensors"), metadata=stale)
    save_file({"b": torch.zeros(2)}, str(folder / "b.safetensors"))
    assert paramctl(cluster, "push", str(folder), "--model", "meta-folder").returncode == 0
    out = tmp_path / "pulled"
    pulled = paramctl(cluster, "pull", "meta-folder", "--out-dir", str(out))
    assert pulled.returncode == 0, pulled.stderr
    with safe_open(str(out / "a.safetensors"), "pt") as a, safe_open(str(out / "b.safetensors"), "pt") as b:
        first, second = a.metadata(), b.metadata()
    assert first["peft"] == "yes" and first["format"] == "tf" and first["model"] == "meta-folder", first
    assert first["version"] == "1" and first["manifest_id"] == second["manifest_id"], first
    assert second["format"] == "pt" and second["version"] == "1", second
