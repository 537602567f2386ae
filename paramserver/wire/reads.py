"""How a server answers metadata reads; the one request header that changes it.

Metadata reads (ResolveTag, GetVersion, GetManifest by model, ListModels, ListVersions, ListTags)
are *linearizable* when the request says so: the leader's state after a no-op through Raft, so
every write acknowledged before the read began is in the answer. Otherwise they are
*serializable*: the answering member's own state, served only while that member is in sync
(``consensus.sync``: it hears its leader within an election timeout, has applied what the leader
had committed, and an entry of the current term), so the answer is at most a heartbeat behind.
A member that is catching up (restarted, back from a partition, in an election) refuses them
with UNAVAILABLE, naming why, and the client asks another member (docs/architecture.md, "Metadata
read guarantees").

``LOCAL_READ_KEY: local`` in a request's metadata asks for the member's state whatever it is: a
probe comparing servers, or watching one side of a partition (``deploy.drills.probe``). No
worker or CLI read sends it.
"""
from __future__ import annotations

from collections.abc import Iterable

LOCAL_READ_KEY = "pdparams-read"
LOCAL_READ = "local"
LOCAL_READ_METADATA: tuple[tuple[str, str], ...] = ((LOCAL_READ_KEY, LOCAL_READ),)


def wants_local(metadata: Iterable[tuple[str, str | bytes]] | None) -> bool:
    """Whether a call's metadata asks for this member's state even while it catches up."""
    for key, value in metadata or ():
        if key == LOCAL_READ_KEY:
            return (value.decode() if isinstance(value, bytes) else value) == LOCAL_READ
    return False


__all__ = ["LOCAL_READ", "LOCAL_READ_KEY", "LOCAL_READ_METADATA", "wants_local"]
