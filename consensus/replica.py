"""The pysyncobj binding: one replicated method that feeds commands to MetadataState.

Whatever ``apply`` returns reaches the proposer's callback, also when the write
was forwarded from a follower: pysyncobj answers a forwarded command with its
log index only, and the follower's callback gets the follower's own result of
applying that entry. Errors therefore travel as a descriptor, never as an
exception (an exception here would escape into pysyncobj's tick loop).
"""
from __future__ import annotations

import logging
import threading
from typing import Any, Mapping

from pysyncobj import SyncObjConsumer, replicated

from .errors import MetadataError
from .state import ERRORS, MetadataState

log = logging.getLogger(__name__)

Outcome = tuple[Any, ...]


class StateReplica(SyncObjConsumer):  # type: ignore[misc]
    def __init__(self) -> None:
        # Readers run on caller threads while pysyncobj applies on its tick thread.
        # Created before SyncObjConsumer.__init__ so it stays out of the full dump.
        self.lock = threading.Lock()
        super().__init__()
        self.state = MetadataState()

    @replicated  # type: ignore[untyped-decorator]
    def apply(self, command: Mapping[str, Any]) -> Outcome:
        with self.lock:
            try:
                return ("ok", self.state.apply(command))
            except MetadataError as exc:
                return ("error", type(exc).__name__, str(exc))
            except Exception as exc:  # a bug must not stop the Raft loop; every replica hits it alike
                log.exception("state machine failed on %r", command.get("op"))
                return ("error", "MetadataError", f"internal error applying {command.get('op')!r}: {exc}")

    def _serialize(self) -> dict[str, Any]:
        with self.lock:
            return {"snapshot": self.state.snapshot()}

    def _deserialize(self, data: Mapping[str, Any]) -> None:
        restored = MetadataState()
        restored.restore(data["snapshot"])
        with self.lock:
            self.state = restored


def unwrap(outcome: Outcome) -> Any:
    """The result of an outcome, or its error raised as the same typed exception."""
    if outcome[0] == "ok":
        return outcome[1]
    raise ERRORS.get(outcome[1], MetadataError)(outcome[2])
