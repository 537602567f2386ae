"""Size limits of the wire contract, shared by servers and clients."""
from __future__ import annotations

MiB = 1 << 20

# A 64 MiB chunk (chunking's largest) plus its envelope fits in one message.
DEFAULT_MAX_MESSAGE_BYTES = 65 * MiB
# GetChunks coalescing target. Measured here (loopback, 3 servers):
# 1 MiB 0.8-1.2 GB/s, 2 MiB 0.65-1.05 GB/s, 4 MiB 0.55-0.9 GB/s.
DEFAULT_GET_MESSAGE_BYTES = 1 * MiB
# Longest codec name a stored chunk or a bulk header carries.
MAX_CODEC_LEN = 18

# GetManifest with part_ids: the most ids one request may name, and the bytes of parts one reply
# carries (at least one part, whatever its size; a part is at most about 2.6 MB).
MAX_PART_IDS_PER_CALL = 4096
MAX_PARTS_REPLY_BYTES = 8 * MiB

__all__ = ["DEFAULT_GET_MESSAGE_BYTES", "DEFAULT_MAX_MESSAGE_BYTES", "MAX_CODEC_LEN", "MAX_PARTS_REPLY_BYTES",
           "MAX_PART_IDS_PER_CALL", "MiB"]

# ReportHeat: entries in one call (and never more than the version's chunk count), and the
# largest message a server takes (refused unparsed above it). Clients send at most
# HEAT_ENTRIES_PER_CALL entries per call, each at most MAX_HEAT_ENTRY_BYTES on the wire (key and
# length, a uint32 index, a uint64 count, a uint32 order: 2 + 6 + 11 + 6), plus the model name,
# version and worker id: about 6.3 MiB, far below the 24 MiB gRPC limit a flood once filled.
MAX_HEAT_ENTRIES_PER_CALL = 1 << 20
HEAT_ENTRIES_PER_CALL = 1 << 18
MAX_HEAT_ENTRY_BYTES = 25
MAX_HEAT_REQUEST_BYTES = HEAT_ENTRIES_PER_CALL * MAX_HEAT_ENTRY_BYTES + 64 * 1024

# GetHotChunks: the most hot chunks one server advertises (each entry ~80-120 bytes), and the
# most a client keeps from all servers together.
MAX_HOT_CHUNKS_ADVERTISED = 4096
MAX_HOT_CHUNKS_KEPT = 16384

# Worker peers (AnnouncePeer / FindPeers): soft state on the servers that own a version's key.
MAX_PEER_VERSIONS = 16          # versions one announce may list (a worker's most recent ones)
MAX_PEERS_PER_VERSION = 4096    # entries a server keeps per version; the least recently announced go first
MAX_PEER_WORKERS = 65536        # workers a server keeps in all
MAX_PEERS_FOUND = 64            # peers one FindPeers answer may name
PEER_SEEDS = 8                  # the earliest loaders of a version, always named first
PEER_LEASE_MIN_S, PEER_LEASE_MAX_S = 1.0, 120.0
