"""Batches on the shared-memory lane (docs/plan-lane.md, step 3), through a
real broker: a Client's put_many, get_many (waiting too), and a large put's
or a batch's alloc and publish go as records on its lane, with the bytes,
versions and leases they get over HTTP; an answer too large for the answer
ring comes over HTTP under the same request id, leasing once; a request too
large for the request ring goes over HTTP and leaves the lane as it was.
An AsyncClient's batches likewise, one batch's answer room at a time."""

from __future__ import annotations

import asyncio
import signal
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from _harness import BrokerProc, drained, wait_for
from tensordepot import AsyncClient, Client
from tensordepot._proto import SESSION_HEADER
from tensordepot.client import _core
from tensordepot.service._http._shmlane import ANSWERS, REQUESTS


@pytest.fixture
def over_http(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[tuple[str, str]]]:
    """The session and path of each request Clients send over HTTP from
    here on (each still sent, as it is)."""
    sent: list[tuple[str, str]] = []
    exchange = _core.exchange

    def counted(endpoint: Any, method: str, path: str, body: Any, headers: Any, **kw: Any) -> Any:
        sent.append(((headers or {}).get(SESSION_HEADER, ""), path))
        return (yield from exchange(endpoint, method, path, body, headers, **kw))

    monkeypatch.setattr(_core, "exchange", counted)
    yield sent


def _of(c: Client, sent: list[tuple[str, str]]) -> list[str]:
    """The paths ``c``'s session sent over HTTP."""
    return [path for sid, path in sent if sid == c._core.sid]


def _seq(c: Client) -> int:
    """The requests ``c`` has written into its lane."""
    lane = c._core.lane
    assert lane is not None, "the client has a lane"
    return lane._seq


def test_batches_go_on_the_lane_with_their_answers(
    broker: BrokerProc, over_http: list[tuple[str, str]]
) -> None:
    small = {f"s.{i}": np.full(256, i, np.float32) for i in range(1000)}  # 1 MiB inline
    large = {f"l.{i}": np.full(100_000, i, np.float64) for i in range(3)}  # alloc + publish
    one = np.arange(200_000, dtype=np.float64)  # 1.6 MB: a put's alloc and publish
    with broker.client() as c, broker.client(lane=False) as p:
        c.stat()  # the lane taken
        start = _seq(c)
        versions = c.put_many(small)
        assert _seq(c) == start + 1 and set(versions.values()) == {1}
        v2 = c.put_many(large)
        v3 = c.put("one", one)
        assert _seq(c) == start + 5 and set(v2.values()) == {1} and v3 == 1
        got = c.get_many([*small, *large])
        assert _seq(c) == start + 6
        for k, a in [*small.items(), *large.items()]:
            assert got[k].version == 1 and np.array_equal(np.from_dlpack(got[k]), a), k
        assert np.array_equal(np.from_dlpack(c.get("one")), one)
        del got
        # A get_many that waits on the lane, answered by a put over HTTP.
        floors = {k: 1 for k in small}
        done: dict[str, Any] = {}
        waiting = threading.Thread(
            target=lambda: done.update(c.get_many(list(small), newer_than=floors, timeout=30))
        )
        waiting.start()
        wait_for(lambda: p.stat().waiting == 1, what="the get_many to wait at the broker")
        p.put_many({k: a + 1 for k, a in small.items()})
        waiting.join(30)
        assert not waiting.is_alive()
        assert {t.version for t in done.values()} == {2}
        assert all(np.array_equal(np.from_dlpack(done[k]), a + 1) for k, a in small.items())
        done.clear()
        assert _of(c, over_http) == []
        c.delete_many([*small, *large, "one"])
    drained(broker, "leases", "bytes_in_use", "tensors", sessions=1)


def test_an_answer_too_large_for_the_ring_comes_over_http_leased_once(
    broker: BrokerProc, over_http: list[tuple[str, str]]
) -> None:
    """A get_many whose answer does not fit the answer ring: the broker
    writes, in its place, a mark that sends it over HTTP, where its request
    id replays the answer it kept: the same leases, taken once."""
    names = [f"{'n' * 400}.{i}" for i in range(1000)]  # about 430 KB of answer
    assert ANSWERS < 1000 * 400
    with broker.client(lane=False) as p:
        p.put_many({k: np.full(4, i, np.int32) for i, k in enumerate(names)})
    with broker.client() as c:
        c.stat()
        start, leases = _seq(c), broker.stat().leases
        got = c.get_many(names)
        assert _seq(c) == start + 1, "asked on the lane first"
        assert _of(c, over_http) == ["/v1/many/get"], over_http
        assert broker.stat().leases - leases == 1, "one lease of the one pack, taken once"
        assert [int(np.from_dlpack(got[k])[0]) for k in names] == list(range(1000))
        del got
        c.stat()  # the release rides on it
        assert broker.stat().leases == leases
        small = c.get_many(names[:3])  # a small answer: on the lane
        assert _seq(c) == start + 3 and len(_of(c, over_http)) == 1
        del small
        c.delete_many(names)
    drained(broker, "leases", "bytes_in_use", "tensors", sessions=1)


def test_a_request_too_large_for_the_ring_goes_over_http_and_keeps_the_lane(
    broker: BrokerProc, over_http: list[tuple[str, str]]
) -> None:
    names = [f"{'h' * 480}.{i}" for i in range(5000)]  # a head of about 2.6 MB
    assert REQUESTS // 2 < 5000 * 480
    with broker.client() as c:
        c.stat()
        start, lane = _seq(c), c._core.lane
        versions = c.put_many({k: np.full(2, i, np.int16) for i, k in enumerate(names)})
        assert set(versions.values()) == {1} and _of(c, over_http) == ["/v1/many/put"]
        assert _seq(c) == start and c._core.lane is lane, "the lane kept"
        got = c.get_many(names[:2])
        assert _seq(c) == start + 1
        assert np.from_dlpack(got[names[1]]).tolist() == [1, 1]
        del got
        c.delete(prefix="h")
    drained(broker, "leases", "bytes_in_use", "tensors", sessions=1)


def test_an_async_clients_batches_go_on_its_lane(broker: BrokerProc) -> None:
    """An AsyncClient's put_many, get_many (waiting too, and several at
    once) go on its lane with the bytes and versions they get over HTTP; a
    get_many whose answer passes the ring comes over HTTP with one lease."""
    small = {f"a.{i}": np.full(256, i, np.float32) for i in range(1000)}
    wide = [f"{'w' * 400}.{i}" for i in range(1000)]  # about 430 KB of answer

    async def main() -> None:
        async with AsyncClient(broker.url) as c:
            http: list[str] = []
            roundtrip = c._transport.roundtrip

            async def counted(req: Any) -> tuple[int, bytes]:
                http.append(req.path.partition("?")[0])
                return await roundtrip(req)

            c._transport.roundtrip = counted  # type: ignore[method-assign]
            await c.stat()
            lane = c._core.lane
            assert lane is not None
            start = lane._seq
            assert set((await c.put_many(small)).values()) == {1}
            got = await c.get_many(list(small))
            assert all(np.array_equal(np.from_dlpack(got[k]), a) for k, a in small.items())
            del got
            assert lane._seq == start + 2 and http == [], http
            # Waiting get_manys at once (one batch's answer room at a time on
            # the lane, the other over HTTP), answered by a put over HTTP.
            floors = dict.fromkeys(small, 1)
            waits = [c.get_many(list(small), newer_than=floors, timeout=30) for _ in range(2)]
            tasks = [asyncio.ensure_future(w) for w in waits]
            deadline = time.monotonic() + 10
            while (await c.stat()).waiting < 2:
                assert time.monotonic() < deadline, "the get_manys to wait"
                await asyncio.sleep(0.02)
            with Client(broker.url, lane=False) as p:
                p.put_many({k: a + 1 for k, a in small.items()})
                p.put_many({k: np.full(2, i, np.int16) for i, k in enumerate(wide)})
            for got in await asyncio.gather(*tasks):
                assert {t.version for t in got.values()} == {2}
                assert all(np.array_equal(np.from_dlpack(got[k]), a + 1) for k, a in small.items())
            del got, tasks
            assert http == ["/v1/many/get"], http  # the second batch at once
            deadline = time.monotonic() + 10
            while (await c.stat()).leases:
                assert time.monotonic() < deadline, "the batches' leases to go back"
                await asyncio.sleep(0.02)
            big = await c.get_many(wide)
            assert http[1:] == ["/v1/many/get"], "too large for the ring: over HTTP"
            assert (await c.stat()).leases == 1, "one lease, taken once"
            assert [int(np.from_dlpack(big[k])[0]) for k in wide] == list(range(1000))
            del big
            await c.delete_many([*small, *wide])

    asyncio.run(main())
    drained(broker, "leases", "bytes_in_use", "tensors", sessions=1)


@pytest.mark.parametrize("what", ["put", "put_many"])
@pytest.mark.parametrize("stage", ["alloc", "publish"])
def test_an_async_put_cancelled_while_its_request_waits_on_the_lane(
    broker: BrokerProc, what: str, stage: str
) -> None:
    """An AsyncClient's put or put_many cancelled while a request of it is a
    record on the lane, not yet answered (the broker stopped).  Its alloc:
    the allocation is still made, its answer read, and given back (nothing
    stays allocated).  Its publish: once sent it completes (the versions
    are published and read back, nothing else stays allocated)."""
    big = {f"c.{i}": np.full(1 << 22, i, np.float64) for i in range(3)}  # 32 MiB each: alloc
    names = ["c.0"] if what == "put" else list(big)

    async def main() -> None:
        async with AsyncClient(broker.url) as c:
            await c.stat()  # the lane taken
            aio, lane = c._aio, c._core.lane
            assert aio is not None and lane is not None and broker.proc is not None
            start = lane._seq
            if stage == "alloc":
                broker.proc.send_signal(signal.SIGSTOP)
            try:
                call = c.put("c.0", big["c.0"]) if what == "put" else c.put_many(big)
                task = asyncio.ensure_future(call)
                deadline = time.monotonic() + 30
                if stage == "publish":
                    while lane._seq == start or aio.unanswered:  # until the alloc is answered
                        assert time.monotonic() < deadline, "the alloc to be answered"
                        await asyncio.sleep(0.001)
                    broker.proc.send_signal(signal.SIGSTOP)  # while the copy runs
                sent = start + (1 if stage == "alloc" else 2)
                while lane._seq < sent or not aio.unanswered:  # its request is in the ring
                    assert time.monotonic() < deadline, f"the {stage} to go on the lane"
                    await asyncio.sleep(0.001)
                task.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await task
            finally:
                broker.proc.send_signal(signal.SIGCONT)
            while c._pending:  # the answer read, and the allocation given back
                await asyncio.gather(*c._pending)
            st = await c.stat()
            if stage == "alloc":
                assert (st.versions, st.bytes_in_use) == (0, 0), st
                await c.put_many({k: big[k] for k in names})  # the lane carries the next put
            else:
                assert (st.tensors, st.versions) == (len(names), len(names)), st
            got = await c.get_many(names)
            assert all(np.array_equal(np.from_dlpack(got[k]), big[k]) for k in names)
            del got
            await c.delete_many(names)

    asyncio.run(main())
    drained(broker, "leases", "bytes_in_use", "tensors", sessions=1)
