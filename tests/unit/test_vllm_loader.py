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

from worker.vllm_loader import PINNED_KEY, LoaderOptions, PdparamsLoadError, _excepthook, check_folder, check_loaded


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
    def __init__(self, entry: Any) -> None:
        self.entry = entry

    def manifest(self, manifest_id: str) -> Any:
        return SimpleNamespace(file=lambda path: self.entry if path == "config.json" else None)


def test_the_folder_must_hold_the_versions_config(tmp_path: Path) -> None:
    info = SimpleNamespace(model="llama", number=4, manifest_id="abc")
    (tmp_path / "config.json").write_bytes(b'{"a": 1}')
    right = SimpleNamespace(blake3=blake3.blake3(b'{"a": 1}').hexdigest())
    check_folder(FakeClient(right), info, str(tmp_path))  # type: ignore[arg-type]
    check_folder(FakeClient(None), info, str(tmp_path))  # type: ignore[arg-type]  # pushed from a weights file: nothing to compare
    wrong = SimpleNamespace(blake3=blake3.blake3(b'{"a": 2}').hexdigest())
    with pytest.raises(PdparamsLoadError, match=r"is not the config.json of llama v4 .* paramctl pull llama@4 --out-dir"):
        check_folder(FakeClient(wrong), info, str(tmp_path))  # type: ignore[arg-type]


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
