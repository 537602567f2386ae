"""One safe-default rule for every listener: off loopback, a port needs its credential or an
explicit ``--insecure``.

Each listening program (``paramserver serve``: gRPC, bulk, Raft, metrics; ``paramworker serve``:
HTTP; ``paramrouter``: HTTP; the worker peer port) describes its listeners as ``Listener`` values
and calls ``check_listeners`` once before binding. A listener is *open* when its address can be
reached from another machine (anything but 127.0.0.0/8, ::1 and "localhost"; a wildcard counts as
reachable) and the credential that protects it is not configured. An open listener is refused
with a ``ConfigError`` naming the flag, the address and the flag that fixes it; with
``insecure=True`` the start goes on and each open listener is one warning line the caller logs
at WARNING on every start.
"""
from __future__ import annotations

import ipaddress
from collections.abc import Iterable
from dataclasses import dataclass

from paramserver.wire.errors import ConfigError


def is_loopback_host(host: str) -> bool:
    """True only for an address no other machine can reach: 127.0.0.0/8, ::1 or "localhost".

    A wildcard ("0.0.0.0", "::", "") or any other name counts as reachable from the network.
    """
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _host(address: str) -> str:
    return address.rpartition(":")[0] if ":" in address else address


@dataclass(frozen=True)
class Listener:
    """One listening port and what protects it.

    ``name``: what the port is ("the bulk port"); ``flag``: the option that sets its address
    ("--bulk-listen"); ``credential``: what protects it ("a read token"); ``protected``: whether
    that credential is configured; ``risk``: what anyone who reaches an open one can do ("read and
    write chunk bytes"); ``fix``: how to protect it ("--read-token-file FILE and
    --admin-token-file FILE").
    """

    name: str
    flag: str
    address: str
    credential: str
    protected: bool
    risk: str
    fix: str

    @property
    def reachable(self) -> bool:
        """Reachable from another machine (not loopback)."""
        return not is_loopback_host(_host(self.address))

    @property
    def open(self) -> bool:
        """Reachable from the network and without its credential."""
        return self.reachable and not self.protected

    def problem(self) -> str:
        return (f"{self.name} ({self.flag} {self.address}) is not loopback and has no {self.credential}: "
                f"anyone who reaches it can {self.risk}")


def check_listeners(listeners: Iterable[Listener], insecure: bool = False) -> list[str]:
    """Refuse the first open listener (ConfigError naming its flag and the fix), or, with
    ``insecure``, return one warning line per open listener ([] when none is open)."""
    open_ = [listener for listener in listeners if listener.open]
    if not insecure and open_:
        first = open_[0]
        raise ConfigError(f"{first.problem()}; set {first.fix}, give {first.flag} a loopback address, "
                          "or pass --insecure to run open anyway")
    return [f"running open (--insecure): {listener.problem()}" for listener in open_]


__all__ = ["Listener", "check_listeners", "is_loopback_host"]
