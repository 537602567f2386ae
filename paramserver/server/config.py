"""Server configuration: one frozen dataclass, validated, loadable from TOML or JSON.

A config file holds the same keys as the dataclass fields, either at top level
or under a ``[server]`` table; command-line flags (paramserver CLI) override it.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import stat
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from paramserver.server.errors import ConfigError
from paramserver.wire.address import host_of, split_host_port
from paramserver.wire.ring import replication_and_quorum

from paramserver.wire.auth import ADMIN_TOKEN_ENV, READ_TOKEN_ENV
from paramserver.wire.errors import ConfigError as WireConfigError
from paramserver.wire.exposure import Listener, check_listeners, is_loopback_host
from paramserver.wire.limits import DEFAULT_GET_MESSAGE_BYTES, DEFAULT_MAX_MESSAGE_BYTES, MiB


CLUSTER_SECRET_ENV = "PARAMS_CLUSTER_SECRET"
SECRET_KEYS = ("admin_token", "read_token", "cluster_secret")  # each may come from a file: "<key>_file"


def read_secret_file(key: str, path: str | Path) -> str:
    """The secret in ``path`` (surrounding whitespace stripped); ConfigError naming the file otherwise."""
    p = Path(path)
    try:
        info = p.stat()
        text = p.read_text().strip()
    except (OSError, UnicodeDecodeError) as exc:
        why = exc.strerror if isinstance(exc, OSError) else "not UTF-8 text"
        raise ConfigError(f"{key}_file {p}: cannot read it ({why})") from None
    if not text:
        raise ConfigError(f"{key}_file {p} is empty; write the {key.replace('_', ' ')} into it")
    if info.st_mode & stat.S_IRWXO:
        # A warning, not a refusal: mounted secrets (Kubernetes' default mode 0644) are often group/other readable.
        logging.getLogger("paramserver.config").warning(
            "secret file readable by other users: file=%s mode=%o; run 'chmod 600 %s'", p, stat.S_IMODE(info.st_mode), p)
    return text


def _check_hostport(name: str, value: str) -> None:
    try:
        split_host_port(value)
    except ValueError:
        raise ConfigError(f"{name} must be HOST:PORT (for example 127.0.0.1:7000), got {value!r}") from None


@dataclass(frozen=True)
class ServerConfig:
    server_id: str
    data_dir: Path
    listen: str = "127.0.0.1:7000"  # gRPC listen address
    raft: str = "127.0.0.1:7100"  # pysyncobj address of this server
    peers: tuple[str, ...] = ()  # Raft addresses of the other initial members
    advertise: str = ""  # gRPC address others use to reach us; default = listen
    zone: str = ""
    replication_factor: int = 3
    write_quorum: int | None = None  # None -> majority of the effective R
    vnodes: int = 128
    admin_token: str | None = None  # required for writes when set
    read_token: str | None = None  # required for reads when set (admin also accepted)
    cluster_secret: str | None = None  # pysyncobj password: encrypts and authenticates Raft traffic
    # Run with a non-loopback port that lacks its credential (exposure.py; each logged at WARNING on every start).
    insecure: bool = False
    tls_cert: Path | None = None
    tls_key: Path | None = None
    tls_ca: Path | None = None  # when set, clients must present a certificate signed by it
    cache_bytes: int = 256 * MiB
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    get_message_bytes: int = DEFAULT_GET_MESSAGE_BYTES
    fsync: bool = True
    scrub_bytes_per_s: int = 64 * MiB
    # While the store served reads or writes within the last scrub_quiet_s, the scrubber runs at
    # this fraction of its rate: its re-reads and hashes would take CPU from the push or load.
    scrub_busy_fraction: float = 0.125
    scrub_quiet_s: float = 2.0
    repair_interval_s: float = 5.0
    anti_entropy_interval_s: float = 10.0  # how often each server re-checks that its chunks have all R replicas
    gc_interval_s: float = 600.0  # orphan-chunk collection period; 0 disables it
    orphan_grace_s: float = 3600.0  # an unreferenced chunk is deleted only when older than this (longer than any push)
    workers: int = 16  # gRPC server thread pool
    # Plain-TCP bulk read port (paramserver/bulk.py): chunk bytes without gRPC's per-byte cost.
    # None -> the host of ``listen`` with a free port. Off when TLS is configured (it has no encryption).
    bulk_listen: str | None = None
    bulk: bool = True
    extra: Mapping[str, Any] = field(default_factory=dict)  # unknown keys from a file, for other components

    @property
    def advertise_address(self) -> str:
        return self.advertise or self.listen

    def listeners(self, metrics_port: int | None = None) -> list[Listener]:
        """Every port this server listens on, with what protects it (paramserver.wire.exposure):
        gRPC (the admin token), Raft (the cluster secret), bulk (the admin token: it takes chunk
        writes; reads also need the read token when one is set) and, with ``metrics_port``, metrics
        (the read token). The bulk port counts only while it is on."""
        grpc_fix = f"--admin-token-file FILE or ${ADMIN_TOKEN_ENV} (and --read-token-file to protect reads)"
        found = [
            Listener("the Raft port", "--raft", self.raft, "cluster secret", bool(self.cluster_secret),
                     "run code on this server (pysyncobj unpickles what it receives) and change the membership",
                     f"the same secret on every member with --cluster-secret-file FILE or ${CLUSTER_SECRET_ENV}"),
            Listener("the gRPC port", "--listen", self.listen, "admin token", bool(self.admin_token),
                     "push, commit, tag and change the membership", grpc_fix),
        ]
        if self.bulk_enabled:
            found.append(Listener("the bulk port", "--bulk-listen", self.bulk_listen_address, "admin token",
                                  bool(self.admin_token), "write chunks into this server's store and read every chunk",
                                  grpc_fix))
        if metrics_port is not None:
            found.append(Listener("the metrics port", "--metrics-port", f"{host_of(self.listen)}:{metrics_port}",
                                  "read token", bool(self.read_token),
                                  "read this server's metrics (models' activity, members, disk use)",
                                  f"--read-token-file FILE or ${READ_TOKEN_ENV} (Prometheus: authorization: "
                                  "credentials_file)"))
        return found

    def open_to_network(self, metrics_port: int | None = None) -> list[str]:
        """What this config leaves open to anyone who can reach a non-loopback port ([] when nothing)."""
        return [listener.problem() for listener in self.listeners(metrics_port) if listener.open]

    def check_exposure(self, metrics_port: int | None = None) -> list[str]:
        """Refuse an open listener (ConfigError naming its flag) unless ``insecure``; with it, the
        warning lines to log at every start (exposure.check_listeners)."""
        try:
            return check_listeners(self.listeners(metrics_port), insecure=self.insecure)
        except WireConfigError as exc:  # the wire layer's; the server's callers catch (and exit 2 on) this one
            raise ConfigError(str(exc)) from None

    @property
    def bulk_enabled(self) -> bool:
        return self.bulk and self.tls_cert is None

    @property
    def bulk_listen_address(self) -> str:
        return self.bulk_listen or f"{self.listen.rpartition(':')[0]}:0"

    def effective_write_quorum(self, cluster_size: int) -> int:
        return replication_and_quorum(self.replication_factor, self.write_quorum, cluster_size)[1]

    def validate(self) -> ServerConfig:
        if not self.server_id or not self.server_id.replace("-", "").replace("_", "").replace(".", "").isalnum():
            raise ConfigError(f"server_id must be a non-empty name of letters, digits, '-', '_' or '.', got {self.server_id!r}")
        _check_hostport("listen", self.listen)
        _check_hostport("raft", self.raft)
        for peer in self.peers:
            _check_hostport("peer", peer)
        if self.raft in self.peers:
            raise ConfigError(f"peers must not include this server's own raft address {self.raft}")
        if self.advertise:
            _check_hostport("advertise", self.advertise)
        if self.replication_factor < 1:
            raise ConfigError(f"replication_factor must be >= 1, got {self.replication_factor}")
        if self.write_quorum is not None and not 1 <= self.write_quorum <= self.replication_factor:
            raise ConfigError(
                f"write_quorum must be between 1 and replication_factor ({self.replication_factor}), got {self.write_quorum}; "
                "omit it for a majority"
            )
        if not 1 <= self.vnodes <= 4096:
            raise ConfigError(f"vnodes must be between 1 and 4096, got {self.vnodes}")
        if self.cluster_secret is not None and len(self.cluster_secret) < 16:
            raise ConfigError("cluster_secret must be at least 16 characters (for example: python -c "
                              "'import secrets; print(secrets.token_urlsafe(32))')")
        if self.read_token and not self.admin_token:
            raise ConfigError("read_token is set but admin_token is not: writes would be open while reads are protected; "
                              "set admin_token too")
        for name in ("admin_token", "read_token"):
            token = getattr(self, name)
            if token is not None and (len(token) < 8 or any(c.isspace() for c in token)):
                raise ConfigError(f"{name} must be at least 8 characters without whitespace")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ConfigError("tls_cert and tls_key must be given together")
        if self.tls_ca is not None and self.tls_cert is None:
            raise ConfigError("tls_ca (client certificate check) needs tls_cert and tls_key")
        for name in ("tls_cert", "tls_key", "tls_ca"):
            path = getattr(self, name)
            if path is not None and not Path(path).is_file():
                raise ConfigError(f"{name} file {path} does not exist")
        if self.cache_bytes < 0:
            raise ConfigError(f"cache_bytes must be >= 0, got {self.cache_bytes}")
        if not 4 * MiB <= self.max_message_bytes <= 2047 * MiB:
            raise ConfigError(f"max_message_bytes must be between 4 MiB and 2047 MiB, got {self.max_message_bytes}")
        if not 64 * 1024 <= self.get_message_bytes <= self.max_message_bytes // 2:
            raise ConfigError(f"get_message_bytes must be between 64 KiB and max_message_bytes/2, got {self.get_message_bytes}")
        if self.scrub_bytes_per_s < 0:
            raise ConfigError(f"scrub_bytes_per_s must be >= 0 (0 disables the scrubber), got {self.scrub_bytes_per_s}")
        if not 0.0 <= self.scrub_busy_fraction <= 1.0:
            raise ConfigError(f"scrub_busy_fraction must be within [0, 1] (1: no slowdown under traffic), got {self.scrub_busy_fraction}")
        if self.scrub_quiet_s < 0:
            raise ConfigError(f"scrub_quiet_s must be >= 0 (0: never counted busy), got {self.scrub_quiet_s}")
        if self.repair_interval_s <= 0:
            raise ConfigError(f"repair_interval_s must be > 0, got {self.repair_interval_s}")
        if self.anti_entropy_interval_s <= 0:
            raise ConfigError(f"anti_entropy_interval_s must be > 0, got {self.anti_entropy_interval_s}")
        if self.gc_interval_s < 0 or self.orphan_grace_s < 0:
            raise ConfigError("gc_interval_s and orphan_grace_s must be >= 0 (gc_interval_s 0 disables orphan collection)")
        if self.bulk_listen is not None:
            _check_hostport("bulk_listen", self.bulk_listen)
        if not 1 <= self.workers <= 1024:
            raise ConfigError(f"workers must be between 1 and 1024, got {self.workers}")
        self.check_exposure(self.extra.get("metrics_port") if isinstance(self.extra.get("metrics_port"), int) else None)
        return self

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any], **overrides: Any) -> ServerConfig:
        data = dict(values.get("server", values))
        data.update({k: v for k, v in overrides.items() if v is not None})
        known = {f.name for f in dataclasses.fields(cls)}
        for key in SECRET_KEYS:
            file_key = f"{key}_file"
            path = data.pop(file_key, None)
            if path is None:
                continue
            if data.get(key) is not None:
                raise ConfigError(f"both {key} and {file_key} are set; give one")
            data[key] = read_secret_file(key, path)
        extra = {k: v for k, v in data.items() if k not in known}
        kwargs = {k: v for k, v in data.items() if k in known}
        for key in ("data_dir", "tls_cert", "tls_key", "tls_ca"):
            if kwargs.get(key) is not None:
                kwargs[key] = Path(kwargs[key])
        if "peers" in kwargs:
            peers = kwargs["peers"]
            kwargs["peers"] = tuple(peers.split(",") if isinstance(peers, str) else peers)
        for key in ("server_id", "data_dir"):
            if key not in kwargs:
                raise ConfigError(f"config is missing {key!r}")
        extra_in = dict(kwargs.pop("extra", None) or {})
        try:
            config = cls(**kwargs, extra={**extra_in, **extra})
        except TypeError as exc:
            raise ConfigError(f"bad config: {exc}") from exc
        return config.validate()

    @classmethod
    def from_file(cls, path: str | Path, **overrides: Any) -> ServerConfig:
        """Load a ``.toml`` or ``.json`` file; keyword overrides win (None is ignored)."""
        p = Path(path)
        try:
            raw = p.read_bytes()
        except OSError as exc:
            raise ConfigError(f"cannot read config file {p}: {exc.strerror}") from exc
        try:
            values = json.loads(raw) if p.suffix == ".json" else tomllib.loads(raw.decode())
        except (ValueError, tomllib.TOMLDecodeError) as exc:
            raise ConfigError(f"config file {p} is not valid {'JSON' if p.suffix == '.json' else 'TOML'}: {exc}") from exc
        return cls.from_mapping(values, **overrides)


__all__ = ["ServerConfig", "is_loopback_host", "read_secret_file", "SECRET_KEYS", "DEFAULT_MAX_MESSAGE_BYTES",
           "DEFAULT_GET_MESSAGE_BYTES", "MiB"]
