"""Quotas and batches that a client cannot get around, tried against a real broker.

Concurrent puts under a quota are checked and charged in one step, so
together they never publish more than the quota.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import numpy as np
import pytest
from _harness import BrokerProc, wait_for
from tensordepot import Client, OutOfMemory

MiB = 1 << 20


def published_bytes(c: Client) -> int:
    return sum(i.nbytes for i in c.list())


# -- 2. concurrent puts are checked and charged in one step ------------------------------------

@pytest.mark.parametrize("limit", ["session", "token"])
def test_concurrent_puts_never_publish_more_than_the_quota(
        broker_factory: Callable[..., BrokerProc], limit: str) -> None:
    b = broker_factory(f"--max-memory-per-{limit}", "20MiB")
    n = 8
    start = threading.Barrier(n)
    outcomes: list[str | int] = [""] * n
    # Per session: one client, 8 threads; per token: 8 clients (sessions) of one uid.
    shared = b.client() if limit == "session" else None
    clients = [shared or b.client() for _ in range(n)]

    def put(i: int) -> None:
        data = np.full(16 * MiB, i, np.uint8)
        start.wait()
        try:
            outcomes[i] = clients[i].put(f"w{i}", data)
        except OutOfMemory as exc:
            outcomes[i] = str(exc)

    try:
        threads = [threading.Thread(target=put, args=(i,)) for i in range(n)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(120)
        assert not any(th.is_alive() for th in threads)
        c = clients[0]
        published = published_bytes(c)
        assert published <= 20 * MiB, (published, outcomes)
        won = [i for i, o in enumerate(outcomes) if o == 1]
        assert len(won) == 1, outcomes
        for i, o in enumerate(outcomes):
            if i not in won:
                assert isinstance(o, str) and f"--max-memory-per-{limit}" in o, o
                assert f"cannot place 'w{i}'" in o, o
        assert np.from_dlpack(c.get(f"w{won[0]}"))[::MiB].tolist() == [won[0]] * 16
        st = c.stat()
        assert st.bytes_in_use == 16 * MiB, st  # no refused put left memory behind
        c.delete(f"w{won[0]}")
        wait_for(lambda: c.stat().leases == 0, 10, what="the get's lease to be released")
        c.put("after", np.ones(16 * MiB, np.uint8))  # the refused ones gave their credit back
        c.delete("after")
    finally:
        for cl in set(clients):
            cl.close()
