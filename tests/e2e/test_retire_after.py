"""What a publish retires is given back after its answer is written
(``Memory.retire_after``), and before the next request runs: through a real
broker, a publish that supersedes a version and a ``stat`` sent at once, in
one lane's ring or pipelined on one HTTP connection, read while the broker
was stopped so that both are taken in one step of its loop.  The stat sees
the old version's memory given back, the name's new bytes are read back,
and nothing is left."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import time

import numpy as np
from _harness import BrokerProc, drained, wait_for
from _rawhttp import _Reader, encode, read_answer
from tensordepot import AsyncClient, Client

MiB = 1 << 20


def _stopped(broker: BrokerProc) -> int:
    assert broker.proc is not None
    pid = broker.proc.pid
    os.kill(pid, signal.SIGSTOP)
    return pid


async def sent(c: AsyncClient, n: int) -> None:
    """Until ``n`` of ``c``'s requests wait for their answers on its lane."""
    assert c._aio is not None
    deadline = time.monotonic() + 10
    while len(c._aio.waiting) < n:
        assert time.monotonic() < deadline, f"{n} requests were not sent on the lane"
        await asyncio.sleep(0.001)


def test_a_publish_on_the_lane_retires_before_the_next_record_runs(broker: BrokerProc) -> None:
    async def main() -> None:
        async with AsyncClient(broker.url) as c:
            await c.put("ra.x", np.zeros(MiB, np.uint8))
            t = await c.empty("ra.x", (MiB,), "uint8")
            np.from_dlpack(t)[:] = 7
            before = await c.stat()
            assert before.bytes_in_use == 2 * MiB, before  # the published one, the written one
            assert c._aio is not None  # the stat went on the lane
            pid = _stopped(broker)
            try:
                pub = asyncio.ensure_future(c.publish(t))
                await sent(c, 1)
                after = asyncio.ensure_future(c.stat())
                await sent(c, 2)  # both records in the ring, in this order
            finally:
                os.kill(pid, signal.SIGCONT)
            assert (await pub).version == 2
            st = await after
            assert st.bytes_in_use == MiB, st  # version 1 given back before the stat ran
            assert st.versions == 1, st
            got = await c.get("ra.x")
            assert got.version == 2 and np.from_dlpack(got).min() == 7
            del got, t
            await c.delete("ra.x")

    asyncio.run(main())
    drained(broker, "leases", "waiting")


def test_a_publish_over_http_retires_before_the_next_pipelined_request(broker: BrokerProc) -> None:
    with Client(broker.url, lane=False) as c:
        c.put("rh.x", np.zeros(MiB, np.uint8))
        t = c.empty("rh.x", (MiB,), "uint8")
        np.from_dlpack(t)[:] = 9
        assert c.stat().bytes_in_use == 2 * MiB
        session = [("x-tensordepot-session", c._core.sid)]
        body = b'{"name": "rh.x", "version": %d}' % t.version
        data = encode(
            "POST", "/v1/publish", [*session, ("content-type", "application/json")], body
        ) + encode("GET", "/v1/stat", session)
        with socket.socket(socket.AF_UNIX) as sock:
            sock.settimeout(30)
            sock.connect(broker.sock)
            pid = _stopped(broker)
            try:
                sock.sendall(data)  # both requests in the broker's socket before it runs
            finally:
                os.kill(pid, signal.SIGCONT)
            reader = _Reader(sock)
            published = read_answer(reader, "POST")
            stat = read_answer(reader, "GET")
        assert published.status == 200, published
        assert published.json()["version"] == t.version
        assert stat.status == 200, stat
        st = stat.json()
        assert st["bytes_in_use"] == MiB, st  # version 1 given back before the stat ran
        assert st["versions"] == 1, st
        t.release()
        got = c.get("rh.x")
        assert got.version == t.version and np.from_dlpack(got).min() == 9
        del got
        c.delete("rh.x")
    wait_for(lambda: broker.stat().leases == 0 or None, 10, what="leases to drain")
