"""Quotas and batches that a client cannot get around, tried against a real broker.

A name put as an alias of a got tensor (``/v1/link``) is charged to whoever
linked it, so deleting the original leaves no bytes held uncharged;
concurrent puts under a quota are checked and charged in one step, so
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


# -- 1. an alias is charged to whoever makes it ------------------------------------------------

def test_an_alias_is_charged_so_deleting_the_original_frees_no_quota(
        broker_factory: Callable[..., BrokerProc]) -> None:
    b = broker_factory("--max-memory-per-session", "20MiB", "--max-memory-per-token", "20MiB")
    big = np.ones(16 * MiB, np.uint8)
    refused = []
    with b.client() as c:
        for i in range(8):  # each round: put 16 MiB, alias it, delete the original
            c.put("x", big)
            t = c.get("x")
            try:
                c.put(f"alias{i}", t)
            except OutOfMemory as exc:
                refused.append(str(exc))
            del t
            c.delete("x")
            st = c.stat()
            assert st.bytes_in_use <= 20 * MiB, (i, st)
        assert len(refused) == 8, refused  # 16 MiB held by "x" plus a 16 MiB alias: 32 > 20
        assert "alias0" in refused[0] and "--max-memory-per-session" in refused[0], refused[0]
        wait_for(lambda: c.stat().bytes_in_use == 0, 10, what="the originals to be freed")
        # Within the quota an alias works, and counts as long as it lives.
        half = np.ones(8 * MiB, np.uint8)
        c.put("y", half)
        t = c.get("y")
        c.put("y-alias", t)  # 8 + 8 MiB charged
        del t
        c.delete("y")
        wait_for(lambda: c.stat().leases == 0, 10, what="the get's lease to be released")
        assert np.from_dlpack(c.get("y-alias")).sum() == 8 * MiB
        c.put("z", half)  # the alias's 8 MiB + 8 MiB
        with pytest.raises(OutOfMemory, match="--max-memory-per-session"):
            c.put("zz", half)  # would be 24 MiB
        c.delete("y-alias")
        c.put("zz", half)  # the alias's charge came back with its memory
        assert sorted(i.name for i in c.list()) == ["z", "zz"]


def test_an_alias_made_by_another_session_counts_against_that_session(
        broker_factory: Callable[..., BrokerProc]) -> None:
    b = broker_factory("--max-memory-per-session", "20MiB")
    with b.client() as owner, b.client() as other:
        owner.put("x", np.ones(16 * MiB, np.uint8))
        other.put("mine", np.ones(8 * MiB, np.uint8))
        t = other.get("x")
        with pytest.raises(OutOfMemory, match="--max-memory-per-session") as err:
            other.put("alias", t)  # other: 8 MiB + 16 MiB
        msg = str(err.value)
        del err  # its traceback holds the tensor
        assert "cannot place 'alias'" in msg and "holds 8388608 bytes" in msg, msg
        other.delete("mine")
        wait_for(lambda: other.stat().bytes_in_use == 16 * MiB, 10, what="'mine' to be freed")
        other.put("alias", t)
        del t
        owner.delete("x")
        wait_for(lambda: owner.stat().leases == 0, 10, what="the get's lease to be released")
        st = owner.stat()
        assert st.bytes_in_use == 16 * MiB, st  # held by the alias alone, charged to `other`
        with pytest.raises(OutOfMemory, match="this session already holds 16777216 bytes"):
            other.put("more", np.ones(8 * MiB, np.uint8))
        owner.put("again", np.ones(16 * MiB, np.uint8))  # the owner's charge went with "x"


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
