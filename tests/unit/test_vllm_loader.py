"""worker.vllm_loader without vLLM: the options, the folder check, the weights check, the one-line
errors. (The loader inside a real vLLM engine: tests/integration/test_vllm.py.)"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import blake3
import pytest
import torch

from worker.vllm_loader import (
    PINNED_KEY,
    LoaderOptions,
    PdparamsLoadError,
    _excepthook,
    check_folder,
    check_loaded,
    check_local,
    preflight,
)


def test_options_defaults_and_values() -> None:
    o = LoaderOptions.from_extra({"ref": " llama:prod ", "cluster": "a:1, b:2", "cache_mb": 0, "disk_cache": "/c",
                                  "disk_cache_mb": 100, "peers": False, "verify": "content"})
    assert (o.ref, o.cluster, o.cache_mb, o.disk_cache, o.disk_cache_mb, o.peers, o.verify) == (
        "llama:prod", ("a:1", "b:2"), 0, "/c", 100, False, "content")
    assert o.load_ref == "llama:prod"
    cache = o.cache_config()
    assert cache is not None and cache.memory_bytes == 0 and cache.disk_bytes == 100 << 20 and not cache.disk_fsync
    pinned = LoaderOptions.from_extra({"ref": "llama:prod", PINNED_KEY: "llama@7"})
    assert pinned.load_ref == "llama@7"  # every engine process loads what the configuration process resolved
    assert LoaderOptions.from_extra({"ref": "m@3"}).cache_config() is None  # no tier unless asked: the engine holds the weights
    assert LoaderOptions.from_extra({"ref": "m", "cache_mb": 512}).cache_config().memory_bytes == 512 << 20  # type: ignore[union-attr]


@pytest.mark.parametrize("extra, words", [
    (None, "must be a JSON object"),
    ({}, 'needs "ref"'),
    ({"ref": ""}, 'needs "ref"'),
    ({"ref": "a b:c"}, "is not MODEL:TAG"),
    ({"ref": "m:prod", "bogus": 1, "other": 2}, "unknown --model-loader-extra-config key(s) bogus, other"),
    ({"ref": "m:prod", "token": "secret"}, "PARAMS_READ_TOKEN"),
    ({"ref": "m:prod", "cache_mb": -1}, "cache_mb must be a whole number"),
    ({"ref": "m:prod", "cache_mb": True}, "cache_mb must be a whole number"),
    ({"ref": "m:prod", "disk_cache_mb": "big"}, "disk_cache_mb must be a whole number"),
    ({"ref": "m:prod", "peers": "yes"}, "peers must be true or false"),
    ({"ref": "m:prod", "verify": "md5"}, 'verify must be "crc" or "content"'),
    ({"ref": "m:prod", "cluster": 5}, "cluster must be"),
])
def test_bad_options_are_one_line_with_exit_2(extra: Any, words: str) -> None:
    with pytest.raises(PdparamsLoadError) as info:
        LoaderOptions.from_extra(extra)
    assert words in str(info.value) and "\n" not in str(info.value)
    assert str(info.value).startswith("pdparams: ") and info.value.exit_code == 2


class FakeClient:
    def __init__(self, files: dict[str, bytes], token: str | None = "read-token") -> None:
        self.files = files
        self.options = SimpleNamespace(token=token)

    def manifest(self, manifest_id: str) -> Any:
        entries = [SimpleNamespace(path=p, blake3=blake3.blake3(b).hexdigest()) for p, b in self.files.items()]
        return SimpleNamespace(files=entries)


def test_the_folder_must_hold_the_versions_own_files(tmp_path: Path) -> None:
    info = SimpleNamespace(model="llama", number=4, manifest_id="abc")
    (tmp_path / "config.json").write_bytes(b'{"a": 1}')
    (tmp_path / "tok").mkdir()
    (tmp_path / "tok" / "tokenizer.json").write_bytes(b"t1")
    version = {"config.json": b'{"a": 1}', "tok/tokenizer.json": b"t1", "generation_config.json": b"{}"}
    check_folder(FakeClient(version), info, str(tmp_path))  # type: ignore[arg-type]  # a file the folder lacks is fine
    check_folder(FakeClient({}), info, str(tmp_path))  # type: ignore[arg-type]  # pushed from a weights file
    check_folder(FakeClient(version), info, "org/hf-repo-id")  # type: ignore[arg-type]  # not a local folder
    with pytest.raises(PdparamsLoadError, match=r"config.json of llama v4 .* paramctl pull llama@4 --out-dir"):
        check_folder(FakeClient({**version, "config.json": b'{"a": 2}'}), info, str(tmp_path))  # type: ignore[arg-type]
    # A fine-tune that kept config.json but changed its tokenizer: refused as well.
    with pytest.raises(PdparamsLoadError, match=r"tok/tokenizer.json of llama v4"):
        check_folder(FakeClient({**version, "tok/tokenizer.json": b"t2"}), info, str(tmp_path))  # type: ignore[arg-type]


def test_what_an_engine_process_would_trip_on_is_checked_first(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for key in ("PARAMS_PEERS", "PARAMS_PEER_LISTEN", "PARAMS_PEER_ADVERTISE"):
        monkeypatch.delenv(key, raising=False)
    client: Any = FakeClient({})
    check_local(LoaderOptions.from_extra({"ref": "m:p", "disk_cache": str(tmp_path / "d")}), client)
    assert (tmp_path / "d").is_dir()
    (tmp_path / "file").write_text("x")
    with pytest.raises(PdparamsLoadError, match="disk_cache .*cannot create it"):
        check_local(LoaderOptions.from_extra({"ref": "m:p", "disk_cache": str(tmp_path / "file" / "d")}), client)
    monkeypatch.setenv("PARAMS_PEERS", "maybe")
    with pytest.raises(PdparamsLoadError, match="PARAMS_PEERS"):
        check_local(LoaderOptions.from_extra({"ref": "m:p"}), client)
    check_local(LoaderOptions.from_extra({"ref": "m:p", "peers": False}), client)  # peers off: not read
    monkeypatch.setenv("PARAMS_PEERS", "on")
    monkeypatch.setenv("PARAMS_PEER_LISTEN", "0.0.0.0:0")
    with pytest.raises(PdparamsLoadError, match="PARAMS_PEER_ADVERTISE"):  # a wildcard bind needs an address to advertise
        check_local(LoaderOptions.from_extra({"ref": "m:p"}), client)
    monkeypatch.setenv("PARAMS_PEER_ADVERTISE", "10.0.0.5:0")
    check_local(LoaderOptions.from_extra({"ref": "m:p"}), client)  # with the read token: fine
    with pytest.raises(PdparamsLoadError, match="read token"):  # off loopback without one: no open port
        check_local(LoaderOptions.from_extra({"ref": "m:p"}), FakeClient({}, token=None))  # type: ignore[arg-type]


def test_several_nodes_take_only_an_exact_version() -> None:
    with pytest.raises(PdparamsLoadError, match=r"spans 2 nodes .* \(MODEL@N"):
        preflight({"ref": "llama:prod"}, None, nodes=2)


def test_every_parameter_must_come_from_the_checkpoint() -> None:
    model = torch.nn.Linear(2, 2)
    check_loaded(model, {"weight", "bias"}, quantized=False)
    check_loaded(model, None, quantized=False)  # the model does not say what it loaded: nothing to check
    check_loaded(model, {"weight"}, quantized=True)  # quantized: scales may be made, not loaded (vLLM's rule)
    with pytest.raises(PdparamsLoadError, match="1 parameter.*bias"):
        check_loaded(model, {"weight"}, quantized=False)


def test_an_uncaught_load_error_is_one_line_and_its_exit_code(capsys: pytest.CaptureFixture[str]) -> None:
    seen: list[Any] = []
    hook = _excepthook(lambda *a: seen.append(a))
    with pytest.raises(SystemExit) as info:
        hook(PdparamsLoadError, PdparamsLoadError("cannot resolve m:prod: NOT_FOUND: no model", 3), None)
    assert info.value.code == 3
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "error: pdparams: cannot resolve m:prod" in err
    other = ValueError("x")
    hook(ValueError, other, None)  # anything else goes to the hook that was there
    assert seen and seen[0][1] is other


def test_importing_the_loader_does_not_import_vllm() -> None:
    code = "import sys, worker.vllm_loader; print('vllm' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "False", out.stderr
