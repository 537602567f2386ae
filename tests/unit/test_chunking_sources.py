"""Weights files that cannot be used are refused with a message that says what to do, and never
with advice to load them unrestricted."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from chunking.errors import InvalidInput
from chunking.sources import load_source


class Opaque:
    """Pickled by reference to this module: loading it would import and run code."""


def test_a_pickle_with_other_objects_is_refused_without_torchs_advice(tmp_path: Path) -> None:
    path = tmp_path / "model.pt"
    torch.save({"w": torch.ones(2), "extra": Opaque()}, path)
    with pytest.raises(InvalidInput) as info:
        load_source(path)
    text = str(info.value)
    assert "trust the source" not in text and "objects other than tensors" in text and "state_dict()" in text


def test_plain_tensors_in_a_pt_file_load(tmp_path: Path) -> None:
    path = tmp_path / "model.pt"
    torch.save({"w": torch.arange(6).reshape(2, 3)}, path)
    assert torch.equal(load_source(path)["w"], torch.arange(6).reshape(2, 3))
