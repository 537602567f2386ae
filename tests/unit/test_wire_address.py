"""HOST:PORT parsing, the one spelling of an address for listeners and dialers."""
from __future__ import annotations

import pytest

from paramserver.wire.address import host_of, split_host_port


@pytest.mark.parametrize("address, want", [
    ("127.0.0.1:7000", ("127.0.0.1", 7000)), ("localhost:0", ("localhost", 0)), ("[::1]:65535", ("::1", 65535)),
    ("10.1.2.3:1", ("10.1.2.3", 1)),
])
def test_good_addresses_split(address: str, want: tuple[str, int]) -> None:
    assert split_host_port(address) == want and host_of(address) == want[0]


@pytest.mark.parametrize("address", ["", "7000", ":7000", "host:", "host:70000", "host:-1", "host:12a", "[]:80", "a:b:c"])
def test_bad_addresses_say_what_an_address_is(address: str) -> None:
    with pytest.raises(ValueError, match="is not HOST:PORT with a port in 0..65535"):
        split_host_port(address)
