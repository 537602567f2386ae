"""The benchmarks' round orders: every method in every position and after every other one equally often."""
from __future__ import annotations

from collections import Counter

import pytest

from bench.measure import balanced_orders


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 6])
def test_balanced_orders_cover_positions_and_neighbours_evenly(n: int) -> None:
    kinds = [f"m{i}" for i in range(n)]
    full = 2 * n if n % 2 else n
    rows = balanced_orders(kinds, full)
    assert all(sorted(r) == sorted(kinds) for r in rows)
    positions = Counter((k, i) for r in rows for i, k in enumerate(r))
    assert set(positions.values()) == {full // n}
    if n > 1:
        after = Counter((r[i], r[i + 1]) for r in rows for i in range(n - 1))
        assert len(after) == n * (n - 1)  # every ordered pair of neighbours occurs
        assert len(set(after.values())) == 1  # and equally often


def test_balanced_orders_repeat_past_one_design_and_allow_fewer_rounds() -> None:
    rows = balanced_orders(["a", "b", "c", "d"], 9)
    assert len(rows) == 9 and rows[4] == rows[0] and rows[8] == rows[0]
    assert balanced_orders(["a", "b"], 1) == [["a", "b"]]
    assert balanced_orders([], 2) == [[], []]
