"""A client's cancel of a waiting get that arrives after a publish woke the
get but before the get ran again: the cancel finds no lease to give back
yet, so the get must not take one after it; otherwise the lease stays the
session's, released by nobody, until the session ends (an AsyncClient's
get under ``asyncio.wait_for`` whose deadline expires as the tensor is
published).  In this process, on the broker's own objects: the window is
one turn of the broker's loop."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator

import pytest
from _harness import in_process_broker
from tensordepot import Cancelled
from tensordepot._wire import AllocRequest
from tensordepot.service import Broker
from tensordepot.service._registry._sessions import Caller


@pytest.fixture
def broker() -> Iterator[Broker]:
    yield from in_process_broker("cancelledget")


@pytest.mark.parametrize("how", ["get", "get_many", "get_many_any"])
def test_a_cancel_between_the_publish_and_the_get_waking_takes_no_lease(
    broker: Broker, how: str
) -> None:
    reader, writer = Caller("uid:test", os.getpid()), Caller("uid:test", os.getpid() + 1)
    rsid = broker.open_session(reader).session
    wsid = broker.open_session(writer).session
    x = AllocRequest(name="x", shape=[4], dtype="uint8")

    async def go() -> None:
        # A segment made first, so that the publish below happens at once.
        await broker.put_inline(
            wsid, writer, AllocRequest(name="y", shape=[4], dtype="uint8"), b"yyyy"
        )
        if how == "get":
            call = broker.get(rsid, reader, "x", None, request="r1")
        else:
            wait = "any" if how == "get_many_any" else "all"
            call = broker.get_many(rsid, reader, ["x"], None, request="r1", wait=wait)  # type: ignore[arg-type]
        task = asyncio.ensure_future(call)
        while broker.stat().waiting == 0:
            await asyncio.sleep(0)
        # In one turn of the loop: the publish wakes the get, then the client's
        # cancel arrives (its deadline expired), before the get runs again.
        assert broker.try_put_inline(wsid, writer, x, b"xxxx") is not None
        broker.release(rsid, reader, [], ["r1"])
        with pytest.raises(Cancelled):
            await task
        st = broker.stat()
        assert (st.leases, st.waiting) == (0, 0), st

    asyncio.run(go())
    for sid in (rsid, wsid):
        broker.end_session(broker.sessions.get(sid), verified=True)
