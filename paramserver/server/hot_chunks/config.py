"""Hot-chunk settings (``HotConfig``, from a server config's ``hot_*`` keys)."""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from paramserver.server.errors import ConfigError
from paramserver.wire.limits import MAX_HOT_CHUNKS_ADVERTISED, MiB


_ON = {"on", "true", "yes", "1"}
_OFF = {"off", "false", "no", "0"}


@dataclass(frozen=True)
class HotConfig:
    """Hot-chunk settings (config file keys ``hot_*``; see ``from_extra``)."""

    enabled: bool = True
    interval_s: float = 1.0  # how often the hot set is recomputed and extras pushed, renewed, dropped
    tau_s: float = 10.0  # time constant of the decayed read rate
    hot_rate: float = 2.0  # reads/s on this server (decayed) that make a chunk hot
    cool_rate: float | None = None  # a hot chunk cools below this (default hot_rate / 4) ...
    cool_s: float = 30.0  # ... held for this long
    extra_copies: int = 2  # extra holders per hot chunk, beyond its R replicas (capped by the cluster)
    max_hot_chunks: int = 1024  # hot chunks this server places extras for
    max_hot_bytes: int = 256 * MiB
    max_extra_chunks: int = 1024  # extra copies this server holds for the others
    max_extra_bytes: int = 256 * MiB
    lease_s: float = 30.0  # an extra copy no replica renewed for this long is dropped
    max_tracked: int = 65536  # chunks whose read rate is tracked
    push_bytes_per_step: int = 64 * MiB  # extra-copy bytes one step sends at most

    @property
    def cool(self) -> float:
        return self.hot_rate / 4 if self.cool_rate is None else self.cool_rate

    def validate(self) -> HotConfig:
        for name in ("interval_s", "tau_s", "hot_rate", "cool_s", "lease_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"hot_{name} must be > 0, got {getattr(self, name)!r}")
        if not 0 < self.cool <= self.hot_rate:
            raise ConfigError(f"hot_cool_rate must be > 0 and at most hot_rate ({self.hot_rate}), got {self.cool}")
        if not 1 <= self.extra_copies <= 16:
            raise ConfigError(f"hot_extra_copies must be between 1 and 16, got {self.extra_copies}")
        if not 1 <= self.max_hot_chunks <= MAX_HOT_CHUNKS_ADVERTISED:
            raise ConfigError(f"hot_max_chunks must be between 1 and {MAX_HOT_CHUNKS_ADVERTISED}, got {self.max_hot_chunks}")
        for name in ("max_hot_bytes", "max_extra_bytes", "push_bytes_per_step"):
            if getattr(self, name) < MiB:
                raise ConfigError(f"hot_{name} must be at least 1 MiB, got {getattr(self, name)}")
        if self.max_extra_chunks < 1 or self.max_tracked < 16:
            raise ConfigError("hot_max_extra_chunks must be >= 1 and hot_max_tracked >= 16")
        if self.lease_s <= self.interval_s:
            raise ConfigError(f"hot_lease_s ({self.lease_s}) must be longer than hot_interval_s ({self.interval_s}): "
                              "a replica renews each copy once per interval")
        return self

    @classmethod
    def from_extra(cls, extra: Mapping[str, Any]) -> HotConfig:
        """From a server config's extra keys: ``hot_chunks`` (on/off), ``hot_interval_s``, ``hot_tau_s``,
        ``hot_rate``, ``hot_cool_rate``, ``hot_cool_s``, ``hot_extra_copies``, ``hot_max_chunks``,
        ``hot_max_bytes``, ``hot_max_extra_chunks``, ``hot_max_extra_bytes``, ``hot_lease_s``,
        ``hot_max_tracked``, ``hot_push_bytes_per_step``."""
        values: dict[str, Any] = {}
        switch = extra.get("hot_chunks")
        if switch is not None:
            text = str(switch).lower()
            if isinstance(switch, bool):
                values["enabled"] = switch
            elif text in _ON | _OFF:
                values["enabled"] = text in _ON
            else:
                raise ConfigError(f"hot_chunks must be on or off, got {switch!r}")
        for name, key in _KEYS.items():
            value = extra.get(key)
            if value is None:
                continue
            integer = name not in _FLOATS
            if isinstance(value, bool) or not isinstance(value, int | float) or (integer and not isinstance(value, int)):
                raise ConfigError(f"{key} must be {'an integer' if integer else 'a number'}, got {value!r}")
            values[name] = value if integer else float(value)
        return cls(**values).validate()


_FLOATS = ("interval_s", "tau_s", "hot_rate", "cool_rate", "cool_s", "lease_s")
_KEYS = {  # HotConfig field -> config file key
    "interval_s": "hot_interval_s", "tau_s": "hot_tau_s", "hot_rate": "hot_rate", "cool_rate": "hot_cool_rate",
    "cool_s": "hot_cool_s", "lease_s": "hot_lease_s", "extra_copies": "hot_extra_copies", "max_hot_chunks": "hot_max_chunks",
    "max_hot_bytes": "hot_max_bytes", "max_extra_chunks": "hot_max_extra_chunks", "max_extra_bytes": "hot_max_extra_bytes",
    "max_tracked": "hot_max_tracked", "push_bytes_per_step": "hot_push_bytes_per_step",
}
CONFIG_KEYS = ("hot_chunks", *_KEYS.values())  # a server config's keys for hot chunks
