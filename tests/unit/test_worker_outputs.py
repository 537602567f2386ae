"""worker.outputs.json_values: a model's output as JSON values, exact where JSON can be."""
from __future__ import annotations

import json

import torch

from worker.outputs import json_values


def test_integers_and_float64_survive_exactly() -> None:
    """int64 above 2**24 came back rounded through float32 (67554287325366 -> 67554286501888.0)."""
    big = torch.tensor([67554287325366, -(2**62), 2**24 + 1], dtype=torch.int64)
    assert json_values(big) == [67554287325366, -(2**62), 2**24 + 1]
    assert json.loads(json.dumps(json_values(big))) == big.tolist()
    f64 = torch.tensor([0.1, 1 / 3], dtype=torch.float64)
    assert json_values(f64) == [0.1, 1 / 3]
    assert json_values(torch.tensor([True, False])) == [True, False]
    assert json_values(torch.tensor(7, dtype=torch.uint8)) == 7  # 0-d: a number


def test_narrow_floats_widen_exactly_and_complex_becomes_pairs() -> None:
    for dtype in (torch.float16, torch.bfloat16, torch.float8_e4m3fn):
        t = torch.tensor([0.5, -1.5, 3.0]).to(dtype)
        assert json_values(t) == t.float().tolist()
    z = torch.tensor([1 + 2j, -3j], dtype=torch.complex64).conj()
    assert json_values(z) == [[1.0, -2.0], [-0.0, 3.0]]
    assert json_values(torch.empty(0, 3)) == []
