"""Keys of ``ServerStatusReply.extra`` that clients read (the server writes others, for people).

``placement_ring``: the up members (sorted server ids, comma-separated) of the ring on which this
server's last clean re-replication pass found every committed chunk it holds on all its replicas;
``placement_at``: when (Unix seconds). Absent before such a pass, and after a pass that was not
clean (a copy made, a peer unreachable or full). ``paramctl member drain`` reads them.
"""
from __future__ import annotations

PLACEMENT_RING_KEY = "placement_ring"
PLACEMENT_AT_KEY = "placement_at"
