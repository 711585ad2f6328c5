"""The AsyncClient's requests on the shared-memory lane (docs/plan-lane.md,
step 6), through a real broker: gets, small puts and stats of an
AsyncClient go on its session's lane, several at once, each answered on the
event loop, with the answers they get over HTTP; a long poll there leaves
the loop free; a cancelled wait leaves no lease and its late answer reaches
nobody; a lane that goes away under a waiting get sends it over HTTP."""

from __future__ import annotations

import asyncio
import os
import signal
import struct
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import numpy as np
import pytest
from _harness import BrokerProc, drained, wait_for
from tensordepot import AsyncClient, BrokerUnavailable, Client, DepotError, Stat
from tensordepot.shm._lanemem import BROKER, PAGE

T = TypeVar("T")


def run(main: Callable[[], Awaitable[T]]) -> T:
    return asyncio.run(main())  # type: ignore[arg-type]


def over_http(c: AsyncClient) -> list[int]:
    """A count, kept up to date, of the requests ``c`` sends over HTTP (its
    transport's round trips, each still made as it is)."""
    n = [0]
    roundtrip = c._transport.roundtrip

    async def counted(req: Any) -> tuple[int, bytes]:
        n[0] += 1
        return await roundtrip(req)

    c._transport.roundtrip = counted  # type: ignore[method-assign]
    return n


async def until(c: AsyncClient, cond: Callable[[Stat], bool], what: str) -> None:
    deadline = time.monotonic() + 10
    while not cond(st := await c.stat()):
        assert time.monotonic() < deadline, f"timed out waiting for {what} (last: {st})"
        await asyncio.sleep(0.02)


def _outcome(aw: Any) -> Any:
    async def one() -> Any:
        try:
            t = await aw
        except DepotError as exc:
            return type(exc).__name__
        return (t.name, t.version, np.from_dlpack(t).tolist())

    return one()


@pytest.mark.parametrize("lane", [True, False], ids=["lane", "no-lane"])
def test_async_requests_on_the_lane_answer_as_over_http(broker: BrokerProc, lane: bool) -> None:
    """Puts, gets (the newest, newer than, by version, a name never put, a
    version gone, a wait that times out) and stats: with the lane, the same
    answers and errors as without it, and not one of them over HTTP."""

    async def main() -> list[Any]:
        async with AsyncClient(broker.url, lane=lane) as c:
            http = over_http(c)
            x = np.arange(8, dtype=np.float32)
            out: list[Any] = [await c.put("a", x), await c.put("a", x + 1)]
            held = await c.get("a")  # version 2 lives on while this is held
            out.append(await c.put("a", x + 2))
            out.append(await _outcome(c.get("a")))
            out.append(await _outcome(c.get("a", newer_than=1)))
            out.append(await _outcome(c.get("a", version=2)))
            out.append(await _outcome(c.get("never")))
            out.append(await _outcome(c.get("a", version=99)))
            out.append(await _outcome(c.get("a", timeout=0.2, newer_than=3)))
            del held
            st = await c.stat()
            out.append(st.tensors)
            assert (c._core.lane is not None) == lane
            if lane:
                assert http[0] == 0, f"{http[0]} of them went over HTTP"
            else:
                assert http[0] >= 9, http[0]
            await c.delete("a")
            return out

    got = run(main)
    assert got[:3] == [1, 2, 3]
    assert got[3:6] == [("a", 3, [2.0 + i for i in range(8)])] * 2 + [
        ("a", 2, [1.0 + i for i in range(8)])
    ]
    assert got[6:9] == ["TensorNotFound", "TensorNotFound", "WaitTimedOut"], got[6:9]
    assert got[9] == 1, got[9]
    drained(broker, "leases", "waiting", "bytes_in_use")


def test_a_long_poll_on_the_lane_leaves_the_loop_free(broker: BrokerProc) -> None:
    """A get waiting on the lane for a tensor that the same AsyncClient puts
    from another task: the stat and the put go on the same lane meanwhile
    (a wait that blocked the loop would never see the put), and nothing
    goes over HTTP."""

    async def main() -> None:
        async with AsyncClient(broker.url) as c:
            http = over_http(c)
            waiter = asyncio.ensure_future(c.get("later", timeout=30))
            await until(c, lambda s: s.waiting == 1, "the get to wait at the broker")
            assert await c.put("later", np.full(16, 7, np.int64)) == 1
            t = await waiter
            assert (t.version, np.from_dlpack(t).tolist()) == (1, [7] * 16)
            assert http[0] == 0 and c._core.lane is not None
            del t
            await c.delete("later")

    run(main)
    drained(broker, "leases", "waiting", "bytes_in_use")


def test_many_waits_at_once_on_one_lane(broker: BrokerProc) -> None:
    """400 gets of 400 names wait at once on one AsyncClient (as many as
    the answer ring surely holds the answers of on its lane, the rest over
    HTTP); another client puts the names in a shuffled order: each get is
    answered with its own name's bytes, and the session lives on (answers
    that did not fit the ring would end it)."""
    names = [f"w{i}" for i in range(400)]

    async def main() -> None:
        async with AsyncClient(broker.url) as c:
            sid, lane = c._core.sid, c._core.lane
            assert lane is not None
            waits = [asyncio.ensure_future(c.get(n, timeout=60)) for n in names]
            await until(c, lambda s: s.waiting == len(names), "every get to wait")
            order = np.random.default_rng(3).permutation(len(names))
            with Client(broker.url, lane=False) as p:
                for i in order:
                    p.put(names[i], np.full(4, int(i), np.int32))
            got = await asyncio.gather(*waits)
            assert [(t.name, np.from_dlpack(t).tolist()) for t in got] == [
                (n, [i] * 4) for i, n in enumerate(names)
            ]
            assert sid == c._core.sid and lane is c._core.lane, "the same session and lane"
            del got, waits
            for n in names:
                await c.delete(n)

    run(main)
    drained(broker, "leases", "waiting", "bytes_in_use")


def test_a_cancelled_wait_on_the_lane_leaves_no_lease(broker: BrokerProc) -> None:
    """A get waiting on the lane, cancelled, then its name put: the lease
    the broker may grant it is given back, its late answer reaches no later
    call (a get of another name gets that name's bytes), and nothing waits."""

    async def main() -> None:
        async with AsyncClient(broker.url) as c:
            http = over_http(c)
            for k in range(5):
                task = asyncio.ensure_future(c.get(f"x{k}", timeout=60))
                await until(c, lambda s: s.waiting == 1, "the get to wait at the broker")
                task.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await task
                with Client(broker.url, lane=False) as p:
                    p.put(f"x{k}", np.full(8, k, np.int16))
                    p.put(f"y{k}", np.full(8, 100 + k, np.int16))
                t = await c.get(f"y{k}", timeout=5)
                assert (t.name, np.from_dlpack(t).tolist()) == (f"y{k}", [100 + k] * 8)
                del t
            await until(c, lambda s: s.leases == 0 and s.waiting == 0, "no lease, no wait")
            assert http[0] == 0
            for k in range(5):
                await c.delete(f"x{k}")
                await c.delete(f"y{k}")

    run(main)
    drained(broker, "leases", "waiting", "bytes_in_use")


def test_a_lane_gone_under_a_waiting_get_sends_it_over_http(broker: BrokerProc) -> None:
    """The client's own request ring garbled while a get waits on it: the
    broker ends that session and closes its lane, and the get, finding the
    lane gone, goes over HTTP under a new session, where the put it waits
    for answers it; the next calls take the new session's lane."""

    async def main() -> None:
        async with AsyncClient(broker.url) as c:
            http = over_http(c)
            waiter = asyncio.ensure_future(c.get("g", timeout=30))
            await until(c, lambda s: s.waiting == 1, "the get to wait at the broker")
            lane = c._core.lane
            assert lane is not None
            tail_at = PAGE + 64  # the request ring's tail: past its end, as no client writes
            tail = struct.unpack_from("<Q", lane.mem._map, tail_at)[0]
            struct.pack_into("<Q", lane.mem._map, tail_at, tail + (1 << 40))
            lane.mem.ring(BROKER)
            await asyncio.get_running_loop().run_in_executor(
                None,
                lambda: wait_for(
                    lambda: "wrote garbage into its lane" in broker.log(), 10, what="the log line"
                ),
            )
            await until(c, lambda s: s.waiting == 1, "the get to wait again, over HTTP")
            assert http[0] >= 1
            with Client(broker.url, lane=False) as p:
                p.put("g", np.full(4, 9, np.uint8))
            t = await waiter
            assert np.from_dlpack(t).tolist() == [9] * 4
            del t
            before = http[0]
            await c.stat()
            assert c._core.lane is not None and c._core.lane is not lane
            assert http[0] == before, "the new session's lane carries the next calls"
            await c.delete("g")
        log = broker.log()
        assert log.count("wrote garbage into its lane") == 1 and "exception in" not in log, log

    run(main)
    drained(broker, "leases", "waiting", "bytes_in_use")


def test_a_broker_that_stops_answering_times_out_on_the_lane(broker: BrokerProc) -> None:
    """The broker stopped (SIGSTOP) under a stat on the lane: the call
    raises BrokerUnavailable once the client's timeout has passed, saying
    so; the broker resumed, the next calls go on the lane again."""
    assert broker.proc is not None
    pid = broker.proc.pid

    async def main() -> None:
        async with AsyncClient(broker.url, timeout=1.0) as c:
            http = over_http(c)
            await c.stat()
            os.kill(pid, signal.SIGSTOP)
            try:
                t0 = time.monotonic()
                with pytest.raises(BrokerUnavailable, match=r"on its lane within 1\.0 s"):
                    await asyncio.wait_for(c.stat(), 20)
                assert time.monotonic() - t0 >= 1.0
            finally:
                os.kill(pid, signal.SIGCONT)
            assert (await c.stat()).sessions >= 1
            assert http[0] == 0 and c._core.lane is not None

    run(main)
    drained(broker, "leases", "waiting")
