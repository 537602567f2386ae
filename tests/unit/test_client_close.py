"""Closing a ClusterClient while background work (a load's heat report) still asks it for servers."""
from __future__ import annotations

import threading

import pytest

from paramserver.client.errors import ClientClosed
from paramserver.client.session import ClusterClient


def _ask(client: ClusterClient, started: threading.Semaphore, errors: list[BaseException], base: int) -> None:
    for i in range(300):
        if i == 20:
            started.release()  # close() then finds spares to close while more arrive
        try:
            client.server(f"127.0.0.1:{base + i}")
        except ClientClosed:
            return
        except BaseException as exc:  # noqa: BLE001 - collected for the assertion
            errors.append(exc)
            return


def test_close_while_other_threads_ask_for_servers() -> None:
    # No server listens: with no cluster view, server() hands out spare clients (channels connect lazily).
    for _round in range(20):
        client = ClusterClient(["127.0.0.1:9"])
        errors: list[BaseException] = []
        started = threading.Semaphore(0)
        threads = [threading.Thread(target=_ask, args=(client, started, errors, 10000 + 1000 * k)) for k in range(3)]
        for t in threads:
            t.start()
        for _t in threads:
            started.acquire()
        client.close()
        for t in threads:
            t.join(10)
        assert not errors, errors


def test_closed_client_refuses_new_work_with_a_clear_error() -> None:
    client = ClusterClient(["127.0.0.1:9"])
    client.close()
    client.close()  # twice is fine
    with pytest.raises(ClientClosed, match="closed; make a new one"):
        client.server("127.0.0.1:10")
    with pytest.raises(ClientClosed):
        client.view()
