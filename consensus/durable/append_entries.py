"""Raft's AppendEntries rule 3 for pysyncobj: entries a follower already holds are not truncated.

pysyncobj 0.3.17 deletes every entry after ``prevLogIdx`` whenever its log is longer, even when
the entries there are the very ones the message carries again. A leader re-sends entries whose
answers it has not seen yet (the acknowledgement gate holds a follower's answer until its journal
is synced), so on a healthy cluster a follower that had already applied them truncated applied
entries, re-added the same ones and logged CRITICAL "state machine may have diverged": a false
alarm, and journal work for nothing. Raft deletes an entry only when it conflicts (same index,
another term); ``trim`` rewrites such a message into the one pysyncobj handles that way:

- the leading entries the follower holds with the same term are dropped, and ``prevLogIdx`` /
  ``prevLogTerm`` move to the last of them (Log Matching: the same index and term mean the same
  entry and the same log before it);
- when every carried entry is held and the follower's log goes on past them with entries of the
  sender's own term, those came from this same leader (one leader per term, which never
  rewrites its log), so the message is only a heartbeat: ``prevLogIdx`` moves to the follower's
  last entry and nothing is deleted. A tail of an older term is left to pysyncobj, which deletes
  it as Raft would once a conflicting entry arrives.

A message that conflicts is passed on as it is: a truncation of applied entries is then a real
divergence and keeps its CRITICAL line.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

Entry = tuple[Any, int, int]  # pysyncobj's (command, index, term)


def trim(message: dict[str, Any], term_at: Callable[[int], int | None], last_index: int) -> dict[str, Any]:
    """``message`` (an ``append_entries`` dict), rewritten so that pysyncobj keeps the entries this
    follower already holds. ``term_at(i)``: the term of the follower's entry ``i`` (None: none
    there, or compacted away); ``last_index``: its last entry's index. Returns ``message`` itself
    when nothing changes, else a copy."""
    if message.get("type") != "append_entries" or "prevLogIdx" not in message or message.get("transmission") is not None:
        return message  # another message, a snapshot, or a large entry sent in parts: pysyncobj's as they are
    prev_idx, prev_term = int(message["prevLogIdx"]), message["prevLogTerm"]
    if last_index <= prev_idx or term_at(prev_idx) != prev_term:
        return message  # nothing past prevLogIdx here, or a mismatch pysyncobj answers itself
    entries: Sequence[Entry] = message.get("entries", [])
    held = 0
    for _command, index, term in entries:
        if index > last_index or term_at(index) != term:
            break
        held += 1
    if held:
        prev_idx, prev_term = entries[held - 1][1], entries[held - 1][2]
    rest = list(entries[held:])
    if not rest and last_index > prev_idx and term_at(last_index) == message.get("term"):
        prev_idx, prev_term = last_index, term_at(last_index)
    if prev_idx == message["prevLogIdx"]:
        return message
    return {**message, "prevLogIdx": prev_idx, "prevLogTerm": prev_term, "entries": rest}


__all__ = ["trim"]
