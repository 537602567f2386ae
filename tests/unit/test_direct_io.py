"""DirectAppender: appends whose whole blocks go around the page cache leave the same bytes."""
from __future__ import annotations

import errno
import logging
import os
import random
from pathlib import Path

import pytest

from paramserver.server import direct_io
from paramserver.server.direct_io import ALIGN, DirectAppender, pwrite_all


def _batches(seed: int) -> list[list[bytes]]:
    rng = random.Random(seed)
    out = []
    for _ in range(40):
        # records of odd sizes: headers of a few dozen bytes, bodies up to 300 KiB, some empty
        out.append([rng.randbytes(rng.choice([0, 1, 77, 4096, 65_536 + 3, 300_000])) for _ in range(rng.randint(1, 9))])
    out.append([os.urandom(direct_io.STAGE_BYTES + 12_345)])  # a middle larger than the staging buffer
    return out


def _write(path: Path, appender: DirectAppender | None, batches: list[list[bytes]]) -> None:
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        off = 13  # a segment header's worth: nothing starts aligned
        pwrite_all(fd, [b"h" * off], 0)
        for bufs in batches:
            if appender is None:
                pwrite_all(fd, bufs, off)
            else:
                appender.write(fd, str(path), bufs, off)
            off += sum(map(len, bufs))
        os.fdatasync(fd)
    finally:
        os.close(fd)


def test_appends_leave_exactly_the_bytes_of_buffered_writes(tmp_path: Path) -> None:
    batches = _batches(1)
    appender = DirectAppender(True, "test")
    _write(tmp_path / "direct", appender, batches)
    _write(tmp_path / "buffered", None, batches)
    direct, buffered = (tmp_path / "direct").read_bytes(), (tmp_path / "buffered").read_bytes()
    assert len(direct) == len(buffered) and direct == buffered
    appender.close()


def test_a_file_system_without_o_direct_gets_buffered_writes_logged_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                        caplog: pytest.LogCaptureFixture) -> None:
    real_open = os.open

    def refuse_direct(path: str, flags: int, *args: int) -> int:
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args)

    monkeypatch.setattr(direct_io.os, "open", refuse_direct)
    batches = _batches(2)
    appender = DirectAppender(True, "data_dir=x")
    with caplog.at_level(logging.WARNING, logger="paramserver.server.direct_io"):
        _write(tmp_path / "direct", appender, batches)
    monkeypatch.setattr(direct_io.os, "open", real_open)
    _write(tmp_path / "buffered", None, batches)
    assert (tmp_path / "direct").read_bytes() == (tmp_path / "buffered").read_bytes()
    assert not appender.enabled
    assert len([r for r in caplog.records if "O_DIRECT" in r.getMessage()]) == 1


def test_a_refused_direct_write_is_finished_through_the_page_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = {"n": 0, "refused": 0}
    real_pwrite = os.pwrite

    def flaky(fd: int, data: memoryview, offset: int) -> int:
        calls["n"] += 1
        if len(data) == direct_io.STAGE_BYTES:  # the first piece of the batch larger than the stage
            calls["refused"] += 1
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_pwrite(fd, data, offset)

    monkeypatch.setattr(direct_io.os, "pwrite", flaky)
    batches = _batches(3)
    appender = DirectAppender(True, "test")
    _write(tmp_path / "direct", appender, batches)
    _write(tmp_path / "buffered", None, batches)
    assert (tmp_path / "direct").read_bytes() == (tmp_path / "buffered").read_bytes()
    # Refused once, in the middle of a batch: its later pieces and every later batch went buffered.
    assert calls["refused"] == 1 and calls["n"] > 1 and not appender.enabled


def test_forget_closes_the_descriptor_of_a_sealed_file(tmp_path: Path) -> None:
    path = tmp_path / "seg"
    appender = DirectAppender(True, "test")
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        appender.write(fd, str(path), [b"x" * (ALIGN * 40)], 0)
    finally:
        os.close(fd)
    if appender.enabled:  # the file system took O_DIRECT: its descriptor is open until forgotten
        assert appender._path == str(path)
    appender.forget(str(path))
    assert appender._path is None
    assert path.read_bytes() == b"x" * (ALIGN * 40)
    appender.close()


@pytest.mark.parametrize(("fsync", "setting", "direct"), [
    (True, None, True),  # auto: the bytes must reach the device before the ack anyway
    (False, None, False),  # auto: --no-fsync acks once written, not once on the device
    (False, True, True),
    (True, False, False),
])
def test_store_direct_writes_default_follows_fsync(tmp_path: Path, fsync: bool, setting: bool | None, direct: bool) -> None:
    from paramserver.server.store import ChunkStore, StoreConfig

    store = ChunkStore(tmp_path / "d", fsync=fsync, config=StoreConfig(direct_writes=setting))
    try:
        assert store.direct_writes is (direct and hasattr(os, "O_DIRECT"))
    finally:
        store.close()


def test_direct_writes_from_the_cli_and_config_keys() -> None:
    from paramserver.server.cli import _overrides, _parser
    from paramserver.server.config import ConfigError, ServerConfig
    from paramserver.server.store import StoreConfig

    def parsed(*flags: str) -> bool | None:
        args = _parser().parse_args(["serve", "--id", "a", "--data-dir", "/tmp/x", *flags])
        return StoreConfig.from_extra(ServerConfig.from_mapping({}, **_overrides(args)).extra).direct_writes

    assert parsed() is None
    assert parsed("--direct-writes", "auto") is None
    assert parsed("--direct-writes", "on") is True
    assert parsed("--direct-writes", "off") is False
    assert StoreConfig.from_extra({"store_direct_writes": "auto"}).direct_writes is None
    assert StoreConfig.from_extra({"store_direct_writes": False}).direct_writes is False
    with pytest.raises(ConfigError, match='store_direct_writes must be true, false or "auto"'):
        StoreConfig.from_extra({"store_direct_writes": "yes"})
    with pytest.raises(ConfigError, match="got 1"):
        StoreConfig.from_extra({"store_direct_writes": 1})
    with pytest.raises(SystemExit):
        _parser().parse_args(["serve", "--direct-writes", "maybe"])
