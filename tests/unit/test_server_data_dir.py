"""paramserver.server.data_dir: one process per data dir, one cluster per Raft journal."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from paramserver.server.data_dir import IDENTITY_FILE, DataDirInUse, ForeignDataDir, check_identity, lock_data_dir, record_identity


def test_a_second_holder_is_refused_naming_the_first_and_the_lock_ends_with_it(tmp_path: Path) -> None:
    fd = lock_data_dir(tmp_path / "d")
    try:
        with pytest.raises(DataDirInUse, match=rf"in use by another paramserver \(pid {os.getpid()}\)"):
            lock_data_dir(tmp_path / "d")
        # another process too (flock, not a pid check)
        probe = subprocess.run([sys.executable, "-c", "import sys; from pathlib import Path; "
                                "from paramserver.server.data_dir import lock_data_dir; lock_data_dir(Path(sys.argv[1]))",
                                str(tmp_path / "d")], capture_output=True, text=True, timeout=60)
        assert probe.returncode != 0 and "DataDirInUse" in probe.stderr
    finally:
        os.close(fd)
    os.close(lock_data_dir(tmp_path / "d"))  # released: taken again


def test_a_journal_of_another_cluster_is_refused_and_a_joined_one_records_its_id(tmp_path: Path) -> None:
    raft = tmp_path / "d" / "raft"
    assert check_identity(raft, "b" * 32) is False  # nothing recorded yet: any id may start on it
    assert not raft.exists()  # and the check wrote nothing: a mistyped secret leaves no id behind
    record_identity(raft, "a" * 32)
    assert (raft / IDENTITY_FILE).read_text() == "a" * 32 + "\n"
    assert check_identity(raft, "a" * 32) is True  # the same cluster: fine, unchanged
    with pytest.raises(ForeignDataDir, match="belongs to another cluster") as err:
        check_identity(raft, "b" * 32)
    why = str(err.value)
    assert "rotating the cluster secret" in why and "aaaaaaaaaaaa" in why and "--vnodes it ran with" in why
    assert (raft / IDENTITY_FILE).read_text() == "a" * 32 + "\n"


def test_a_server_that_fails_to_start_frees_its_data_dir(tmp_path: Path) -> None:
    from paramserver.server.config import ServerConfig
    from paramserver.server.process import ParamServer

    data = tmp_path / "d"
    record_identity(data / "raft", "f" * 32)  # another cluster's journal: start() refuses after taking the lock
    server = ParamServer(ServerConfig(server_id="ps1", data_dir=data, listen="127.0.0.1:0", raft="127.0.0.1:0",
                                      fsync=False))
    with pytest.raises(ForeignDataDir):
        server.start()
    os.close(lock_data_dir(data))  # the failed start left no descriptor holding it


def test_a_stopped_server_closes_its_chunk_store(tmp_path: Path) -> None:
    """stop() left the store open: its segments/LOCK stayed held, and the next store on the dir in
    this process (a restarted server, a failed start's retry) opened read only."""
    from paramserver.server.config import ServerConfig
    from paramserver.server.process import ParamServer
    from paramserver.server.store import ChunkStore

    import socket

    with socket.socket() as s:  # a free port for Raft (it takes no 0)
        s.bind(("127.0.0.1", 0))
        raft_port = s.getsockname()[1]
    data = tmp_path / "d"
    server = ParamServer(ServerConfig(server_id="ps1", data_dir=data, listen="127.0.0.1:0",
                                      raft=f"127.0.0.1:{raft_port}", fsync=False))
    server.start()
    server.stop()
    again = ChunkStore(data, fsync=False)
    try:
        assert not again.read_only
    finally:
        again.close()
