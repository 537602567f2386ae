"""HOST:PORT, as every listener and dialer of this project spells an address."""
from __future__ import annotations


def split_host_port(address: str) -> tuple[str, int]:
    """``(host, port)`` of ``HOST:PORT`` or ``[V6]:PORT`` (brackets stripped); port 0 is allowed
    (a listener picks a free one). ValueError says what is wrong."""
    host, sep, port = address.rpartition(":") if isinstance(address, str) else ("", "", "")
    if not sep or not host.strip("[]") or not port.isdigit() or int(port) > 65535:
        raise ValueError(f"{address!r} is not HOST:PORT with a port in 0..65535 (for example 127.0.0.1:7000)")
    return host.strip("[]"), int(port)


def host_of(address: str) -> str:
    """The host of a ``HOST:PORT`` address (brackets stripped); ValueError when it is not one."""
    return split_host_port(address)[0]


__all__ = ["host_of", "split_host_port"]
