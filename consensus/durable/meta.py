"""The term / vote / commit-index file (``raft.journal.meta``): CRC-checked JSON, replaced durably."""
from __future__ import annotations

import json
import zlib
from typing import Any, Mapping

from pysyncobj.pickle import loads as _pso_loads

from ..errors import DamagedState
from .files import write_file_durably

META_FORMAT = "pdparams-raft-meta/1"
_META_TYPES: dict[str, tuple[type, ...]] = {
    "currentTerm": (int,), "votedForNodeId": (str, type(None)), "raftCommitIndex": (int,),
}


# What a damaged-state message tells the operator. An older copy of the journal is no safer than
# none: either way this server forgets entries it acknowledged, which is harmless only while the
# rest of the cluster holds them (a push acknowledged by it and one other member was lost so).
RECOVERY_ADVICE = (
    "If every other member is up and follows the leader ('paramctl status'), move this server's raft folder away "
    "so that it rejoins empty and catches up. Do not restore an older copy, and do neither while another member "
    "is down: a majority without the entries this server acknowledged could then drop them"
)


def encode_meta(meta: Mapping[str, Any]) -> bytes:
    state = {k: meta[k] for k in _META_TYPES if k in meta}
    body = json.dumps(state, sort_keys=True, separators=(",", ":"))
    return json.dumps({"format": META_FORMAT, "crc32": zlib.crc32(body.encode()), "state": state},
                      sort_keys=True, separators=(",", ":")).encode() + b"\n"


def decode_meta(raw: bytes, path: str) -> dict[str, Any]:
    """The meta dict in ``raw``; DamagedState naming ``path`` if it is not exactly what was written.

    Also reads the pickle that pysyncobj's own MetaStorer wrote, so that data dirs from before
    this module keep their vote.
    """
    def damaged(why: str) -> DamagedState:
        return DamagedState(
            f"Raft term/vote file {path} is damaged ({why}); refusing to start, since starting without it "
            f"could forget this server's vote. {RECOVERY_ADVICE}"
        )

    if raw.startswith(b"{"):
        try:
            doc = json.loads(raw)
            state = doc["state"]
            crc = doc["crc32"]
            fmt = doc["format"]
        except (ValueError, KeyError, TypeError) as exc:
            raise damaged(f"not valid JSON: {exc}") from None
        if fmt != META_FORMAT:
            raise damaged(f"unknown format {fmt!r}")
        if not isinstance(state, dict):
            raise damaged("no state object")
        body = json.dumps(state, sort_keys=True, separators=(",", ":"))
        if zlib.crc32(body.encode()) != crc:
            raise damaged("checksum mismatch")
    else:
        try:
            state = _pso_loads(raw)  # pysyncobj's own format: a pickled dict in our own data dir
        except Exception as exc:  # noqa: BLE001 - any unpickling failure means the same thing here
            raise damaged(f"neither pdparams' JSON meta format nor pysyncobj's pickle: {type(exc).__name__}") from None
        if not isinstance(state, dict):
            raise damaged(f"pysyncobj pickle holds a {type(state).__name__}, not a dict")
    for key, types in _META_TYPES.items():
        if key in state and (not isinstance(state[key], types) or isinstance(state[key], bool)):
            raise damaged(f"{key} is {state[key]!r}")
    if state.get("currentTerm", 0) < 0 or state.get("raftCommitIndex", 1) < 1:
        raise damaged(f"impossible values {state!r}")
    return {k: state[k] for k in _META_TYPES if k in state}


class MetaFile:
    """Term, vote and commit index of one node, stored the way pysyncobj's MetaStorer names them."""

    def __init__(self, path: str, *, fsync: bool) -> None:
        self.path = path
        self.fsync = fsync

    def load(self) -> dict[str, Any] | None:
        """The stored meta; None if there is no file (a node that never stored a term)."""
        try:
            with open(self.path, "rb") as f:
                raw = f.read()
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise DamagedState(
                f"cannot read Raft term/vote file {self.path}: {exc.strerror or exc}; refusing to start without it"
            ) from None
        return decode_meta(raw, self.path)

    def store(self, meta: Mapping[str, Any]) -> None:
        write_file_durably(self.path, encode_meta(meta), fsync=self.fsync)
