from __future__ import annotations

import pytest

from chunking import ChunkingConfig, InvalidInput


def test_defaults_are_valid() -> None:
    cfg = ChunkingConfig()
    cfg.validate()
    assert (cfg.chunk_size, cfg.codec, cfg.hash_algorithm) == (262144, "off", "blake3")


@pytest.mark.parametrize("size", [4096, 1 << 16, 1 << 26])
def test_power_of_two_sizes_in_range_are_accepted(size: int) -> None:
    ChunkingConfig(chunk_size=size).validate()


@pytest.mark.parametrize(
    "kwargs",
    [
        {"chunk_size": 2048},
        {"chunk_size": 1 << 27},
        {"chunk_size": 300000},
        {"codec": "lz4"},
        {"zstd_level": 99},
        {"hash_algorithm": "md5"},
        {"auto_min_saving": 1.5},
    ],
)
def test_bad_settings_are_refused_with_advice(kwargs: dict) -> None:
    with pytest.raises(InvalidInput) as info:
        ChunkingConfig(**kwargs).validate()
    assert "use" in str(info.value) or "must" in str(info.value)
