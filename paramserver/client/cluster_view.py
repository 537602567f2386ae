"""The client's view of a cluster: members, ring, R/W, the leader, and one client per member.

The membership and leader part of the client session (``ClusterClient.view()``): push, paramctl
and the fetch engine use the session's view; a ClusterView is rarely made on its own.

Built from ClusterInfo of any seed, so ``paramctl --cluster`` needs only one
reachable member. The ring is built from the members whose state is "up",
exactly as the servers build theirs (paramserver.server.cluster.PeerSet.ring), so the
client places chunks where the servers' quorum check looks for them.
"""
from __future__ import annotations

import atexit
import queue
import threading
import time
import weakref
from collections.abc import Callable, Generator, Mapping, Sequence
from concurrent.futures import Future
from contextlib import closing
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any, TypeAlias, TypeVar

import grpc

from chunking.chunk_table import ChunkRows
from paramserver.client.fetch_plan import Wants, wants_on_ring
from paramserver.client.rpc import ClientConfig, ParamServerClient
from paramserver.wire.limits import DEFAULT_MAX_MESSAGE_BYTES, MAX_HOT_CHUNKS_ADVERTISED, MAX_HOT_CHUNKS_KEPT
from paramserver.client.errors import ClientClosed, ConfigError
from paramserver.client.failover import FailoverPolicy, LeaderFailover, best_answer
from paramserver.wire.proto import pb
from paramserver.wire.ring import Ring, RingConfig, replication_and_quorum
from paramserver.client.errors import ClusterUnreachable, TransferError, rpc_code, rpc_details

T = TypeVar("T")
# what leader_call waits on: (kind "call" or "ask", address, the future that ended)
_Events: TypeAlias = "queue.SimpleQueue[tuple[str, str, Future[Any] | grpc.Future[Any]]]"

# Codes after which another seed (or a later try) may answer.
RETRYABLE = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED})


def parse_seeds(seeds: str | Sequence[str]) -> tuple[str, ...]:
    """"a:1,b:2" or ["a:1", "b:2"] -> ("a:1", "b:2"), each checked as HOST:PORT."""
    items = seeds.split(",") if isinstance(seeds, str) else [s for part in seeds for s in part.split(",")]
    out = tuple(dict.fromkeys(s.strip() for s in items if s.strip()))
    if not out:
        raise ConfigError("no cluster address given: pass --cluster HOST:PORT (any member) or set PARAMS_CLUSTER")
    for address in out:
        ClientConfig(address).validate()
    return out


@dataclass(frozen=True)
class ClusterOptions:
    seeds: tuple[str, ...]
    token: str | None = None
    timeout_s: float = 10.0  # unary calls; commits wait at most ~5 s for Raft
    discovery_timeout_s: float = 3.0  # ClusterInfo from a seed: a silent (partitioned) seed must not stall a push
    tls: bool = False  # TLS (system roots unless tls_ca); also implied by tls_ca or tls_cert
    tls_ca: Path | None = None  # the cluster's CA: server certificates must chain to it
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    tls_cert: Path | None = None  # mutual TLS: the client certificate and its key
    tls_key: Path | None = None
    # Called with one line when a leader call has waited a while with no leader to call (a lost
    # quorum, a long election): the CLIs print it, so a wait of up to 3 x timeout_s is not silent.
    notice: Callable[[str], None] | None = field(default=None, compare=False, repr=False)

    def validate(self) -> ClusterOptions:
        if not self.seeds:
            raise ConfigError("no cluster address given: pass --cluster HOST:PORT (any member) or set PARAMS_CLUSTER")
        if self.timeout_s <= 0 or self.discovery_timeout_s <= 0:
            raise ConfigError(f"timeouts must be > 0 seconds, got {self.timeout_s} and {self.discovery_timeout_s}")
        for address in self.seeds:
            ClientConfig(address).validate()
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ConfigError("tls_cert and tls_key (the client certificate and its key) must be given together")
        return self

    def client_config(self, address: str) -> ClientConfig:
        return ClientConfig(
            address, token=self.token, timeout_s=self.timeout_s, tls=self.tls or self.tls_cert is not None, tls_ca=self.tls_ca,
            client_cert=self.tls_cert, client_key=self.tls_key, max_message_bytes=self.max_message_bytes,
        )  # fmt: skip


class ClusterView:
    """Members and placement as one seed reported them; clients are made lazily and reused."""

    # How leader_call follows the leader through an election; set on an instance to tune one view.
    failover: FailoverPolicy = FailoverPolicy()

    def __init__(self, options: ClusterOptions, info: pb.ClusterInfoReply, first: ParamServerClient) -> None:
        self.options = options
        self._lock = threading.Lock()
        self._clients: dict[str, ParamServerClient] = {first.address: first}
        self._closed = False
        self._apply(info)

    @classmethod
    def connect(cls, options: ClusterOptions) -> ClusterView:
        """ClusterInfo from the seeds, asked all at once; the first answer that names a leader wins
        (the newest term among the answers in by then).

        UNAUTHENTICATED and the like fail at once; a seed that is down or cut off costs nothing
        once another has answered (at most ``failover.ask_timeout_s`` while the answers name no
        leader yet), and ``discovery_timeout_s`` when none does.
        """
        options.validate()
        clients = {a: ParamServerClient(replace(options.client_config(a), timeout_s=options.discovery_timeout_s)) for a in options.seeds}
        errors: list[str] = []
        answers: list[tuple[str, pb.ClusterInfoReply]] = []
        try:
            patience = cls.failover.ask_timeout_s  # leaderless answers only (an election): wait this much for a leader
            with closing(_ask_cluster_info(clients, options.discovery_timeout_s, patience=patience)) as replies:
                for address, got in replies:
                    if isinstance(got, grpc.RpcError):
                        # UNIMPLEMENTED: that address is no paramserver; another seed may be.
                        if rpc_code(got) not in RETRYABLE and rpc_code(got) != grpc.StatusCode.UNIMPLEMENTED:
                            raise TransferError(f"{address}: {rpc_details(got)}", rpc_code(got)) from None
                        errors.append(f"{address} ({rpc_code(got).name.lower()})")
                        continue
                    answers.append((address, got))
                    if got.leader_id:
                        break
        finally:
            for c in clients.values():
                c.close()  # also cancels the questions still out (silent seeds)
        pick = best_answer((info.leader_grpc_address, info.term, info.is_leader) for _address, info in answers)
        if pick is None:
            raise ClusterUnreachable(
                f"no cluster member answered at {', '.join(errors)}; check --cluster (any member's gRPC address) and that the servers run"
            )
        address, info = answers[pick]
        return cls(options, info, ParamServerClient(options.client_config(address)))

    def leader_call(
        self, fn: Callable[[ParamServerClient], T], deadline_s: float | None = None, *,
        before_resend: Callable[[], T | None] | None = None, suspect: bool = False,
    ) -> T:
        """``fn(leader client)``, following the leader through an election.

        ``fn`` runs on a helper thread while this one watches (``failover.LeaderFailover``
        decides): unanswered for ``failover.ask_after_s``, or failed with UNAVAILABLE or
        DEADLINE_EXCEEDED, the other members are asked who leads, and ``fn`` moves to a leader
        named with a newer term as soon as one answers, so a silent (partitioned) leader costs
        an election, not a deadline. A try that failed that way, or was abandoned by a move, may
        still take effect: ``before_resend()``, when given, runs before ``fn`` is sent again, and
        a value other than None ends the call with it (a write checks whether it landed).
        ``suspect``: the caller has just seen the leader fail (a stream to it broke), so the others
        are asked with the first try instead of after ``ask_after_s``. When the view names no
        leader, ``fn`` waits until a member names one: a member without a leader (cut off with a
        minority) would answer from state that may be stale.
        Raises ``fn``'s error: a non-retryable one at once, the last retryable one at the
        deadline (default 3 x ``timeout_s``); ClusterUnreachable when no try ended by then.
        """
        policy = self.failover
        started = time.monotonic()
        end = started + (deadline_s if deadline_s is not None else self.options.timeout_s * 3)
        target, term = self._believed_leader()
        watch = LeaderFailover(target, term, self._addresses(), policy, now=started, deadline=end, suspect=suspect)
        events: _Events = queue.SimpleQueue()
        current: Future[T] | None = None  # the try in flight to watch.target
        unsure = False  # a try failed or was abandoned: it may still take effect
        last_error: grpc.RpcError | None = None
        while True:
            plan = watch.poll(time.monotonic())
            if plan.give_up:
                break
            if plan.notice and self.options.notice is not None:
                self.options.notice(
                    f"no leader answers yet; {self._who_answers(watch.answering)}; waiting up to "
                    f"{max(0.0, end - time.monotonic()):.0f} s more for one to be elected"
                )
            for address in plan.ask:
                self._ask(address, policy.ask_timeout_s, events)
            if plan.call is not None:
                if unsure and before_resend is not None:
                    found = before_resend()
                    if found is not None:
                        return found
                unsure = False
                leader = self.client(plan.call)
                current = in_thread(partial(fn, leader), f"leader-call-{leader.address}")
                current.add_done_callback(_put_on(events, "call", plan.call))
            try:
                kind, address, f = events.get(timeout=max(0.0, min(plan.wake_at, end) - time.monotonic()))
            except queue.Empty:
                continue
            if kind == "call":
                if current is None or f is not current:
                    continue  # a try abandoned after a move ended late: not this call's outcome
                call, current = current, None
                try:
                    return call.result()
                except grpc.RpcError as exc:
                    if rpc_code(exc) not in RETRYABLE:
                        raise
                    last_error, unsure = exc, True
                    watch.call_failed(time.monotonic())
                continue
            try:
                info = f.result()
            except Exception:  # noqa: BLE001 - a member that cannot answer now (cut off, closed, cancelled)
                watch.ask_failed(address, time.monotonic())
                continue
            if watch.answered(address, info.leader_grpc_address, info.term, time.monotonic(), claims=info.is_leader):
                if current is not None:
                    current, unsure = None, True  # abandoned on the old leader, outcome unknown
                try:
                    self._apply(info)
                except TransferError:
                    pass  # it lists no server up: keep the ring, follow the new leader all the same
        if last_error is not None:
            raise last_error
        if watch.target is None:
            raise ClusterUnreachable(
                f"no cluster member named a leader within {end - started:.1f}s; {self._who_answers(watch.answering)}; "
                "a leader needs a majority of the members up and connected: start the stopped servers or heal the partition"
            )
        raise ClusterUnreachable(
            f"the leader ({watch.target}) did not answer within {end - started:.1f}s and no member named a newer one"
        )

    def _who_answers(self, addresses: Sequence[str]) -> str:
        """'1 of 3 members answer (ps1)': who runs, for a message about a missing leader."""
        names = {m.grpc_address: m.server_id for m in self.members.values()}
        answering = [names.get(a, a) for a in addresses]
        listed = f" ({', '.join(answering)})" if answering else ""
        return f"{len(answering)} of {len(self.members)} members answer{listed}"

    def _believed_leader(self) -> tuple[str | None, int | None]:
        """(the leader's address, its term) as the view knows them; (None, None) when it names none."""
        if self.info.leader_grpc_address:
            return self.info.leader_grpc_address, self.info.term
        return None, None

    def _addresses(self) -> list[str]:
        """Every member's and seed's gRPC address, members first."""
        return list(dict.fromkeys([*(m.grpc_address for m in self.members.values()), *self.options.seeds]))

    def _ask(self, address: str, timeout: float, events: _Events) -> None:
        """ClusterInfo to ``address`` without waiting; its end is put on ``events`` as ("ask", address, future)."""
        try:
            f = self.client(address).stub.ClusterInfo.future(pb.ClusterInfoRequest(), timeout=timeout)
        except Exception as exc:  # noqa: BLE001 - a closed view, a bad address: this member just does not answer
            f = Future()
            f.set_exception(exc)
        f.add_done_callback(_put_on(events, "ask", address))

    def _apply(self, info: pb.ClusterInfoReply) -> None:
        self.info = info
        self.members: dict[str, pb.Member] = {m.server_id: m for m in info.members}
        up = {m.server_id: m.zone for m in info.members if m.state == "up"}
        if not up:
            raise TransferError(f"the cluster reports no member in state 'up' (server {info.server_id}); wait for it to form",
                                grpc.StatusCode.UNAVAILABLE)
        self.ring = Ring(up, RingConfig(vnodes=info.ring.vnodes or RingConfig().vnodes))
        self.replication, self.write_quorum = replication_and_quorum(
            info.ring.replication_factor or 3, info.ring.write_quorum or None, len(self.ring)
        )

    def refresh(self, deadline_s: float = 10.0) -> None:
        """Fetch ClusterInfo again (leader changes), from every member and seed at once.

        The first answer that names a leader in the view's term or a newer one wins; else the best
        there is (an older term, or no leader yet) once all have answered or ``failover.ask_timeout_s``
        after the first answer (members cut off never answer; they must not hold the refresh up).
        """
        end = time.monotonic() + deadline_s
        last = ""
        while True:
            known = self.info.term if self.info.leader_id else -1
            clients = {a: self.client(a) for a in self._addresses()}
            answers: list[pb.ClusterInfoReply] = []
            timeout = max(0.05, min(self.options.discovery_timeout_s, end - time.monotonic()))
            with closing(_ask_cluster_info(clients, timeout, patience=self.failover.ask_timeout_s)) as replies:
                for address, got in replies:
                    if isinstance(got, grpc.RpcError):
                        if rpc_code(got) not in RETRYABLE:
                            raise TransferError(f"{address}: {rpc_details(got)}", rpc_code(got)) from None
                        last = f"{address}: {rpc_details(got)}"
                        continue
                    answers.append(got)
                    if got.is_leader and got.term >= known:
                        break
            pick = best_answer((info.leader_grpc_address, info.term, info.is_leader) for info in answers)
            if pick is not None:
                self._apply(answers[pick])
                return
            if time.monotonic() >= end:
                raise ClusterUnreachable(f"no cluster member answered ClusterInfo within {deadline_s:.0f}s (last: {last})")
            time.sleep(min(0.1, max(0.0, end - time.monotonic())))

    def replicas(self, chunk_id: str) -> list[str]:
        return self.ring.replicas(chunk_id, self.replication)

    def wants(self, chunks: ChunkRows, hot: Mapping[str, Sequence[str]] | None = None) -> Wants:
        """What the fetch planner needs of ``chunks``, placed on this view's ring (``wants_on_ring``)."""
        return wants_on_ring(chunks, self.ring, self.replication, hot)

    def hot_chunks(self, timeout_s: float = 0.5) -> dict[str, tuple[str, ...]]:
        """Hot chunk id -> the members holding an extra copy, merged from every up member's GetHotChunks.

        Asked of all at once; a member that does not answer within ``timeout_s`` (down, cut off, or a
        server from before hot chunks: UNIMPLEMENTED) contributes nothing. Bounded: at most
        MAX_HOT_CHUNKS_ADVERTISED entries from one member and MAX_HOT_CHUNKS_KEPT in all; holders that
        are not members are left out. Soft state: a holder may have dropped its copy meanwhile (it then
        answers MISSING and the read goes to a replica)."""
        asked: list[grpc.Future[pb.GetHotChunksReply]] = []
        for member in self.members.values():
            if member.state != "up":
                continue
            try:
                asked.append(self.client(member.grpc_address).stub.GetHotChunks.future(pb.GetHotChunksRequest(),
                                                                                      timeout=timeout_s))
            except Exception:  # noqa: BLE001 - a closed view, a bad address: no hot copies from it
                continue
        merged: dict[str, list[str]] = {}
        for f in asked:
            try:
                reply = f.result()
            except (grpc.RpcError, grpc.FutureCancelledError):
                continue
            for entry in list(reply.chunks)[:MAX_HOT_CHUNKS_ADVERTISED]:
                holders = merged.get(entry.id)
                if holders is None:
                    if len(merged) >= MAX_HOT_CHUNKS_KEPT:
                        break
                    holders = merged[entry.id] = []
                holders.extend(h for h in entry.holders if h in self.members and h not in holders)
        return {cid: tuple(holders) for cid, holders in merged.items() if holders}

    def client(self, address: str) -> ParamServerClient:
        with self._lock:
            if self._closed:
                raise ClientClosed(f"the cluster view is closed; no new client for {address}")
            found = self._clients.get(address)
            if found is None:
                found = self._clients[address] = ParamServerClient(self.options.client_config(address))
            return found

    def server_client(self, server_id: str) -> ParamServerClient:
        member = self.members.get(server_id)
        if member is None:
            raise TransferError(f"server {server_id!r} is not a member of the cluster", grpc.StatusCode.NOT_FOUND)
        return self.client(member.grpc_address)

    def any_client(self) -> ParamServerClient:
        """The member that answered ClusterInfo last (reads go there)."""
        answered = self.members.get(self.info.server_id)
        if answered is not None:
            return self.client(answered.grpc_address)
        return self.client(self.options.seeds[0])

    def leader_client(self) -> ParamServerClient:
        """The leader's client when known; writes are forwarded by followers anyway."""
        address = self.info.leader_grpc_address
        return self.client(address) if address else self.any_client()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            clients, self._clients = list(self._clients.values()), {}
        for c in clients:
            c.close()

    def __enter__(self) -> ClusterView:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def in_thread(fn: Callable[[], T], name: str) -> Future[T]:
    """Run ``fn()`` on a daemon thread of its own, now; its outcome lands in the returned future."""
    f: Future[T] = Future()

    def run() -> None:
        if not f.set_running_or_notify_cancel():
            return
        try:
            f.set_result(fn())
        except BaseException as exc:  # noqa: BLE001 - whoever waits on the future re-raises it
            f.set_exception(exc)

    start_background(run, name)
    return f


_BACKGROUND: weakref.WeakSet[threading.Thread] = weakref.WeakSet()
EXIT_GRACE_S = 3.0


def start_background(target: Callable[..., object], name: str, *args: object) -> threading.Thread:
    """A daemon thread for client work behind the caller's back (a heat report, a hot-chunks
    refresh), which the interpreter's exit waits for, briefly (``_let_background_calls_end``)."""
    thread = threading.Thread(target=target, args=args, name=name, daemon=True)
    _BACKGROUND.add(thread)
    thread.start()
    return thread


@atexit.register
def _let_background_calls_end() -> None:
    """A daemon thread still inside a gRPC call when the interpreter finalizes makes gRPC's core
    abort the process ("terminate called without an active exception", exit status 134): give
    the background calls up to EXIT_GRACE_S in all to end (a closed client's calls end at once)."""
    end = time.monotonic() + EXIT_GRACE_S
    for thread in list(_BACKGROUND):
        left = end - time.monotonic()
        if left <= 0:
            return
        if thread.is_alive() and thread is not threading.current_thread():
            thread.join(left)


def _put_on(events: _Events, kind: str, address: str) -> Callable[[Future[Any] | grpc.Future[Any]], None]:
    """A done-callback that reports (kind, address, future) to the leader_call loop."""
    return lambda f: events.put((kind, address, f))


def _ask_cluster_info(
    clients: Mapping[str, ParamServerClient], timeout: float, patience: float | None = None
) -> Generator[tuple[str, pb.ClusterInfoReply | grpc.RpcError], None, None]:
    """ClusterInfo to every client at once; yields (address, reply or error) as each ends, fastest
    first; with ``patience``, stops that long after the first reply instead of waiting for silent
    members to time out. Questions still out when the caller stops reading are cancelled."""
    done: queue.SimpleQueue[tuple[str, grpc.Future[pb.ClusterInfoReply]]] = queue.SimpleQueue()
    futures: list[grpc.Future[pb.ClusterInfoReply]] = []
    for address, c in clients.items():
        f = c.stub.ClusterInfo.future(pb.ClusterInfoRequest(), timeout=timeout)
        futures.append(f)
        f.add_done_callback(lambda f, a=address: done.put((a, f)))
    end = time.monotonic() + timeout + 1.0  # each ends by its deadline; this only bounds a lost callback
    try:
        for _ in futures:
            try:
                address, f = done.get(timeout=max(0.0, end - time.monotonic()))
            except queue.Empty:
                return
            try:
                reply = f.result()
            except grpc.RpcError as exc:
                yield address, exc
                continue
            except grpc.FutureCancelledError:
                continue
            if patience is not None:
                end = min(end, time.monotonic() + patience)
            yield address, reply
    finally:
        for f in futures:
            f.cancel()


__all__ = ["ClusterOptions", "ClusterView", "in_thread", "parse_seeds", "RETRYABLE"]
