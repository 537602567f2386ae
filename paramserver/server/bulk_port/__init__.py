"""The bulk port of a server: answers the read and write protocols of ``paramserver.wire.bulk_frames``.

One module per job: ``listener`` (accept, connection limits, the hello and its dispatch),
``reads`` (read sessions), ``writes`` (write sessions: PUTs received, stored through
``paramserver.server.ingest`` as PutChunks stores them, acked in order), ``chain`` (forwarding a
PUT to the next hop of a chain) and ``config`` (settings and token rules). This package exports
what the rest of the server uses; its modules never import it.
"""
from __future__ import annotations

from paramserver.server.bulk_port.config import CONFIG_KEYS, BulkServerConfig, check_token, check_write_token
from paramserver.server.bulk_port.listener import BulkServer

__all__ = ["CONFIG_KEYS", "BulkServer", "BulkServerConfig", "check_token", "check_write_token"]
