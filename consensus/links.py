"""A pysyncobj TCP transport that keeps every peer link busy.

pysyncobj drops a link when nothing was read on it for ``connectionTimeout``,
and it checks that only when it next sends. Between two followers nothing
flows in normal operation, so the first message after a quiet spell, the
vote request of the next election, found the link expired and was dropped:
every election lost a round (bakwc/PySyncObj issue 172). Sending a tiny
message on every link each ``keepalive_period`` keeps links fresh, and a link
that stays silent despite it is really dead and still gets dropped.

The same transport is where a follower's AppendEntries answers wait for its
journal to be durable (``consensus.durable.AckGate``): pysyncobj sends them
from inside the message handler, right after appending, with no hook between.
"""
from __future__ import annotations

from typing import Any

from pysyncobj.monotonic import monotonic
from pysyncobj.transport import TCPTransport

from .durable import AckGate, JournalFailure

# SyncObj ignores message types it does not know, so peers only see a read.
KEEPALIVE_MESSAGE = {"type": "pdparams_keepalive"}


class KeepaliveTCPTransport(TCPTransport):  # type: ignore[misc]
    """TCPTransport plus a periodic keepalive on every connected peer link."""

    keepalive_period: float = 0.3
    ack_gate: AckGate | None = None  # None: answers go out at once (in-memory or legacy use)

    def __init__(self, syncObj: Any, selfNode: Any, otherNodes: Any) -> None:  # noqa: N803 - pysyncobj's names
        self._next_keepalive = 0.0
        super().__init__(syncObj, selfNode, otherNodes)
        if self.ack_gate is not None:
            self.ack_gate.attach(lambda node, message: TCPTransport.send(self, node, message))

    def send(self, node: Any, message: Any) -> bool:
        gate = self.ack_gate
        if gate is not None and gate.holds(message):
            gate.hold(node, message)
            return True  # as far as pysyncobj can tell, sent: it never reads the outcome of an answer
        return bool(super().send(node, message))

    def _onTick(self) -> None:  # noqa: N802 - overrides pysyncobj
        if self.ack_gate is not None:
            # Runs right before pysyncobj polls: the sync of what this tick appended overlaps
            # with the followers' syncs of the entries just sent to them.
            try:
                self.ack_gate.flush()
            except JournalFailure:
                return  # logged by the journal; DurableSyncObj stops the node at its next tick
        super()._onTick()
        now = monotonic()
        if now < self._next_keepalive:
            return
        self._next_keepalive = now + self.keepalive_period
        for node in list(self._nodes):
            # Only links past the handshake (and the key exchange, with a secret):
            # a message sent earlier would break the exchange. send() also checks
            # the read timeout, so a silent link is detected here.
            if self._syncObj.isNodeConnected(node):
                self.send(node, KEEPALIVE_MESSAGE)


def transport_class(keepalive_period: float, ack_gate: AckGate | None = None) -> type[KeepaliveTCPTransport]:
    """A transport class bound to one period and gate (pysyncobj instantiates the class itself)."""
    return type("KeepaliveTCPTransport", (KeepaliveTCPTransport,),
                {"keepalive_period": keepalive_period, "ack_gate": ack_gate})
