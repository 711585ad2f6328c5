"""The board of newest versions (``shm._board``), through a real broker: a
client that still holds the lease of the newest version it got, with no
view left, gets it again without a request; every change of a name (a
put, a put_many, a delete, a new incarnation, an expiry) is on the board
before its answer, so no get is ever answered with an older version; and
no client can write the board."""

from __future__ import annotations

import asyncio
import mmap
import os
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from _harness import BrokerProc, drained, stat_when, wait_for
from _rawhttp import Session
from _rawlane import RawLane, answered, handover
from tensordepot import AsyncClient, TensorNotFound

GET = ("GET", "/v1/tensors/{name}")  # the get route, as /metrics names it


def _get_and_drop(c: Any, name: str) -> None:
    """A get whose view dies at once: its lease's release is queued."""
    t = c.get(name)
    del t


def test_a_get_again_takes_back_its_lease_without_a_request(broker: BrokerProc) -> None:
    """Gets of a name whose newest has not moved, each view dropped before
    the next get: the first asks the broker, the rest take back its queued
    release (no request, the same lease, the right bytes); a view still
    alive makes the next get ask (its own lease)."""
    x = np.arange(64, dtype=np.int64)
    with broker.client() as c:
        c.put("w", x)
        _get_and_drop(c, "w")
        asked = answered(broker, *GET)
        for _ in range(50):
            t = c.get("w")
            assert np.array_equal(np.from_dlpack(t), x) and t.version == 1
            del t
        # A release the background thread sent meanwhile (a loaded machine
        # paused this one past its coalescing) makes that get ask: few do.
        assert answered(broker, *GET) - asked <= 25, "most gets took back their lease"
        held = c.get("w")
        before = answered(broker, *GET)
        second = c.get("w")  # ``held`` holds the lease: this one asks for its own
        assert answered(broker, *GET) == before + 1
        stat_when(broker, lambda st: st.leases == 2, "the two leases")
        del held, second
        c.delete("w")
    drained(broker, "leases", "bytes_in_use", "tensors", sessions=1)


@pytest.mark.parametrize("how", ["put", "put_many"])
def test_a_get_again_never_answers_an_older_version(broker: BrokerProc, how: str) -> None:
    """Another client moves the name on (a put, a put_many, a delete, a put
    after the delete, which starts a new incarnation): a get after each
    answer sees what the broker would answer, never the version this client
    still holds."""
    with broker.client() as reader, broker.client() as writer:

        def put(i: int) -> None:
            a = np.full(16, i, np.int64)
            if how == "put":
                writer.put("w", a)
            else:
                writer.put_many({"w": a, "other": a + 1})  # a pack of two

        asked = answered(broker, *GET)
        for i in range(1, 120):
            put(i)
            for _ in range(3):
                t = reader.get("w")
                assert int(np.from_dlpack(t)[0]) == i, (i, t.version)
                del t
            if i % 40 == 0:
                writer.delete("w")
                with pytest.raises(TensorNotFound):
                    reader.get("w")
        # A request per version and per miss (121), and for few of the other
        # 238 gets (see above): the rest took back their lease.
        assert 121 <= answered(broker, *GET) - asked <= 121 + 119
        writer.delete_many(["w", "other"] if how == "put_many" else ["w"])
        with pytest.raises(TensorNotFound):
            reader.get("w")
    drained(broker, "leases", "bytes_in_use", "tensors", sessions=1)


@pytest.mark.parametrize("lane", [True, False], ids=["lane", "no-lane"])
def test_an_async_client_gets_again_without_a_request(broker: BrokerProc, lane: bool) -> None:
    """The AsyncClient takes its session's lane for the board: gets of a
    name whose newest has not moved take back their lease, with no request
    (``lane=False``: each asks); a put by another client is seen by the next
    get, never an older version."""

    async def main() -> None:
        async with AsyncClient(broker.url, lane=lane) as c:
            with broker.client() as writer:
                writer.put("w", np.full(16, 0, np.int64))
                for i in range(1, 41):
                    asked = answered(broker, *GET)
                    for _ in range(5):
                        t = await c.get("w")
                        assert int(np.from_dlpack(t)[0]) == i - 1 and t.version == i
                        del t
                    gets = answered(broker, *GET) - asked
                    assert gets == 5 if not lane else gets >= 1, (i, gets)
                    seen.append(gets)
                    writer.put("w", np.full(16, i, np.int64))
                writer.delete("w")
                writer.put_many(_batch_of(0))  # and a batch, got again and again
                names = list(_batch_of(0))
                got = await c.get_many(names)
                first = _read(got)  # (versions start above the deleted "w"'s)
                assert [v for _, v in first.values()] == list(range(20))
                del got
                asked = answered(broker, *MANY)
                for _ in range(10):
                    got = await c.get_many(names)
                    assert _read(got) == first
                    del got
                many.append(answered(broker, *MANY) - asked)
                writer.delete(prefix="w")

    seen: list[int] = []
    many: list[int] = []
    asyncio.run(main())
    if lane:  # one request per version, and for few of the other gets (see above)
        assert sum(seen) <= 40 + 80, seen
    assert many == [10] if not lane else many[0] <= 5, many
    drained(broker, "leases", "bytes_in_use", "tensors", sessions=1)


MANY = ("POST", "/v1/many/get")


def _batch_of(i: int, n: int = 20) -> dict[str, np.ndarray]:
    return {f"w{k}": np.full(16, 100 * i + k, np.int64) for k in range(n)}


def _read(got: Any) -> dict[str, tuple[int, int]]:
    """(version, first element) of each tensor of a get_many, every byte read."""
    return {n: (t.version, int(np.from_dlpack(t).sum() // 16)) for n, t in got.items()}


def test_a_get_many_again_takes_back_its_lease_without_a_request(broker: BrokerProc) -> None:
    """get_many of a batch whose newest has not moved, its map dropped before
    the next: the first asks, the rest take back the pack's queued release
    (no request, the same lease, the right bytes); a map still alive, or a
    floor at the version held, makes the next one ask."""
    names = list(_batch_of(0))
    want = {n: (1, k) for k, n in enumerate(names)}
    with broker.client() as c:
        c.put_many(_batch_of(0))
        got = c.get_many(names)
        lease = got._parts[0].cols.packs[0][3]
        del got
        asked = answered(broker, *MANY)
        for _ in range(50):
            got = c.get_many(names)
            assert _read(got) == want and got._parts[0].cols.packs[0][3] == lease
            del got
        assert answered(broker, *MANY) - asked <= 25, "most get_many took back their lease"
        held = c.get_many(names)
        before = answered(broker, *MANY)
        second = c.get_many(names)  # ``held`` holds the lease: this one asks for its own
        assert answered(broker, *MANY) == before + 1 and _read(second) == want
        del held, second
        with pytest.raises(TensorNotFound):
            c.get_many(names, newer_than=1)  # nothing newer than what it holds: ask, and hear so
        c.delete(prefix="w")
    drained(broker, "leases", "bytes_in_use", "tensors", sessions=1)


def test_a_get_many_again_never_answers_an_older_version(broker: BrokerProc) -> None:
    """Another client moves the batch on (a put_many of it all, a put of one
    of its names, a delete of one, a put after the delete): a get_many after
    each answer sees what the broker would answer, never the versions this
    client still holds."""
    names = list(_batch_of(0))
    with broker.client() as reader, broker.client() as writer:
        writer.put_many(_batch_of(0))
        versions = dict.fromkeys(names, 1)
        values = {n: k for k, n in enumerate(names)}
        for i in range(1, 31):
            step = i % 3
            if step == 0:
                writer.put_many(_batch_of(i))
                versions = {n: v + 1 for n, v in versions.items()}
                values = {n: 100 * i + k for k, n in enumerate(names)}
            elif step == 1:
                versions["w7"] = writer.put("w7", np.full(16, 100 * i + 7, np.int64))
                values["w7"] = 100 * i + 7
            else:
                writer.delete("w3")
                with pytest.raises(TensorNotFound):
                    reader.get_many(names)
                versions["w3"] = writer.put("w3", np.full(16, 100 * i + 3, np.int64))
                values["w3"] = 100 * i + 3
            for _ in range(3):
                got = reader.get_many(names)
                assert _read(got) == {n: (versions[n], values[n]) for n in names}, i
                del got
        writer.delete(prefix="w")
    drained(broker, "leases", "bytes_in_use", "tensors", sessions=1)


def test_get_many_again_in_threads_while_a_writer_moves_the_batch_on(broker: BrokerProc) -> None:
    """Four threads of one client get the same batch again and again (their
    maps dropped, so their pack leases are taken back and raced for), while
    another client puts new versions of it: every tensor read holds the
    bytes of the version it says, never a version older than one published
    before the get_many began, and nothing is held at the end."""
    import threading

    names = [f"w{k}" for k in range(20)]

    def batch(v: int) -> dict[str, np.ndarray]:
        return {n: np.full(16, 100 * v + k, np.int64) for k, n in enumerate(names)}

    wrong: list[str] = []
    reads = [0]
    published = [1]  # the newest version whose put_many has returned
    stop = threading.Event()
    with broker.client() as reader, broker.client() as writer:
        writer.put_many(batch(1))

        def read() -> None:
            while not stop.is_set():
                reads[0] += 1
                floor = published[0]
                got = reader.get_many(names)
                for k, n in enumerate(names):
                    t = got[n]
                    a = np.from_dlpack(t)
                    if not (np.all(a == a[0]) and int(a[0]) == 100 * t.version + k):
                        wrong.append(f"{n} v{t.version}: {a[:3]}")
                    if t.version < floor:
                        wrong.append(f"{n} v{t.version} after v{floor} was published")
                del got, t, a

        threads = [threading.Thread(target=read) for _ in range(4)]
        for th in threads:
            th.start()
        asked = answered(broker, *MANY)
        start = reads[0]
        for v in range(2, 60):  # each version read about 8 times before the next
            seen = reads[0]
            wait_for(lambda seen=seen: reads[0] >= seen + 8, 30, what="the readers to read")
            assert writer.put_many(batch(v)) == dict.fromkeys(names, v)
            published[0] = v
        stop.set()
        for th in threads:
            th.join(30)
        assert not any(th.is_alive() for th in threads)
        assert not wrong, wrong[:5]
        n_reads, n_asked = reads[0] - start, answered(broker, *MANY) - asked
        assert n_asked < n_reads, f"{n_asked} requests for {n_reads} get_many: none from the board"
        writer.delete(prefix="w")
    drained(broker, "leases", "bytes_in_use", "tensors", sessions=1)


def test_a_get_again_after_an_expiry_asks(broker: BrokerProc) -> None:
    """A name whose ttl passed is gone from the board: the get asks, and
    hears it is gone."""
    with broker.client() as c:
        c.put("t", np.ones(4), ttl=0.3)
        _get_and_drop(c, "t")
        wait_for(lambda: not any(i.name == "t" for i in c.list()), 10, what="the ttl to pass")
        with pytest.raises(TensorNotFound):
            c.get("t")
    drained(broker, "leases", "bytes_in_use", "tensors", sessions=1)


def test_no_client_can_write_the_board(broker: BrokerProc) -> None:
    """The board a lane passes is read-only for its client: no writable
    mapping, no write, no writable reopening through /proc."""
    with broker.client() as c:
        c.put("w", np.ones(4))
        raw = Session(broker.sock)
        status, _, fds = handover(broker.sock, raw.sid)
        assert status == 200 and len(fds) == 4
        board = os.dup(fds[3])
        lane = RawLane(fds)
        try:
            with pytest.raises(PermissionError):
                mmap.mmap(board, mmap.PAGESIZE)
            with pytest.raises(PermissionError):
                os.pwrite(board, b"\xff" * 8, 0)
            again = os.open(f"/proc/self/fd/{board}", os.O_RDWR)
            try:
                with pytest.raises(PermissionError):
                    mmap.mmap(again, mmap.PAGESIZE)
            finally:
                os.close(again)
            _get_and_drop(c, "w")
            slot = c._core.recent["w"][1].slot
            assert slot is not None and lane.board.newest(slot) == 1  # the broker's, as it shows it
        finally:
            os.close(board)
            lane.close()
            raw.close()
        c.delete("w")
    drained(broker, "leases", "bytes_in_use", "tensors", sessions=1)


_FORKER = """
import os, sys
import numpy as np
from tensordepot import Client
with Client(sys.argv[1]) as c:
    c.put("w", np.arange(8))
    t = c.get("w")
    del t  # its release queued: the parent may take it back, never the child
    pid = os.fork()
    if pid == 0:
        ok = False
        try:
            trips = c._core.round_trips
            t = c.get("w")
            ok = int(np.from_dlpack(t)[7]) == 7 and c._core.round_trips > trips
            del t
        finally:
            os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, "the child took back its parent's lease"
    c.delete("w")
print("ok")
"""


def test_a_forked_child_asks_for_its_own_lease(broker: BrokerProc) -> None:
    """A child forked while its parent's release is queued asks the broker
    for its get (its own session's lease), never taking back the parent's."""
    out = subprocess.run(
        [sys.executable, "-c", _FORKER, broker.url], capture_output=True, text=True, timeout=60
    )
    assert (out.returncode, out.stdout.strip()) == (0, "ok"), out.stderr
    drained(broker, "leases", "bytes_in_use", "tensors", sessions=1)


def test_a_get_again_never_answers_from_a_dead_broker(
    broker_factory: Callable[..., BrokerProc],
) -> None:
    """The broker is killed while a client still holds its lease (no view
    left) and a new one serves the same socket with other bytes under the
    name: the client's next get asks the new broker, never the dead one's
    board."""
    b1 = broker_factory()
    c = b1.client()
    c.put("w", np.full(8, 1.0))
    _get_and_drop(c, "w")
    assert "w" in c._core.recent
    b1.kill()
    b1.expect_dead = True  # type: ignore[attr-defined]
    b2 = broker_factory(sock_dir=b1.dir, prefix=b1.prefix)
    with b2.client() as y:
        y.put("w", np.full(8, 2.0))
        t = c.get("w")
        assert float(np.from_dlpack(t)[0]) == 2.0
        del t
        c.close()
        y.delete("w")
    drained(b2, "leases", "bytes_in_use", "tensors", sessions=1)


def test_a_release_whose_request_was_cut_is_never_taken_back(broker: BrokerProc) -> None:
    """A release that rode on a request cut before its answer (Ctrl-C, a
    dropped connection) is queued again, but the broker may have released
    the lease already: the next get asks for a lease of its own.  (The cut
    is the client's own bookkeeping of one, ``Background.unanswered``,
    called where a cut request calls it.)"""
    with broker.client() as c:
        c.put("w", np.arange(8))
        _get_and_drop(c, "w")
        bg = c._core.bg
        assert bg is not None
        ids, rids = bg.take()  # what a request carries as riders ...
        assert len(ids) == 1
        c._core.call_now("POST", "/v1/release", {"leases": ids})  # ... the broker releases ...
        bg.unanswered(c._core.sid, ids, rids, None)  # ... and the answer never came
        before = answered(broker, *GET)
        t = c.get("w")
        assert answered(broker, *GET) == before + 1, "it asked: the lease may be gone"
        assert int(np.from_dlpack(t)[7]) == 7
        stat_when(broker, lambda st: st.leases == 1, "its own lease, the old one released")
        del t
        c.delete("w")
    drained(broker, "leases", "bytes_in_use", "tensors", sessions=1)
