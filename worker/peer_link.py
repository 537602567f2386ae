"""The process's peer runtime: one peer shelf, one peer port and one swarm per ``ClusterClient``.

Workers of one cluster read chunks from each other (issue 42, docs/workers.md "Peers"):

- ``worker.peer_shelf.PeerShelf`` holds what this process can give: the chunks of loads in
  progress as they land, the memory tier, the disk tier.
- ``worker.peer_port.PeerPort`` answers other workers' chunk reads from the shelf (the servers'
  read protocol; the cluster's read token required; under TLS the worker's certificate).
- ``paramserver.client.swarm_fetch.Swarm`` announces the versions this process holds or loads,
  with the port's address, and fetches a load's chunks from peers and servers.

Every load of the worker's load path (``worker.loader``) uses the link of its client: the CLIs
start one (``--no-peers`` / ``PARAMS_PEERS=off``: none), and a library load starts one for its
client unless ``peers=False``. The link closes with the client that owns it (its "leaving"
announce tells the servers at once) or at process exit.

The three parts are imported here, when a link starts, never at import time: a process that runs
with peers off never loads them.
"""
from __future__ import annotations

import atexit
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from chunking.manifest import Manifest
from paramserver.wire.address import split_host_port
from paramserver.wire.exposure import Listener
from worker.errors import ConfigError
from worker.prefetch import ShelfEntry
from worker.tiered_cache import Locate, TieredCache

if TYPE_CHECKING:  # imported when a link starts (start()): a process with peers off never loads them
    from paramserver.client.swarm_fetch import Swarm
    from worker.peer_port import PeerPort
    from worker.peer_shelf import PeerShelf

log = logging.getLogger(__name__)

PEERS_ENV = "PARAMS_PEERS"  # "off": no peer port, no peer reads
PEER_LISTEN_ENV = "PARAMS_PEER_LISTEN"
PEER_ADVERTISE_ENV = "PARAMS_PEER_ADVERTISE"
DEFAULT_PEER_LISTEN = "127.0.0.1:0"  # loopback: safe; a fleet sets --peer-listen 0.0.0.0:PORT + --peer-advertise
DEFAULT_MAX_CONNECTIONS_PER_SOURCE = 64
_OFF = ("off", "0", "false", "no")
_ON = ("on", "1", "true", "yes", "")
WILDCARDS = ("0.0.0.0", "::", "")


def peers_enabled(environ: Mapping[str, str] = os.environ) -> bool:
    """``PARAMS_PEERS``: on (default) or off; anything else is a one-line ConfigError."""
    value = environ.get(PEERS_ENV, "").strip().lower()
    if value in _OFF:
        return False
    if value in _ON:
        return True
    raise ConfigError(f"${PEERS_ENV}={environ.get(PEERS_ENV)!r} is not on or off; set PARAMS_PEERS=off to turn peers off")


def _address(value: str, flag: str) -> str:
    try:
        split_host_port(value)
    except ValueError as exc:
        raise ConfigError(f"{flag}: {exc}; port 0 picks a free one") from None
    return value


@dataclass(frozen=True)
class PeerLinkConfig:
    """Where the peer port listens and what it tells peers to dial.

    ``advertise`` None: the bound address (a wildcard bind then needs an ``advertise``); port 0 in
    it: that host with the port bound (several workers of one host each binding ``0.0.0.0:0``, e.g.
    an engine's tensor-parallel ranks, each advertise their own port).
    ``insecure``: listen off loopback without a read token (``--insecure``; a warning at start).
    ``swarm``: keyword arguments for ``SwarmOptions`` (e.g. ``peer_wait_s``).
    """

    enabled: bool = True
    listen: str = DEFAULT_PEER_LISTEN
    advertise: str | None = None
    max_connections_per_source: int = DEFAULT_MAX_CONNECTIONS_PER_SOURCE
    insecure: bool = False
    swarm: Mapping[str, Any] = field(default_factory=dict)

    def validate(self) -> PeerLinkConfig:
        host, _port = split_host_port(_address(self.listen, "--peer-listen"))
        if host in WILDCARDS and self.advertise is None and self.enabled:
            raise ConfigError(f"--peer-listen {self.listen} binds every address: give --peer-advertise HOST:PORT "
                              "(the address other workers reach this one at), or --no-peers")
        if self.advertise is not None:
            host, port = split_host_port(_address(self.advertise, "--peer-advertise"))
            if host in WILDCARDS:
                raise ConfigError(f"--peer-advertise {self.advertise}: peers cannot dial a wildcard address; "
                                  "give the address other workers reach this one at, e.g. $(POD_IP):7070 "
                                  "(port 0: the port --peer-listen bound)")
        if not 1 <= self.max_connections_per_source <= 100000:
            raise ConfigError(f"--peer-max-connections-per-source must be 1..100000, got {self.max_connections_per_source}")
        return self

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ, **given: Any) -> PeerLinkConfig:
        """Flags (``given``, None = not given) > ``PARAMS_PEER_LISTEN`` / ``PARAMS_PEER_ADVERTISE`` /
        ``PARAMS_PEERS`` > defaults."""
        values = {k: v for k, v in given.items() if v is not None}
        for key, env in (("listen", PEER_LISTEN_ENV), ("advertise", PEER_ADVERTISE_ENV)):
            if key not in values and environ.get(env, "").strip():
                values[key] = environ[env].strip()
        values["enabled"] = bool(values.get("enabled", True)) and peers_enabled(environ)
        return cls(**values).validate()

    def listener(self, token: str | None) -> Listener:
        """The peer port for ``paramserver.wire.exposure.check_listeners`` (its credential: the read token)."""
        return Listener("the worker's peer port", "--peer-listen", self.listen, "read token", token is not None,
                        "read every chunk this worker holds", "a read token (--token-file FILE or PARAMS_READ_TOKEN)")


@dataclass(frozen=True)
class PeerStats:
    """What the worker's /metrics shows of its peers."""

    served_bytes: int = 0
    served_chunks: int = 0
    connections: int = 0
    refused: Mapping[str, int] = field(default_factory=dict)
    dropped: Mapping[str, int] = field(default_factory=dict)  # peers this process's loads dropped, by reason
    peer_bytes: int = 0  # stored bytes this process's loads read from peers


class PeerLink:
    """One process's peer runtime for ``client``: shelf, port and swarm. ``start()`` them, ``close()``."""

    def __init__(self, client: Any, cache: TieredCache | None, config: PeerLinkConfig = PeerLinkConfig(),
                 *, worker_id: str | None = None) -> None:
        self.client = client
        self.cache = cache
        self.config = config.validate()
        self.worker_id = worker_id or str(getattr(client, "worker_id", "") or f"worker-{os.getpid()}")
        self.shelf: PeerShelf | None = None
        self.port: PeerPort | None = None
        self.swarm: Swarm | None = None
        self.address: str | None = None
        self._lock = threading.Lock()
        self._closed = False

    @staticmethod
    def tls_files(client: Any) -> tuple[Path, Path, Path] | None:
        """(CA, certificate, key) of a TLS cluster's client, which the peer port serves with; None without TLS.
        ConfigError under TLS without all three (a peer could not check this worker, nor it a peer)."""
        options = getattr(client, "options", None)
        if options is None or not (options.tls or options.tls_ca is not None or options.tls_cert is not None):
            return None
        if options.tls_ca is None or options.tls_cert is None or options.tls_key is None:
            raise ConfigError("peers under TLS need the cluster's CA and this worker's certificate and key "
                              "(--tls-ca, --tls-cert, --tls-key); give them or pass --no-peers")
        return Path(options.tls_ca), Path(options.tls_cert), Path(options.tls_key)

    def check_exposure(self, token: str | None) -> list[str]:
        """``paramserver.wire.exposure.check_listeners`` of the peer port: its warnings (``--insecure``),
        or ConfigError (off loopback without the read token)."""
        from paramserver.wire.errors import ConfigError as WireConfigError
        from paramserver.wire.exposure import check_listeners

        try:
            return check_listeners([self.config.listener(token)], insecure=self.config.insecure)
        except WireConfigError as exc:
            raise ConfigError(str(exc)) from None

    def advertised(self, bound: str) -> str:
        """The address peers dial: ``advertise`` (its port 0: the bound port) or the bound address."""
        if self.config.advertise is None:
            return bound
        host, port = split_host_port(self.config.advertise)
        if port == 0:
            port = split_host_port(bound)[1]
        return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"

    def start(self) -> PeerLink:
        from paramserver.client.swarm_fetch import Swarm, SwarmOptions
        from worker.peer_port import PeerPort, PeerPortConfig
        from worker.peer_shelf import PeerShelf

        options = getattr(self.client, "options", None)
        token = options.token if options is not None else None
        # The same safe default as every listener, here too: a library load (no CLI to check the
        # flags first) with PARAMS_PEER_LISTEN off loopback and no read token gets no open port.
        self.check_exposure(token)
        tls = self.tls_files(self.client)
        swarm_options = SwarmOptions(**dict(self.config.swarm)).validate()
        self.shelf = PeerShelf(self.cache)
        self.port = PeerPort(self.shelf, PeerPortConfig(listen=self.config.listen,
                                                        max_connections_per_source=self.config.max_connections_per_source),
                             token, tls)
        self.port.start()
        try:
            self.address = self.advertised(str(self.port.address))
            self.swarm = Swarm(self.client, worker_id=self.worker_id, options=swarm_options)
            self.swarm.serve_at(self.address, self.shelf.versions)
        except BaseException:
            self.port.stop()
            raise
        return self

    # ------------------------------------------------------------------ what a load asks of it

    def begin(self, manifest: Manifest, locate: Locate) -> ShelfEntry:
        """This load on the shelf: its chunks are served to peers as they land."""
        if self.shelf is None:
            raise RuntimeError("the peer link is not started")
        entry: ShelfEntry = self.shelf.begin_load(manifest, locate, time.time())
        return entry

    def announce(self) -> None:
        """Tell the servers now (a load started or ended); a failure only delays it to the next lease beat."""
        swarm = self.swarm
        if swarm is None or self._closed:
            return
        try:
            swarm.announce_now()
        except Exception as exc:  # noqa: BLE001 - discovery is advisory: a load never fails for it
            log.debug("peer announce failed: %s", exc)

    def stats(self) -> PeerStats:
        port, swarm = self.port, self.swarm
        stats = PeerStats()
        if port is not None:
            stats = replace(stats, served_bytes=port.served_bytes, served_chunks=port.served_chunks,
                            connections=port.connections, refused=port.refused)
        if swarm is not None:
            stats = replace(stats, dropped=dict(swarm.counters.peers_dropped), peer_bytes=swarm.counters.peer_bytes)
        return stats

    def close(self) -> None:
        """The leaving announce, then the port (peers fall back to the servers for what they read here)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        stops: list[tuple[str, Callable[[], None] | None]] = [
            ("swarm", self.swarm.close if self.swarm is not None else None),
            ("peer port", self.port.stop if self.port is not None else None)]
        for what, stop in stops:
            if stop is None:
                continue
            try:
                stop()
            except Exception as exc:  # noqa: BLE001 - closing: the process goes on (or ends) either way
                log.warning("closing the %s failed: %s", what, exc)


# One link per client in this process (a client's loads share it); closed with the client's owner
# (``close_link``) or at exit.
_links: weakref.WeakKeyDictionary[Any, PeerLink | None] = weakref.WeakKeyDictionary()
_links_lock = threading.Lock()


def attach(client: Any, link: PeerLink | None) -> PeerLink | None:
    """``client``'s loads use ``link``; None: they use no peers (``--no-peers``), not even a default link."""
    with _links_lock:
        _links[client] = link
    return link


def link_of(client: Any) -> PeerLink | None:
    with _links_lock:
        return _links.get(client)


def link_for(client: Any, cache: TieredCache | None, peers: bool | PeerLink | None = None,
             config: PeerLinkConfig | None = None,
             warn: Callable[[str], None] = log.warning) -> PeerLink | None:
    """The peer link a load on ``client`` uses: ``peers`` a link: that one; False: none; True/None:
    the client's, started now if it has none (None and ``PARAMS_PEERS=off``: none). A link that
    cannot start (e.g. TLS without a certificate) is one warning, and the load reads the servers."""
    if isinstance(peers, PeerLink):
        return peers
    if peers is False or not hasattr(client, "options"):  # not a ClusterClient (a test's stand-in): no peers
        return None
    with _links_lock:
        if client in _links:  # attached (None: peers off for this client)
            link = _links[client]
            return None if link is None or link._closed else link
        config = config or PeerLinkConfig.from_env()
        if not config.enabled and peers is None:
            return None
        config = replace(config, enabled=True)
        try:
            link = PeerLink(client, cache, config).start()
        except ConfigError as exc:
            warn(f"peers off for this client: {exc}")
            _links[client] = None  # said once
            return None
        _links[client] = link
    return link


def close_link(client: Any) -> None:
    """Close ``client``'s link (its owner is closing the client)."""
    with _links_lock:
        link = _links.pop(client, None)
    if link is not None:
        link.close()


@atexit.register
def _close_all() -> None:
    with _links_lock:
        links = list(_links.values())
        _links.clear()
    for link in links:
        if link is not None:
            link.close()


def versions_of(link: PeerLink | None) -> Sequence[Any]:
    """What ``link`` announces (for /healthz and tests); [] without one."""
    return list(link.shelf.versions()) if link is not None and link.shelf is not None else []


__all__ = ["DEFAULT_PEER_LISTEN", "PEERS_ENV", "PEER_LISTEN_ENV", "PeerLink", "PeerLinkConfig", "PeerStats", "attach",
           "close_link", "link_for", "link_of", "peers_enabled", "versions_of"]
