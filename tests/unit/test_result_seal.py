"""L2 result-cache entries are authenticated (issue 41): the seal, the request path over an
in-memory L2 that holds forged values, and the serve flags that give the key and the password."""
from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

from worker.admission import Admission, AdmissionConfig
from worker.cli import build_parser, serve_config_from_args
from worker.errors import ConfigError
from worker.result_cache import CachedResult, EntrySeal, ResultCacheConfig
from worker.result_service import Computed, ResultService
from worker.result_store import MemoryResultStore
from worker.serve_metrics import ServeMetrics

KEY = b"0123456789abcdef0123456789abcdef"
NOW = 1_000_000.0


def entry(body: bytes = b'{"output":"real"}') -> bytes:
    return CachedResult(200, body, 0.01, NOW + 300).encode()


def test_a_sealed_entry_opens_only_under_its_key_with_its_bytes() -> None:
    seal = EntrySeal(KEY)
    sealed = seal.seal("k1", entry())
    assert seal.open("k1", sealed) == entry()
    assert seal.open("k2", sealed) is None  # moved to another request's key
    assert EntrySeal(b"x" * 32).open("k1", sealed) is None  # another deployment's key
    assert seal.open("k1", sealed[:-1] + b"X") is None  # the value altered
    assert seal.open("k1", entry()) is None  # an unsealed entry (a forgery, or from before sealing)
    assert seal.open("k1", b"") is None and seal.open("k1", sealed[:20]) is None
    assert "0123" not in repr(seal) and "0123" not in repr(ResultCacheConfig(l2_key=KEY))
    with pytest.raises(ConfigError):
        EntrySeal(b"short")


def service(store: MemoryResultStore, metrics: ServeMetrics) -> ResultService:
    cfg = ResultCacheConfig(l1_bytes=0, redis_url="redis://unused", l2_key=KEY)
    return ResultService(cfg, Admission(AdmissionConfig(max_concurrency=4)), metrics, store, clock=lambda: NOW)


def test_a_forged_l2_entry_is_a_miss_counted_logged_and_replaced(caplog: pytest.LogCaptureFixture) -> None:
    store = MemoryResultStore(lambda: NOW)
    metrics = ServeMetrics()
    svc = service(store, metrics)
    store.set("k", CachedResult(200, b'{"output":"X"}', 0.0, NOW + 300).encode(), 60_000)  # what a hostile Redis answers
    caplog.set_level(logging.WARNING, logger="worker.result_service")
    answer = svc.answer("k", lambda: Computed(200, b'{"output":"real"}'))
    assert (answer.outcome, answer.body) == ("computed", b'{"output":"real"}')
    assert metrics.l2_rejected._value.get() == 2  # each read of it: before the lease and once holding it
    assert [r for r in caplog.records if "failed its authentication" in r.getMessage()]
    # The computed entry replaced it, sealed: another worker with the same key gets it from L2.
    other = service(store, ServeMetrics())
    assert other.answer("k", lambda: Computed(500, b"{}")).outcome == "hit_l2"
    # A real entry copied under another key is refused too; the log line is not repeated within 10 s.
    raw = store.get("k")
    assert raw is not None
    store.set("k2", raw, 60_000)
    caplog.clear()
    assert other.answer("k2", lambda: Computed(200, b'{"output":"k2"}')).body == b'{"output":"k2"}'
    store.set("k3", raw, 60_000)
    assert other.answer("k3", lambda: Computed(200, b'{"output":"k3"}')).body == b'{"output":"k3"}'
    assert other.metrics.l2_rejected._value.get() == 4
    assert len([r for r in caplog.records if "failed its authentication" in r.getMessage()]) == 1
    assert b"pdparams_result_cache_l2_rejected_total 4.0" in other.metrics.render()


def test_l2_without_a_key_is_refused() -> None:
    with pytest.raises(ConfigError, match="--result-cache-key-file"):
        ResultCacheConfig(redis_url="redis://h:6379/0").validate()
    with pytest.raises(ConfigError, match="--result-cache-key-file"):
        ResultService(ResultCacheConfig(), Admission(AdmissionConfig()), ServeMetrics(), MemoryResultStore())
    with pytest.raises(ConfigError, match="fewer than 32"):
        ResultCacheConfig(redis_url="redis://h:6379/0", l2_key=b"short").validate()


def secret(path: Path, text: str, mode: int = 0o600) -> str:
    path.write_text(text)
    os.chmod(path, mode)
    return str(path)


def serve_args(*flags: str) -> list[str]:
    return ["serve", "--model", "m:prod", "--factory", "x:y", *flags]


def test_serve_flags_read_the_key_and_password_from_files(tmp_path: Path) -> None:
    parser = build_parser()
    url = ("--result-cache-redis", "rediss://127.0.0.1:6380/0")
    key = secret(tmp_path / "key", "k" * 43 + "\n")
    pw = secret(tmp_path / "pw", "hunter2-long-password\n")
    cfg = serve_config_from_args(parser.parse_args(serve_args(*url, "--result-cache-key-file", key,
                                                                "--result-cache-redis-password-file", pw)), {})
    assert cfg.result_cache.l2_key == b"k" * 43 and cfg.result_cache.redis_password == "hunter2-long-password"
    assert "hunter2" not in repr(cfg) and "kkkk" not in repr(cfg)
    env = {"PARAMS_RESULT_CACHE_KEY_FILE": key, "PARAMS_RESULT_CACHE_REDIS_PASSWORD_FILE": pw}
    assert serve_config_from_args(parser.parse_args(serve_args(*url)), env).result_cache.redis_password == "hunter2-long-password"
    assert serve_config_from_args(parser.parse_args(serve_args()), {}).result_cache.l2_key is None  # no L2: no key needed
    bad = [
        ((*url,), "needs --result-cache-key-file"),
        ((*url, "--result-cache-key-file", secret(tmp_path / "open", "k" * 43, 0o644)), "chmod 600"),
        ((*url, "--result-cache-key-file", secret(tmp_path / "empty", "\n")), "is empty"),
        ((*url, "--result-cache-key-file", secret(tmp_path / "short", "k" * 10)), "fewer than 32"),
        ((*url, "--result-cache-key-file", str(tmp_path / "missing")), "cannot read it"),
    ]
    for flags, why in bad:
        with pytest.raises(ConfigError, match=why):
            serve_config_from_args(parser.parse_args(serve_args(*flags)), {})
    with pytest.raises(ConfigError, match="give the password once"):
        serve_config_from_args(parser.parse_args(serve_args(
            "--result-cache-key-file", key, "--result-cache-redis-password-file", pw)),
            {"PARAMS_RESULT_CACHE_REDIS": "redis://:pw@h:6379/0"})
