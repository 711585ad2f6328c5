"""Quotas and batches that a client cannot get around, tried against a real broker.

A name put as an alias of a got tensor (``/v1/link``) is charged to whoever
linked it, so deleting the original leaves no bytes held uncharged;
concurrent puts under a quota are checked and charged in one step, so
together they never publish more than the quota; a ``put_many`` whose
publish fails (a name deleted meanwhile) gives back every allocation of
its batch, so a producer looping against a deleter runs on in bounded
memory.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from _harness import BrokerProc, wait_for
from _rawhttp import Answer, encode, exchange
from tensordepot import Client, OutOfMemory, TensorNotFound

MiB = 1 << 20


def published_bytes(c: Client) -> int:
    return sum(i.nbytes for i in c.list())


# -- 1. an alias is charged to whoever makes it ------------------------------------------------


def test_an_alias_is_charged_so_deleting_the_original_frees_no_quota(
    broker_factory: Callable[..., BrokerProc],
) -> None:
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
    broker_factory: Callable[..., BrokerProc],
) -> None:
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
    broker_factory: Callable[..., BrokerProc], limit: str
) -> None:
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


# -- 3. a put_many whose publish fails gives back its whole batch ------------------------------


def call(
    b: BrokerProc, method: str, path: str, body: Any = None, session: str | None = None
) -> Answer:
    headers = [("content-type", "application/json")]
    headers += [("x-tensordepot-session", session)] if session else []
    return exchange(
        b.sock,
        encode(method, path, headers, None if body is None else json.dumps(body).encode()),
        method=method,
    )


@pytest.mark.parametrize("route", ["many", "many-devices"])
def test_a_failed_batch_publish_gives_back_the_whole_batch(
    broker_factory: Callable[..., BrokerProc], route: str
) -> None:
    """A producer that never aborts (raw HTTP): the broker itself gives back
    every allocation of a batch whose publish fails."""
    names = [f"sd.{i}" for i in range(20)]
    size = 64 << 10  # 1.25 MiB per batch: 13 leaked batches fill --max-memory
    b = broker_factory("--segment-size", "4MiB", max_memory="16MiB")
    sid = call(b, "POST", "/v1/sessions", {"pid": os.getpid()}).json()["session"]
    with b.client() as d:
        try:
            batches(b, d, sid, names, size, route)
        finally:
            assert call(b, "DELETE", f"/v1/sessions/{sid}", session=sid).status == 204


def batches(b: BrokerProc, d: Client, sid: str, names: list[str], size: int, route: str) -> None:
    """40 batches of ``names``, each but the first with a name deleted before
    its publish; ``route`` "many-devices" names each tensor's device (host)."""
    for k in range(40):
        body = {"names": names, "shapes": [[size]] * 20, "dtypes": ["uint8"] * 20}
        if route == "many-devices":
            body["devices"] = ["cpu"] * 10 + ["cpu:0"] * 10
        got = call(b, "POST", "/v1/many/alloc", body, sid)
        assert got.status == 200, (k, got.json(), d.stat())
        assert got.json()["others"] == {}, "host tensors come back as columns"
        versions = got.json()["versions"]
        pub = ("/v1/many/publish", {"names": names, "versions": versions})
        if k:
            d.delete(names[k % 20])  # deleted between alloc and publish
        answer = call(b, "POST", *pub, session=sid)
        if k == 0:
            assert answer.status == 200, answer.json()
            continue
        assert answer.status == 404, answer.json()
        st = d.stat()
        assert st.versions == st.tensors, (k, st)  # every live version is a published one
        msg = answer.json()["error"]["message"]
        assert f"{names[k % 20]!r}" in msg and "nothing of this batch was published" in msg, msg
        assert "the 19 versions of it this session was writing were given back" in msg, msg


def test_a_put_many_loop_against_a_deleter_runs_in_bounded_memory(
    broker_factory: Callable[..., BrokerProc],
) -> None:
    """The whole scenario with real clients: a producer's put_many loop, a
    deleter and a consumer, in memory that 13 leaked batches would fill."""
    names = [f"sd.{i}" for i in range(20)]
    size = 64 << 10  # 20 x 64 KiB = 1.25 MiB per round, under --max-memory 16 MiB
    b = broker_factory("--segment-size", "4MiB", max_memory="16MiB")
    rounds, failed = 300, 0
    stop = threading.Event()
    errors: list[BaseException] = []

    def deleter() -> None:
        with b.client() as d:
            i = 0
            while not stop.is_set():
                try:
                    d.delete(names[i % len(names)])
                except TensorNotFound:
                    pass
                i += 7

    def consumer() -> None:
        with b.client() as r:
            while not stop.is_set():
                try:
                    got = r.get_many(names, timeout=0)
                except TensorNotFound:
                    continue
                assert all(np.from_dlpack(t)[0] == 7 for t in got.values())
                del got

    def guarded(fn: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            try:
                fn()
            except BaseException as exc:
                errors.append(exc)

        return run

    helpers = [threading.Thread(target=guarded(f)) for f in (deleter, consumer)]
    with b.client() as p:
        for th in helpers:
            th.start()
        try:
            sd = {n: np.full(size, 7, np.uint8) for n in names}
            for k in range(rounds):
                try:
                    p.put_many(sd)
                except TensorNotFound:
                    failed += 1  # a name was deleted between alloc and publish
                except OutOfMemory as exc:
                    st = p.stat()
                    raise AssertionError(f"round {k}: {exc}; {st}") from exc
        finally:
            stop.set()
            for th in helpers:
                th.join(60)
        assert not errors, errors
        # No allocation of a failed batch stays behind (they would stay until --alloc-ttl).
        wait_for(
            lambda: p.stat().versions <= len(names),
            10,
            what="only the published versions to be left",
        )
        for n in names:
            try:
                p.delete(n)
            except TensorNotFound:
                pass
        wait_for(
            lambda: p.stat().bytes_in_use == 0 and p.stat().leases == 0,
            10,
            what="every byte and lease to be given back",
        )
    assert failed > 0, "the deleter never hit a batch between alloc and publish"
