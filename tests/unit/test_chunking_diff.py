"""A fine-tune shares the chunks of every tensor it did not change."""
from __future__ import annotations

import torch

from chunking import ChunkingConfig, diff, pack
from chunking.synthetic import finetune, synthetic_state_dict


def test_finetune_of_ten_percent_shares_the_other_ninety() -> None:
    cfg = ChunkingConfig(chunk_size=1 << 16)
    base = synthetic_state_dict(8 << 20, seed=0, tensor_bytes=256 << 10)
    tuned = finetune(base, fraction=0.1, seed=1)
    changed = {k for k in base if tuned[k] is not base[k]}
    floats = [k for k in base if base[k].is_floating_point()]
    assert len(changed) == round(0.1 * len(floats))
    old = pack(base, model="m", version=1, config=cfg).manifest
    new = pack(tuned, model="m", version=2, config=cfg, previous=old).manifest
    d = diff(old, new)
    added = set(d.added)
    for ref in new.chunks:
        feeds_changed = bool(set(new.tensors_of_chunk(ref.index)) & changed)
        assert (ref.id in added) == feeds_changed, new.tensors_of_chunk(ref.index)
        assert ref.introduced_in == (2 if feeds_changed else 1)
    changed_bytes = sum(tuned[k].nbytes for k in changed)
    assert changed_bytes <= d.added_bytes <= changed_bytes + 4 * cfg.chunk_size * len(changed)
    total = sum(v.nbytes for v in tuned.values())
    assert d.shared_fraction > 0.85
    assert abs(d.shared_fraction - (1 - changed_bytes / total)) < 0.02
    assert set(d.removed) and not set(d.removed) & set(new.chunk_ids())


def test_diff_against_nothing_adds_everything() -> None:
    m = pack({"a": torch.ones(10), "b": torch.zeros(10)}, model="m").manifest
    d = diff(None, m)
    assert d.added == tuple(dict.fromkeys(m.chunk_ids())) and d.shared == () and d.added_bytes == m.raw_bytes
    assert diff(m, m).added == () and diff(m, m).shared_fraction == 1.0
