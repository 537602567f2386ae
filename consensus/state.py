"""The replicated metadata state machine: plain Python, no sockets, no threads, no clocks.

Every replica applies the same commands in the same order and must end in the
same state, so ``apply`` reads nothing but its command and the current state:
timestamps (``created_at``, ``when``) come in the command from the proposer.

Rules for ``latest``: it follows the newest non-forced version. ``set_tag`` or
``rollback_tag`` on ``latest`` pins it: it then stays where it was put until it
is set or rolled back again. ``delete_tag`` on ``latest`` unpins it, and it
points at the newest non-forced version again (or disappears if there is none).
"""
from __future__ import annotations

import copy
from collections import OrderedDict
from typing import Any, Callable, Mapping

from .clock import Ordering, VectorClock
from .errors import Conflict, Invalid, MetadataError, NotFound
from .validation import (
    check_address,
    check_count,
    check_manifest_id,
    check_name,
    check_timestamp,
    check_version_number,
)

LATEST = "latest"
# How commit_version derives a version's clock; the proposer names the rule in the command, so a
# journal replays to the clocks it was acknowledged with. 1: a plain increment, given a key of its
# own only when it repeats a sibling's clock exactly. 2: a plain increment, given a key of its own
# when another version holds the publisher's count (see _forks); it grew a line's clock by a key per
# commit after a fork. 3: as 2, counting in the line's own key (see _line_key). Commands without the
# field are rule 1. A server applies every rule up to CLOCK_RULE; a leader proposes the highest rule
# that every member's record says it applies (proposal_clock_rule), so a server from before a rule
# never replays a command to another clock than its peers.
CLOCK_RULES = (1, 2, 3)
CLOCK_RULE = 3  # the highest rule this code applies
MAX_CLOCK_RULE = 1000  # what a member record may claim: later code may know more rules than this one
MEMBER_STATES = ("up", "leaving")
SNAPSHOT_FORMAT = 1
# Bounded so that a long-lived tag or a busy cluster cannot grow the full dump forever.
MAX_TAG_HISTORY = 1000
MAX_RECENT_REQUESTS = 4096

ERRORS: dict[str, type[MetadataError]] = {cls.__name__: cls for cls in (NotFound, Conflict, Invalid, MetadataError)}

Command = Mapping[str, Any]


class MetadataState:
    """Models, versions, tags (with history) and members, as plain dicts."""

    def __init__(self) -> None:
        self._models: dict[str, dict[str, Any]] = {}
        self._members: dict[str, dict[str, Any]] = {}
        # request id -> outcome, so that a write retried after a lost reply applies once.
        self._recent: OrderedDict[str, list[Any]] = OrderedDict()
        self._ops: dict[str, Callable[[Command], Any]] = {
            "commit_version": self._commit_version,
            "set_tag": self._set_tag,
            "rollback_tag": self._rollback_tag,
            "delete_tag": self._delete_tag,
            "delete_version": self._delete_version,
            "add_member": self._add_member,
            "remove_member": self._remove_member,
            "barrier": lambda command: None,
        }

    # ------------------------------------------------------------------ apply
    def apply(self, command: Command) -> Any:
        """Apply one command; return its result (plain data) or raise a MetadataError.

        A failed command leaves the state untouched.
        """
        if not isinstance(command, Mapping):
            raise Invalid(f"a command must be a mapping, got {type(command).__name__}")
        request_id = command.get("request_id")
        if request_id is not None:
            if not isinstance(request_id, str) or not request_id:
                raise Invalid(f"request_id must be a non-empty string, got {request_id!r}")
            if request_id in self._recent:
                return self._replay(self._recent[request_id])
        op = command.get("op")
        handler = self._ops.get(op) if isinstance(op, str) else None
        if handler is None:
            raise Invalid(f"unknown command {op!r}; expected one of {sorted(self._ops)}")
        try:
            result = handler(command)
        except MetadataError as exc:
            self._remember(request_id, ["error", type(exc).__name__, str(exc)])
            raise
        self._remember(request_id, ["ok", copy.deepcopy(result)])
        return result

    def _remember(self, request_id: str | None, outcome: list[Any]) -> None:
        if request_id is None:
            return
        self._recent[request_id] = outcome
        while len(self._recent) > MAX_RECENT_REQUESTS:
            self._recent.popitem(last=False)

    @staticmethod
    def _replay(outcome: list[Any]) -> Any:
        if outcome[0] == "ok":
            return copy.deepcopy(outcome[1])
        raise ERRORS.get(outcome[1], MetadataError)(outcome[2])

    # --------------------------------------------------------------- commands
    def _commit_version(self, c: Command) -> dict[str, Any]:
        model_name = check_name("model name", c.get("model"))
        manifest_id = check_manifest_id(c.get("manifest_id"))
        publisher = check_name("publisher", c.get("publisher"))
        nbytes = check_count("nbytes", c.get("nbytes"))
        chunk_count = check_count("chunk_count", c.get("chunk_count"))
        created_at = check_timestamp("created_at", c.get("created_at"))
        force = _flag("force", c.get("force", False))
        tag = c.get("tag")
        if tag is not None:
            check_name("tag", tag)
        parent = c.get("parent")
        model = self._models.get(model_name)
        versions: dict[int, dict[str, Any]] = model["versions"] if model else {}

        if parent is None:
            parent_clock = VectorClock()
        else:
            check_version_number("parent", parent)
            if parent not in versions:
                raise NotFound(f"parent version {model_name}:{parent} does not exist; pull the model again and commit on its head")
            parent_clock = VectorClock(versions[parent]["clock"])
        rule = c.get("clock_rule", 1)
        if rule not in CLOCK_RULES:
            raise Invalid(f"clock_rule must be one of {CLOCK_RULES}, got {rule!r}; upgrade this server")
        number = model["next_number"] if model else 1
        key = _line_key(parent_clock, publisher) if rule >= 3 else publisher
        clock = parent_clock.increment(key)
        if rule >= 2 and _forks(versions, key, clock[key]):
            clock = parent_clock.increment(f"{publisher}/v{number}")

        forced = False
        head = _head(versions)
        if head is not None and parent != head["number"]:
            if clock.compare(head["clock"]) is not Ordering.AFTER:
                if not force:
                    raise Conflict(
                        f"concurrent push to {model_name}: this commit's parent is "
                        f"{_version_label(model_name, parent)} but the head is {model_name}:{head['number']} "
                        f"(clock {dict(head['clock'])} vs {clock.to_dict()}); pull {model_name}:{head['number']}, "
                        "push your change on top of it again (callers of the API may commit with force=True to keep both)"
                    )
                forced = True

        if model is None:
            model = self._models[model_name] = _new_model()
        plain = clock.to_dict()  # stored clocks are to_dict() too: plain dicts compare alike, without a VectorClock each
        if rule == 1 and any(v["clock"] == plain for v in versions.values()):
            # The publisher committed on this parent before (a forced sibling): the plain increment
            # repeats that sibling's clock, and clients refuse a tag move between two versions with
            # one clock. An entry of this version's own keeps it after its parent and concurrent
            # with the sibling, as it is.
            clock = parent_clock.increment(f"{publisher}/v{number}")
        record = {
            "model": model_name,
            "number": number,
            "manifest_id": manifest_id,
            "clock": clock.to_dict(),
            "parent": parent,
            "created_at": created_at,
            "nbytes": nbytes,
            "chunk_count": chunk_count,
            "publisher": publisher,
            "forced": forced,
        }
        model["versions"][number] = record
        model["next_number"] = number + 1
        if not forced and not model["latest_pinned"]:
            _move_tag(model, model_name, LATEST, number, publisher, created_at)
        if tag is not None:
            _move_tag(model, model_name, tag, number, publisher, created_at)
            if tag == LATEST:
                model["latest_pinned"] = True
        return copy.deepcopy(record)

    def _set_tag(self, c: Command) -> dict[str, Any]:
        model_name, tag, who, when = self._tag_args(c)
        number = check_version_number("version", c.get("version"))
        model = self._model(model_name)
        if number not in model["versions"]:
            raise NotFound(f"version {model_name}:{number} does not exist; list the versions of {model_name}")
        _move_tag(model, model_name, tag, number, who, when)
        if tag == LATEST:
            model["latest_pinned"] = True
        return copy.deepcopy(model["tags"][tag])

    def _rollback_tag(self, c: Command) -> dict[str, Any]:
        model_name, tag, who, when = self._tag_args(c)
        model = self._model(model_name)
        record = _tag(model, model_name, tag)
        previous: list[int] = record["previous"]
        keep = _rollback_depth(model, record)
        if not keep:
            raise Conflict(f"tag {model_name}:{tag} has no earlier target to roll back to; point it at a version with "
                           f"'paramctl tag {model_name} {tag} VERSION'")
        target = previous[keep - 1]
        del previous[keep - 1:]
        _move_tag(model, model_name, tag, target, who, when, remember=False)
        if tag == LATEST:
            model["latest_pinned"] = True
        return copy.deepcopy(record)

    def _delete_tag(self, c: Command) -> None:
        model_name, tag, who, when = self._tag_args(c)
        model = self._model(model_name)
        record = _tag(model, model_name, tag)
        if tag == LATEST:
            model["latest_pinned"] = False
            head = _head(model["versions"])
            if head is not None:
                _move_tag(model, model_name, LATEST, head["number"], who, when)
                return None
        record["history"].append(_move(record["version"], None, who, when))
        # Kept so that a tag re-created later shows its whole history.
        model["tag_graveyard"][tag] = record["history"][-MAX_TAG_HISTORY:]
        del model["tags"][tag]
        return None

    def _delete_version(self, c: Command) -> None:
        model_name = check_name("model name", c.get("model"))
        number = check_version_number("version", c.get("version"))
        model = self._model(model_name)
        if number not in model["versions"]:
            raise NotFound(f"version {model_name}:{number} does not exist; list the versions of {model_name}")
        pointing = sorted(t for t, r in model["tags"].items() if r["version"] == number)
        if pointing:
            raise Conflict(
                f"version {model_name}:{number} is still tagged {', '.join(pointing)}; "
                "move or delete those tags first"
            )
        del model["versions"][number]
        return None

    def _add_member(self, c: Command) -> None:
        record = self.check_add_member(c)
        self._members[record["server_id"]] = record
        return None

    def check_add_member(self, c: Command) -> dict[str, Any]:
        """Validate an add_member command against the current members without applying it.

        The node calls it before joining a new address to Raft, so that a bad record
        cannot leave a Raft member without a member record.
        """
        server_id = check_name("server id", c.get("server_id"))
        grpc_address = check_address("grpc address", c.get("grpc_address"))
        raft_address = check_address("raft address", c.get("raft_address"))
        state = c.get("state", "up")
        if state not in MEMBER_STATES:
            raise Invalid(f"member state must be one of {MEMBER_STATES}, got {state!r}")
        zone = c.get("zone", "")
        if not isinstance(zone, str) or len(zone) > 128:
            raise Invalid(f"zone must be a string of at most 128 chars, got {zone!r}")
        # optional: "" means the member serves chunk bytes over gRPC only
        bulk_address = c.get("bulk_address", "") or ""
        if bulk_address:
            bulk_address = check_address("bulk address", bulk_address)
        clock_rule = c.get("clock_rule", 1)  # records from before the field: a server that applies rule 1 only
        if isinstance(clock_rule, bool) or not isinstance(clock_rule, int) or not 1 <= clock_rule <= MAX_CLOCK_RULE:
            raise Invalid(f"clock_rule must be an integer from 1 to {MAX_CLOCK_RULE}, got {clock_rule!r}")
        for other in self._members.values():
            if other["server_id"] != server_id and other["raft_address"] == raft_address:
                raise Conflict(
                    f"raft address {raft_address} already belongs to member {other['server_id']}; "
                    "remove that member first or pick another address"
                )
        current = self._members.get(server_id)
        if current is not None and current["raft_address"] != raft_address:
            raise Conflict(
                f"member {server_id} has raft address {current['raft_address']}; to move it, "
                "remove the member and add it again"
            )
        return {"server_id": server_id, "grpc_address": grpc_address, "raft_address": raft_address,
                "state": state, "zone": zone, "bulk_address": bulk_address, "clock_rule": clock_rule}

    def _remove_member(self, c: Command) -> None:
        server_id = check_name("server id", c.get("server_id"))
        if server_id not in self._members:
            raise NotFound(f"member {server_id!r} does not exist; list the members to see their ids")
        del self._members[server_id]
        return None

    # ------------------------------------------------------------------ reads
    def get_version(self, model: str, number: int) -> dict[str, Any]:
        versions = self._model(model)["versions"]
        if number not in versions:
            raise NotFound(f"version {model}:{number} does not exist; list the versions of {model}")
        return copy.deepcopy(versions[number])

    def resolve_tag(self, model: str, tag: str) -> dict[str, Any]:
        record = _tag(self._model(model), model, tag)
        return self.get_version(model, record["version"])

    def get_tag(self, model: str, tag: str) -> dict[str, Any]:
        return copy.deepcopy(_tag(self._model(model), model, tag))

    def head(self, model: str) -> dict[str, Any] | None:
        """The newest non-forced version: what a commit's parent must be to avoid a conflict."""
        head = _head(self._model(model)["versions"])
        return dict(copy.deepcopy(head)) if head is not None else None

    def latest_pinned(self, model: str) -> bool:
        return bool(self._model(model)["latest_pinned"])

    def list_models(self) -> list[str]:
        return sorted(self._models)

    def list_versions(self, model: str) -> list[dict[str, Any]]:
        versions = self._model(model)["versions"]
        return [copy.deepcopy(versions[n]) for n in sorted(versions)]

    def list_tags(self, model: str) -> list[dict[str, Any]]:
        """The tags, each with ``rollback_to``: where a rollback would move it (None: nowhere)."""
        m = self._model(model)
        out = []
        for name in sorted(m["tags"]):
            record = copy.deepcopy(m["tags"][name])
            depth = _rollback_depth(m, record)
            record["rollback_to"] = record["previous"][depth - 1] if depth else None
            out.append(record)
        return out

    def members(self) -> list[dict[str, Any]]:
        return [dict(self._members[s]) for s in sorted(self._members)]

    def proposal_clock_rule(self) -> int:
        """The clock rule a leader proposes: the highest that this code and every member apply."""
        rules = [m.get("clock_rule", 1) for m in self._members.values()]
        return min([CLOCK_RULE, *rules]) if rules else 1

    def member(self, server_id: str) -> dict[str, Any]:
        if server_id not in self._members:
            raise NotFound(f"member {server_id!r} does not exist; list the members to see their ids")
        return dict(self._members[server_id])

    # --------------------------------------------------------------- snapshot
    def snapshot(self) -> dict[str, Any]:
        """The whole state as JSON-compatible plain data (lists instead of int-keyed dicts)."""
        return {
            "format": SNAPSHOT_FORMAT,
            "models": {
                name: {
                    "next_number": m["next_number"],
                    "latest_pinned": m["latest_pinned"],
                    "versions": [copy.deepcopy(m["versions"][n]) for n in sorted(m["versions"])],
                    "tags": [copy.deepcopy(m["tags"][t]) for t in sorted(m["tags"])],
                    "tag_graveyard": copy.deepcopy(m["tag_graveyard"]),
                }
                for name, m in sorted(self._models.items())
            },
            "members": self.members(),
            "recent": [[rid, copy.deepcopy(outcome)] for rid, outcome in self._recent.items()],
        }

    def restore(self, snapshot: Mapping[str, Any]) -> None:
        """Replace the whole state with one produced by ``snapshot()``."""
        if snapshot.get("format") != SNAPSHOT_FORMAT:
            raise Invalid(f"unknown snapshot format {snapshot.get('format')!r}; expected {SNAPSHOT_FORMAT}")
        models: dict[str, dict[str, Any]] = {}
        for name, m in snapshot["models"].items():
            models[name] = {
                "next_number": int(m["next_number"]),
                "latest_pinned": bool(m["latest_pinned"]),
                "versions": {int(v["number"]): copy.deepcopy(dict(v)) for v in m["versions"]},
                "tags": {t["tag"]: copy.deepcopy(dict(t)) for t in m["tags"]},
                "tag_graveyard": copy.deepcopy(dict(m.get("tag_graveyard", {}))),
            }
        self._models = models
        self._members = {m["server_id"]: dict(m) for m in snapshot["members"]}
        self._recent = OrderedDict((rid, list(outcome)) for rid, outcome in snapshot.get("recent", []))

    # ---------------------------------------------------------------- helpers
    def _model(self, name: str) -> dict[str, Any]:
        model = self._models.get(name)
        if model is None:
            raise NotFound(f"model {name!r} does not exist; list the models or push it first")
        return model

    @staticmethod
    def _tag_args(c: Command) -> tuple[str, str, str, float]:
        return (
            check_name("model name", c.get("model")),
            check_name("tag", c.get("tag")),
            check_name("who", c.get("who")),
            check_timestamp("when", c.get("when")),
        )


def _new_model() -> dict[str, Any]:
    return {"versions": {}, "next_number": 1, "tags": {}, "latest_pinned": False, "tag_graveyard": {}}


def _line_key(parent_clock: Mapping[str, int], publisher: str) -> str:
    """The key ``publisher`` counts in on the parent's line: the newest key of its own (``alice/v7``,
    started where its count forked), else its name. Counting on in that key keeps a line's clock at
    one key per fork, however many commits follow."""
    prefix = publisher + "/v"
    forks = [int(k[len(prefix):]) for k in parent_clock if k.startswith(prefix) and k[len(prefix):].isdigit()]
    return f"{prefix}{max(forks)}" if forks else publisher


def _forks(versions: Mapping[int, Mapping[str, Any]], key: str, counter: int) -> bool:
    """Whether the next count in ``key`` on a parent is already held by another version.

    A vector clock counts each publisher's versions on one line. When a publisher commits again on
    an older version (a forced sibling), its increment reuses a count that a version off this line
    already holds, and a later commit on the sibling would then compare after that version without
    containing it (the conflict check waved it through and ``latest`` moved over it). Such a commit
    starts a key of its own instead. No ancestor can hold the count: an ancestor's count in ``key``
    is at most the parent's, one less than ``counter``."""
    return any(v["clock"].get(key, 0) >= counter for v in versions.values())


def _head(versions: Mapping[int, Mapping[str, Any]]) -> Mapping[str, Any] | None:
    numbers = [n for n, v in versions.items() if not v["forced"]]
    return versions[max(numbers)] if numbers else None


def _tag(model: Mapping[str, Any], model_name: str, tag: str) -> dict[str, Any]:
    record: dict[str, Any] | None = model["tags"].get(tag)
    if record is None:
        raise NotFound(f"tag {model_name}:{tag} does not exist; list the tags of {model_name}")
    return record


def _move(from_version: int | None, to_version: int | None, who: str, when: float) -> dict[str, Any]:
    return {"from_version": from_version, "to_version": to_version, "who": who, "when": when}


def _move_tag(
    model: dict[str, Any], model_name: str, tag: str, to: int, who: str, when: float, *, remember: bool = True
) -> None:
    record = model["tags"].get(tag)
    if record is None:
        history = model["tag_graveyard"].pop(tag, [])
        record = model["tags"][tag] = {"model": model_name, "tag": tag, "version": to, "history": history, "previous": []}
        record["history"].append(_move(None, to, who, when))
        return
    current = record["version"]
    if current == to:
        return
    if remember:
        record["previous"].append(current)
        del record["previous"][:-MAX_TAG_HISTORY]
    record["version"] = to
    record["history"].append(_move(current, to, who, when))
    del record["history"][:-MAX_TAG_HISTORY]


def _rollback_depth(model: dict[str, Any], record: dict[str, Any]) -> int:
    """How much of the tag's ``previous`` stack a rollback keeps: earlier targets deleted since are skipped."""
    previous: list[int] = record["previous"]
    keep = len(previous)
    while keep and previous[keep - 1] not in model["versions"]:
        keep -= 1
    return keep


def _flag(kind: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise Invalid(f"{kind} must be true or false, got {value!r}")
    return value


def _version_label(model: str, number: int | None) -> str:
    return f"{model}:{number}" if number is not None else "nothing (a first push)"
