"""Real network partitions between local processes, with Linux network namespaces.

Layout of one topology (prefix ``pdp-ab12-``, subnet ``10.231.7.0/24``)::

      root namespace                 pdp-ab12-br (bridge namespace)
      pdp-ab12-h 10.231.7.254 <----> h  --+
                                          |  br0
      pdp-ab12-s0: eth0 10.231.7.1 <---> p0 --+
      pdp-ab12-s1: eth0 10.231.7.2 <---> p1 --+
      pdp-ab12-s2: eth0 10.231.7.3 <---> p2 --+
      pdp-ab12-c0: eth0 10.231.7.101 <-> q0 --+   (optional client namespaces)

* Each server gets its own namespace with one veth onto a bridge that lives in a
  namespace of its own, so the topology touches the root namespace with exactly
  one interface (the *host* client port) and one connected route for its /24.
* Processes in the root namespace (tests, drills, workers) are clients through
  that host port. Extra client namespaces (``clients=k``) let a drill run one
  loader on the minority side and another on the majority side at once.
* A partition is enforced on the bridge ports, inside the bridge namespace: the
  egress qdisc of each port (the direction *towards* its endpoint) sends IP
  packets whose source is on another side to an HTB class whose leaf is a
  ``pfifo limit 0``, which drops them silently. Rules are symmetric, so both
  directions are cut, and a cut looks like a real partition (timeouts, not
  connection-refused). Only iproute2 (``ip``, ``tc``) is needed: no iptables or
  nftables, no ``act_gact`` or ``netem`` modules, which the CI kernel lacks.
  ARP is not IP and keeps flowing, which is harmless.
* Partition semantics: ``partition([{0, 1}, {2, "c0"}])`` puts servers 0 and 1
  on one side and server 2 with client namespace c0 on the other. Endpoints in
  different groups cannot exchange packets; endpoints in the same group can;
  an endpoint in no group (by default the host port and the client
  namespaces) still reaches everyone, like a client that sees both sides.
  Put ``"host"`` in a group to attach the root-namespace clients to one side.

Safety: every name starts with the caller's prefix (which must start with
``pdp-``), addresses come from a private /24 that must not overlap any route
of the root namespace, and ``destroy`` and ``cleanup_stale`` remove only
objects named with that prefix. Nothing is ever routed off the machine.
"""
from __future__ import annotations

import ipaddress
import os
import re
import shutil
import subprocess
import uuid
from dataclasses import dataclass
from typing import Collection, Sequence, Union

from deploy.errors import NetnsError as NetnsError  # re-exported: its old home

Endpoint = Union[int, str]  # a server index, or "host", or "c0", "c1", ... for client namespaces
HOST = "host"
SAFE_PREFIX = "pdp-"
_PREFIX_RE = re.compile(r"^pdp-[a-z0-9]{0,6}-?$")
_CMD_TIMEOUT = 10.0  # seconds; no iproute2 call should take more than a fraction of that
_CLIENT_BASE = 101  # client namespace j gets .101+j; servers get .1+i; the host port .254


@dataclass(frozen=True)
class NetnsConfig:
    prefix: str  # e.g. "pdp-ab12-"; every namespace and root-namespace link is named with it
    servers: int
    clients: int = 0  # extra client namespaces on the bridge
    subnet: str | None = None  # an IPv4 /24; None picks a free 10.231.X.0/24

    def validate(self) -> None:
        if not _PREFIX_RE.match(self.prefix):
            raise NetnsError(
                f"netns prefix must look like 'pdp-ab12-' (start with {SAFE_PREFIX!r}, then up to 6 of a-z0-9, "
                f"then an optional '-'), got {self.prefix!r}; use NetnsConfig.fresh() for a unique one")
        if not 1 <= self.servers <= 64:
            raise NetnsError(f"servers must be between 1 and 64, got {self.servers}")
        if not 0 <= self.clients <= 16:
            raise NetnsError(f"clients must be between 0 and 16, got {self.clients}")
        if self.subnet is not None:
            net = _parse_subnet(self.subnet)
            if not net.is_private:
                raise NetnsError(f"subnet {self.subnet} is not private; use one inside 10.0.0.0/8, e.g. 10.231.7.0/24")

    @staticmethod
    def fresh(servers: int, clients: int = 0, subnet: str | None = None) -> "NetnsConfig":
        """A config with a unique prefix, so parallel topologies never collide."""
        return NetnsConfig(prefix=f"{SAFE_PREFIX}{uuid.uuid4().hex[:6]}-", servers=servers, clients=clients, subnet=subnet)


def _parse_subnet(text: str) -> ipaddress.IPv4Network:
    try:
        net = ipaddress.IPv4Network(text, strict=True)
    except ValueError as exc:
        raise NetnsError(f"subnet must be an IPv4 network like 10.231.7.0/24: {exc}") from None
    if net.prefixlen != 24:
        raise NetnsError(f"subnet must be a /24 (servers get .1.., clients .101.., the host .254), got {text}")
    return net


def _run(argv: Sequence[str], *, check: bool = True, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    try:
        proc = subprocess.run(list(argv), input=stdin, capture_output=True, text=True, timeout=_CMD_TIMEOUT)
    except FileNotFoundError:
        raise NetnsError(f"{argv[0]} not found: install iproute2 (apt-get install -y iproute2)") from None
    except subprocess.TimeoutExpired:
        raise NetnsError(f"{' '.join(argv)} did not finish within {_CMD_TIMEOUT}s") from None
    if check and proc.returncode != 0:
        raise NetnsError(f"{' '.join(argv)} failed (exit {proc.returncode}): {proc.stderr.strip() or proc.stdout.strip()}")
    return proc


def _netns_names() -> list[str]:
    out = _run(["ip", "netns", "list"]).stdout
    # Lines look like "name (id: 3)" or just "name".
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _root_links() -> list[str]:
    out = _run(["ip", "-o", "link", "show"]).stdout
    names = []
    for line in out.splitlines():
        parts = line.split(":", 2)
        if len(parts) >= 2:
            names.append(parts[1].strip().split("@")[0])
    return names


def _used_networks() -> list[ipaddress.IPv4Network]:
    nets = []
    for line in _run(["ip", "-4", "route", "show", "table", "all"]).stdout.splitlines():
        word = line.split()[0] if line.split() else ""
        if word in ("broadcast", "local", "unreachable", "blackhole", "prohibit", "throw"):
            word = line.split()[1] if len(line.split()) > 1 else ""
        if word == "default":
            continue
        try:
            nets.append(ipaddress.IPv4Network(word, strict=False))
        except ValueError:
            continue
    return nets


def netns_available() -> tuple[bool, str]:
    """Whether this machine can build a topology; the reason says what to fix when it cannot.

    Probes for real (a scratch namespace, a veth pair, the HTB/pfifo/u32 pieces a
    partition uses) because a kernel can lack any of them while ``ip`` exists.
    """
    if os.name != "posix" or not os.path.exists("/proc/self/ns/net"):
        return False, "network namespaces need Linux"
    if os.geteuid() != 0:
        return False, "network namespaces need root (run the test or drill as root)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return False, f"'{tool}' not found: install iproute2 (apt-get install -y iproute2)"
    probe = f"{SAFE_PREFIX}probe{uuid.uuid4().hex[:4]}"
    try:
        _run(["ip", "netns", "add", probe])
        try:
            _run(["ip", "-n", probe, "link", "add", "name", "a", "type", "veth", "peer", "name", "b"])
            _run(["ip", "-n", probe, "link", "set", "dev", "a", "up"])
            _install_drop(probe, "a", ["10.231.255.1"])
        finally:
            _run(["ip", "netns", "del", probe], check=False)
    except NetnsError as exc:
        return False, f"network namespaces or tc are not usable here: {exc}"
    return True, "ok"


def _install_drop(ns: str, dev: str, sources: Sequence[str]) -> None:
    """Drop IP packets leaving ``dev`` (inside ``ns``) whose source is one of ``sources``.

    HTB with no default class sends unclassified packets straight through (its
    direct queue), so only the matched sources meet the zero-length pfifo.
    """
    lines = [
        f"qdisc replace dev {dev} root handle 1: htb",
        f"class add dev {dev} parent 1: classid 1:2 htb rate 8bit",
        f"qdisc add dev {dev} parent 1:2 handle 2: pfifo limit 0",
    ]
    for i, src in enumerate(sources):
        lines.append(f"filter add dev {dev} parent 1: protocol ip prio {i + 1} u32 match ip src {src}/32 flowid 1:2")
    _run(["tc", "-n", ns, "-batch", "-"], stdin="\n".join(lines) + "\n")


def _clear_drop(ns: str, dev: str) -> None:
    # Deleting the root qdisc removes its classes and filters; "no qdisc" is fine (already healed).
    _run(["tc", "-n", ns, "qdisc", "del", "dev", dev, "root"], check=False)


class NetnsTopology:
    """One bridge, one namespace per server (and per extra client), a host port for root-namespace clients.

    The constructor creates nothing; ``create()`` builds, ``destroy()`` removes
    (idempotent). Use it as a context manager to destroy on any failure.
    """

    def __init__(self, config: NetnsConfig) -> None:
        config.validate()
        self.config = config
        self.prefix = config.prefix
        self.n = config.servers
        self._subnet: ipaddress.IPv4Network | None = _parse_subnet(config.subnet) if config.subnet else None
        self._cut: dict[Endpoint, set[Endpoint]] = {}

    # ---- names and addresses ---------------------------------------------------------
    @property
    def bridge_ns(self) -> str:
        return f"{self.prefix}br"

    @property
    def host_link(self) -> str:
        return f"{self.prefix}h"

    @property
    def has_subnet(self) -> bool:
        return self._subnet is not None

    @property
    def subnet(self) -> str:
        if self._subnet is None:
            raise NetnsError("the topology has no subnet yet: call create() first")
        return str(self._subnet)

    def ns(self, i: int) -> str:
        """Name of server i's namespace (0-based)."""
        self._check_server(i)
        return f"{self.prefix}s{i}"

    def client_ns(self, j: int) -> str:
        if not 0 <= j < self.config.clients:
            raise NetnsError(f"no client namespace c{j}: the topology has {self.config.clients} (NetnsConfig.clients)")
        return f"{self.prefix}c{j}"

    def address(self, endpoint: Endpoint) -> str:
        """The IPv4 address of a server index, "host", or "cJ"."""
        if self._subnet is None:
            raise NetnsError("the topology has no subnet yet: call create() first")
        base = self._subnet.network_address
        if endpoint == HOST:
            return str(base + 254)
        if isinstance(endpoint, str):
            return str(base + _CLIENT_BASE + self._client_index(endpoint))
        self._check_server(endpoint)
        return str(base + 1 + endpoint)

    def endpoints(self) -> list[Endpoint]:
        return [*range(self.n), HOST, *(f"c{j}" for j in range(self.config.clients))]

    def _port(self, endpoint: Endpoint) -> str:
        """The bridge-side veth of an endpoint, inside the bridge namespace."""
        if endpoint == HOST:
            return "h"
        if isinstance(endpoint, str):
            return f"q{self._client_index(endpoint)}"
        self._check_server(endpoint)
        return f"p{endpoint}"

    def _client_index(self, name: str) -> int:
        if not (name.startswith("c") and name[1:].isdigit()) or int(name[1:]) >= self.config.clients:
            raise NetnsError(f"unknown endpoint {name!r}: use a server index 0..{self.n - 1}, 'host', "
                             f"or c0..c{self.config.clients - 1} for client namespaces")
        return int(name[1:])

    def _check_server(self, i: object) -> None:
        if not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < self.n:
            raise NetnsError(f"server index must be 0..{self.n - 1}, got {i!r}")

    def exec_args(self, i: int, argv: Sequence[str]) -> list[str]:
        """argv run inside server i's namespace (``ip netns exec`` execs it, so the pid is argv's)."""
        return ["ip", "netns", "exec", self.ns(i), *argv]

    def client_exec_args(self, j: int, argv: Sequence[str]) -> list[str]:
        return ["ip", "netns", "exec", self.client_ns(j), *argv]

    # ---- lifecycle -----------------------------------------------------------------------
    def create(self) -> "NetnsTopology":
        ok, reason = netns_available()
        if not ok:
            raise NetnsError(reason)
        existing = [n for n in _netns_names() if n.startswith(self.prefix)]
        if existing or self.host_link in _root_links():
            raise NetnsError(f"a topology named {self.prefix!r} already exists ({existing or [self.host_link]}); "
                             f"remove it with deploy.netns.cleanup_stale({self.prefix!r})")
        fixed = self._subnet is not None
        for _attempt in range(5):
            self._subnet = self._pick_subnet()
            try:
                self._build()
            except BaseException:
                self.destroy()
                raise
            # Two topologies created at the same moment can pick the same free /24; the
            # kernel accepts that silently and routing becomes ambiguous. Check, and retry.
            if self._subnet_owners() == [self.host_link]:
                return self
            self.destroy()
            if fixed:
                break
            self._subnet = None
        raise NetnsError(f"subnet {self.config.subnet or '10.231.X.0/24'} is taken by another interface; "
                         "pick another subnet, or clean up stale topologies with cleanup_stale('pdp-')")

    def _subnet_owners(self) -> list[str]:
        """Root-namespace interfaces with an address inside this topology's subnet."""
        assert self._subnet is not None, "the subnet is picked before it is checked"
        owners = []
        for line in _run(["ip", "-4", "-o", "addr", "show"]).stdout.splitlines():
            parts = line.split()
            if len(parts) >= 4 and parts[2] == "inet":
                try:
                    inside = ipaddress.IPv4Interface(parts[3]).ip in self._subnet
                except ValueError:
                    continue
                if inside:
                    owners.append(parts[1])
        return owners

    def _pick_subnet(self) -> ipaddress.IPv4Network:
        used = _used_networks()
        if self._subnet is not None:
            clash = [str(u) for u in used if u.overlaps(self._subnet)]
            if clash:
                raise NetnsError(f"subnet {self._subnet} overlaps routes of this machine ({clash}); pick another "
                                 f"or leave subnet=None, or clean up stale topologies with cleanup_stale('pdp-')")
            return self._subnet
        # Start from a hash of the prefix so parallel topologies rarely probe the same /24 first.
        start = int(uuid.uuid5(uuid.NAMESPACE_DNS, self.prefix).hex[:4], 16) % 256
        for k in range(256):
            net = ipaddress.IPv4Network(f"10.231.{(start + k) % 256}.0/24")
            if not any(u.overlaps(net) for u in used):
                return net
        raise NetnsError("no free 10.231.X.0/24 left; remove stale topologies with cleanup_stale('pdp-')")

    def _build(self) -> None:
        br = self.bridge_ns
        prefixlen = self._subnet.prefixlen if self._subnet else 24
        _run(["ip", "netns", "add", br])
        _run(["ip", "-n", br, "link", "set", "dev", "lo", "up"])
        _run(["ip", "-n", br, "link", "add", "name", "br0", "type", "bridge"])
        _run(["ip", "-n", br, "link", "set", "dev", "br0", "up"])
        namespaces: list[tuple[int | str, str]] = [(i, self.ns(i)) for i in range(self.n)]
        namespaces += [(f"c{j}", self.client_ns(j)) for j in range(self.config.clients)]
        for endpoint, ns in namespaces:
            port = self._port(endpoint)
            _run(["ip", "netns", "add", ns])
            _run(["ip", "-n", ns, "link", "set", "dev", "lo", "up"])
            # Created inside the bridge namespace with its peer placed straight into the
            # endpoint's namespace: no name ever appears in the root namespace.
            _run(["ip", "-n", br, "link", "add", "name", port, "type", "veth", "peer", "name", "eth0", "netns", ns])
            _run(["ip", "-n", br, "link", "set", "dev", port, "master", "br0", "up"])
            _run(["ip", "-n", ns, "addr", "add", f"{self.address(endpoint)}/{prefixlen}", "dev", "eth0"])
            _run(["ip", "-n", ns, "link", "set", "dev", "eth0", "up"])
        _run(["ip", "link", "add", "name", self.host_link, "type", "veth", "peer", "name", "h", "netns", br])
        _run(["ip", "-n", br, "link", "set", "dev", "h", "master", "br0", "up"])
        _run(["ip", "addr", "add", f"{self.address(HOST)}/{prefixlen}", "dev", self.host_link])
        _run(["ip", "link", "set", "dev", self.host_link, "up"])

    def destroy(self) -> None:
        """Remove every namespace and link of this topology; safe to call twice or after a failed create()."""
        cleanup_stale(self.prefix)
        self._cut = {}

    def __enter__(self) -> "NetnsTopology":
        return self

    def __exit__(self, *exc: object) -> None:
        self.destroy()

    # ---- partitions -----------------------------------------------------------------------
    def partition(self, groups: Sequence[Collection[Endpoint]]) -> None:
        """Cut traffic between groups, not within them; endpoints in no group reach everyone.

        Every server must be in exactly one group. Replaces any earlier partition.
        """
        seen: dict[Endpoint, int] = {}
        for g, group in enumerate(groups):
            for e in group:
                self._port(e)  # validates the endpoint
                if e in seen:
                    raise NetnsError(f"endpoint {e!r} is in two groups ({seen[e]} and {g}); put it in one")
                seen[e] = g
        missing = [i for i in range(self.n) if i not in seen]
        if missing:
            raise NetnsError(f"servers {missing} are in no group; every server must be on one side of a partition")
        cut: dict[Endpoint, set[Endpoint]] = {e: set() for e in self.endpoints()}
        for a, ga in seen.items():
            for b, gb in seen.items():
                if ga != gb:
                    cut[a].add(b)
        self._apply(cut)

    def isolate(self, i: int, with_host: bool = False) -> None:
        """Server i alone on one side; the host clients stay with the rest unless with_host."""
        self._check_server(i)
        alone: set[Endpoint] = {i, HOST} if with_host else {i}
        rest: set[Endpoint] = {j for j in range(self.n) if j != i}
        if not with_host:
            rest.add(HOST)
        self.partition([alone, rest])

    def heal(self) -> None:
        """Restore full connectivity."""
        self._apply({e: set() for e in self.endpoints()})

    def cuts(self) -> dict[str, list[str]]:
        """Current cuts, for reports: endpoint -> endpoints it cannot reach."""
        return {str(a): sorted(str(b) for b in bs) for a, bs in self._cut.items() if bs}

    def _apply(self, cut: dict[Endpoint, set[Endpoint]]) -> None:
        if self.bridge_ns not in _netns_names():
            raise NetnsError(f"topology {self.prefix!r} does not exist (never created, or destroyed when its cluster "
                             "stopped); start one with NetnsTopology.create() or 'python -m deploy.local up --netns'")
        for endpoint, blocked in cut.items():
            port = self._port(endpoint)
            _clear_drop(self.bridge_ns, port)
            if blocked:
                _install_drop(self.bridge_ns, port, [self.address(b) for b in sorted(blocked, key=str)])
        self._cut = cut


def cleanup_stale(prefix: str = SAFE_PREFIX) -> list[str]:
    """Delete namespaces and root-namespace links whose names start with prefix; return what was removed.

    Deleting the bridge namespace destroys every veth pair with an end in it,
    including the host port; the root-namespace link is removed explicitly too
    because namespace teardown is asynchronous.
    """
    if not prefix.startswith(SAFE_PREFIX):
        raise NetnsError(f"refusing to clean up names that do not start with {SAFE_PREFIX!r} (got {prefix!r})")
    if shutil.which("ip") is None:
        return []
    removed = []
    for link in _root_links():
        if link.startswith(prefix):
            _run(["ip", "link", "del", "dev", link], check=False)
            removed.append(link)
    for ns in _netns_names():
        if ns.startswith(prefix):
            _run(["ip", "netns", "del", ns], check=False)
            removed.append(ns)
    return removed
