"""The client's view of a cluster: members, ring, R/W, and one client per member.

Built from ClusterInfo of any seed, so ``paramctl --cluster`` needs only one
reachable member. The ring is built from the members whose state is "up",
exactly as the servers build theirs (paramserver.cluster.PeerSet.ring), so the
client places chunks where the servers' quorum check looks for them.
"""
from __future__ import annotations

import threading
import time
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Sequence, TypeVar

import grpc

from .client import ClientConfig, ParamServerClient
from .config import DEFAULT_MAX_MESSAGE_BYTES
from .errors import ConfigError
from .proto import pb
from .ring import Ring, RingConfig, replication_and_quorum
from .transfer_errors import ClusterUnreachable, TransferError, rpc_code, rpc_details

T = TypeVar("T")

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
    tls: bool = False
    tls_ca: Path | None = None
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES

    def validate(self) -> ClusterOptions:
        if not self.seeds:
            raise ConfigError("no cluster address given: pass --cluster HOST:PORT (any member) or set PARAMS_CLUSTER")
        if self.timeout_s <= 0 or self.discovery_timeout_s <= 0:
            raise ConfigError(f"timeouts must be > 0 seconds, got {self.timeout_s} and {self.discovery_timeout_s}")
        for address in self.seeds:
            ClientConfig(address).validate()
        return self

    def client_config(self, address: str) -> ClientConfig:
        return ClientConfig(
            address, token=self.token, timeout_s=self.timeout_s, tls=self.tls, tls_ca=self.tls_ca, max_message_bytes=self.max_message_bytes
        )


class ClusterView:
    """Members and placement as one seed reported them; clients are made lazily and reused."""

    def __init__(self, options: ClusterOptions, info: pb.ClusterInfoReply, first: ParamServerClient) -> None:
        self.options = options
        self._lock = threading.Lock()
        self._clients: dict[str, ParamServerClient] = {first.address: first}
        self._apply(info)

    @classmethod
    def connect(cls, options: ClusterOptions) -> ClusterView:
        """ClusterInfo from the seeds, asked all at once; the first answer that names a leader wins.

        UNAUTHENTICATED and the like fail at once; a seed that is down or cut off
        costs at most ``discovery_timeout_s``.
        """
        options.validate()
        errors: list[str] = []
        fallback: tuple[pb.ClusterInfoReply, ParamServerClient] | None = None
        clients = {a: ParamServerClient(replace(options.client_config(a), timeout_s=options.discovery_timeout_s)) for a in options.seeds}
        chosen: tuple[pb.ClusterInfoReply, ParamServerClient] | None = None
        fatal: TransferError | None = None
        with ThreadPoolExecutor(max_workers=len(clients)) as pool:
            pending = {pool.submit(c.cluster_info): a for a, c in clients.items()}
            while pending and chosen is None and fatal is None:
                done, _ = wait(pending, return_when=FIRST_COMPLETED)
                for future in done:
                    address = pending.pop(future)
                    try:
                        info = future.result()
                    except grpc.RpcError as exc:
                        if rpc_code(exc) not in RETRYABLE:
                            fatal = TransferError(f"{address}: {rpc_details(exc)}", rpc_code(exc))
                        errors.append(f"{address} ({rpc_code(exc).name.lower()})")
                        continue
                    if info.leader_id and chosen is None:
                        chosen = (info, clients[address])
                    elif fallback is None:
                        fallback = (info, clients[address])
        for c in clients.values():
            c.close()
        if fatal is not None:
            raise fatal
        found = chosen or fallback
        if found is None:
            raise ClusterUnreachable(
                f"no cluster member answered at {', '.join(errors)}; check --cluster (any member's gRPC address) and that the servers run"
            )
        info, answered = found
        return cls(options, info, ParamServerClient(options.client_config(answered.address)))

    def leader_call(self, fn: Callable[[ParamServerClient], T], deadline_s: float | None = None) -> T:
        """``fn(leader client)``; on UNAVAILABLE or a timeout, refresh the view and try the new leader.

        Right after a leader dies or is cut off, members still name it for an
        election timeout or two; this keeps asking until the deadline.
        """
        end = time.monotonic() + (deadline_s if deadline_s is not None else self.options.timeout_s * 3)
        while True:
            try:
                return fn(self.leader_client())
            except grpc.RpcError as exc:
                if rpc_code(exc) not in RETRYABLE or time.monotonic() >= end:
                    raise
            time.sleep(0.2)
            try:
                self.refresh(deadline_s=max(1.0, end - time.monotonic()))
            except ClusterUnreachable:
                if time.monotonic() >= end:
                    raise

    def _apply(self, info: pb.ClusterInfoReply) -> None:
        self.info = info
        self.members: dict[str, pb.Member] = {m.server_id: m for m in info.members}
        up = {m.server_id: m.zone for m in info.members if m.state == "up"}
        if not up:
            raise TransferError(f"the cluster reports no member in state 'up' (server {info.server_id}); wait for it to form", grpc.StatusCode.UNAVAILABLE)
        self.ring = Ring(up, RingConfig(vnodes=info.ring.vnodes or RingConfig().vnodes))
        self.replication, self.write_quorum = replication_and_quorum(
            info.ring.replication_factor or 3, info.ring.write_quorum or None, len(self.ring)
        )

    def refresh(self, deadline_s: float = 10.0) -> None:
        """Fetch ClusterInfo again (leader changes), from any member or seed."""
        end = time.monotonic() + deadline_s
        candidates = [*self.options.seeds, *(m.grpc_address for m in self.members.values())]
        last = ""
        while True:
            for address in dict.fromkeys(candidates):
                try:
                    self._apply(self.client(address).stub.ClusterInfo(pb.ClusterInfoRequest(), timeout=self.options.discovery_timeout_s))
                    return
                except grpc.RpcError as exc:
                    if rpc_code(exc) not in RETRYABLE:
                        raise TransferError(f"{address}: {rpc_details(exc)}", rpc_code(exc)) from None
                    last = f"{address}: {rpc_details(exc)}"
            if time.monotonic() >= end:
                raise ClusterUnreachable(f"no cluster member answered ClusterInfo within {deadline_s:.0f}s (last: {last})")
            time.sleep(0.3)

    def replicas(self, chunk_id: str) -> list[str]:
        return self.ring.replicas(chunk_id, self.replication)

    def client(self, address: str) -> ParamServerClient:
        with self._lock:
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
            for c in self._clients.values():
                c.close()
            self._clients.clear()

    def __enter__(self) -> ClusterView:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = ["ClusterOptions", "ClusterView", "parse_seeds", "RETRYABLE"]
