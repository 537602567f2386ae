from __future__ import annotations

import threading

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from worker.errors import HeatmapMismatch
from worker.heatmap import HeatmapRecorder, HeatReport, _build, merge, prefetch_order


def report_of(accesses: list[int], model: str = "m", version: int = 1) -> HeatReport:
    rec = HeatmapRecorder(model, version)
    for i in accesses:
        rec.record(i)
    return rec.snapshot()


def test_snapshot_counts_and_first_access_order() -> None:
    r = report_of([5, 3, 5, 9, 3, 5])
    assert r.indices == (5, 3, 9)
    assert (r.count(5), r.count(3), r.count(9), r.count(42)) == (3, 2, 1, 0)
    assert r.sources == 1


def test_json_roundtrip_is_exact_and_compact() -> None:
    r = report_of([2, 1, 2, 0])
    text = r.to_json()
    assert HeatReport.from_json(text) == r
    assert " " not in text
    with pytest.raises(HeatmapMismatch, match="format"):
        HeatReport.from_dict({**r.to_dict(), "format": 99})


def test_merge_orders_by_mean_first_access_rank() -> None:
    a = report_of([1, 2, 3])
    b = report_of([2, 1, 3, 4])
    c = report_of([2, 3, 1])
    m = merge([a, b, c])
    assert m.indices[0] == 2  # ranks 1, 0, 0
    assert m.count(1) == 3 and m.count(4) == 1
    assert m.sources == 3


def test_merge_refuses_mixed_versions() -> None:
    with pytest.raises(HeatmapMismatch, match="per model version"):
        merge([report_of([1]), report_of([1], version=2)])


traces = st.lists(st.lists(st.integers(0, 20), max_size=30), min_size=1, max_size=6)


@settings(max_examples=80, deadline=None)
@given(traces=traces, data=st.data())
def test_merge_is_deterministic_commutative_and_associative(traces: list[list[int]], data: st.DataObject) -> None:
    reports = [report_of(t) for t in traces]
    shuffled = data.draw(st.permutations(reports))
    assert merge(reports) == merge(shuffled)
    cut = data.draw(st.integers(1, len(reports)))
    if cut < len(reports):
        assert merge([merge(reports[:cut]), merge(reports[cut:])]) == merge(reports)


def test_prefetch_order_hot_first_then_manifest_order() -> None:
    r = report_of([7, 2, 7, 7, 5, 2, 99])  # 99 is not in this manifest
    all_indices = range(10)
    assert prefetch_order(r, all_indices) == [7, 2, 5, 0, 1, 3, 4, 6, 8, 9]
    assert prefetch_order(r, all_indices, by="count") == [7, 2, 5, 0, 1, 3, 4, 6, 8, 9]
    assert prefetch_order(report_of([1, 2, 2, 2]), range(4), by="count") == [2, 1, 0, 3]
    assert prefetch_order(None, [3, 1, 2]) == [3, 1, 2]
    order = prefetch_order(r, all_indices)
    assert sorted(order) == list(all_indices)


def test_record_is_thread_safe() -> None:
    rec = HeatmapRecorder("m", 1)

    def work() -> None:
        for i in range(5000):
            rec.record(i % 100)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    r = rec.snapshot()
    assert sum(r.counts) == 20000 and len(r.indices) == 100


def test_wire_entries_roundtrip() -> None:
    r = report_of([4, 1, 4, 2])
    assert r.entries() == [(4, 2, 0), (1, 1, 1), (2, 1, 2)]
    back = HeatReport.from_entries("m", 1, [(2, 1, 2), (4, 2, 0), (1, 1, 1)], sources=3)
    assert back.indices == (4, 1, 2) and back.count(4) == 2 and back.sources == 3
    assert prefetch_order(back, range(5)) == [4, 1, 2, 0, 3]


def test_prefetch_order_of_a_whole_range_matches_the_general_rule() -> None:
    # The array path (a range of rows) and the general one give the same order: report rows
    # first, repeats and rows outside the range as the general rule treats them, then the rest.
    # As report_of([7, 2, 5, 2, 40, -1]) would be: a report from the wire may name any index,
    # though a recorder only records a manifest's rows.
    r = _build("m", 1, 1, {7: (1, 0, 1), 2: (2, 1, 1), 5: (1, 2, 1), 40: (1, 3, 1), -1: (1, 4, 1)})
    for rows in (range(10), range(3, 9), range(0)):
        assert prefetch_order(r, rows) == prefetch_order(r, list(rows))


@given(st.lists(st.tuples(st.integers(0, 300), st.integers(0, 5), st.integers(0, 50)), max_size=60))
def test_from_entries_orders_rows_as_the_general_build_does(entries: list[tuple[int, int, int]]) -> None:
    # The array path (one lexsort) and the general one (a sort with a key per row) agree,
    # ties and an index sent twice included.
    fast = HeatReport.from_entries("m", 1, entries)
    slow = _build("m", 1, 1, {i: (c, r, 1) for i, c, r in entries})
    assert fast == slow


def test_snapshot_is_first_access_order_with_counts() -> None:
    rec = HeatmapRecorder("m", 2)
    rec.record_many([5, 3, 5, 9])
    rec.record(3)
    snap = rec.snapshot()
    assert snap == _build("m", 2, 1, {5: (2, 0, 1), 3: (2, 1, 1), 9: (1, 2, 1)})
    assert snap.indices == (5, 3, 9) and snap.counts == (2, 2, 1) and snap.entries() == [(5, 2, 0), (3, 2, 1), (9, 1, 2)]


def test_rank_as_ranks_first_accesses_by_the_given_order_not_by_arrival() -> None:
    rec = HeatmapRecorder("m", 1)
    rec.rank_as(np.array([2, 0, 1, 0]))  # index 1 and 3 tie: the lower index first
    rec.record_many([0, 3])
    rec.record_many([2, 1, 0])
    snap = rec.snapshot()
    assert snap.indices == (1, 3, 2, 0) and snap.counts == (1, 1, 1, 2)
    rec.record(7)  # past the ranked rows: ranked by arrival, after them
    assert rec.snapshot().indices[-1] == 7


def test_rows_past_rank_as_come_after_every_ranked_row_even_in_one_batch() -> None:
    rec = HeatmapRecorder("m", 1)
    rec.rank_as(np.array([2, 0, 1]))
    rec.record_many([0, 7])  # one batch: 0 ranked (2), 7 past the ranks
    rec.record(5)
    rec.record_many([1, 2])
    assert rec.snapshot().indices == (1, 2, 0, 7, 5)
    with pytest.raises(ValueError):
        rec.rank_as(np.array([-1, 0]))  # -1 means "not read": never a rank


def test_wire_entries_are_the_snapshots_entries_as_arrays() -> None:
    rec = HeatmapRecorder("m", 1)
    rec.record_many([5, 3, 5, 9])
    rec.record(3)
    arrays = rec.wire_entries()
    assert list(arrays) == rec.snapshot().entries() == [(5, 2, 0), (3, 2, 1), (9, 1, 2)]
    assert list(rec.wire_entries(reset=True)) == list(arrays)
    assert len(rec.wire_entries()) == 0  # a new period
