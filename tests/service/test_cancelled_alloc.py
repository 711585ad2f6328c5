"""A client's cancel of an allocation that arrives while the broker makes
the allocation's memory (a new segment, in a worker thread): the cancel
finds nothing to give back yet, so the allocation must not be made after
it; otherwise it stays the session's, written and given back by nobody,
until the session ends.  (In this process, on the broker's own objects:
the window between the two is too short to hit from another process.)"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator

import pytest
from _harness import in_process_broker
from tensordepot import Cancelled
from tensordepot._wire import AllocRequest, ManyAlloc
from tensordepot.service import Broker
from tensordepot.service._registry._sessions import Caller

MiB = 1 << 20


@pytest.fixture
def broker() -> Iterator[Broker]:
    yield from in_process_broker("cancelled")


@pytest.mark.parametrize("many", [False, True], ids=["alloc", "alloc_many"])
def test_a_cancel_that_arrives_while_the_memory_is_made_refuses_the_allocation(
    broker: Broker, many: bool
) -> None:
    caller = Caller("uid:test", os.getpid())
    sid = broker.open_session(caller).session

    async def go() -> None:
        if many:
            req = ManyAlloc(names=["a", "b"], shapes=[[MiB], [MiB]], dtypes=["uint8", "uint8"])
            call = broker.alloc_many(sid, caller, req, "r1")
        else:
            call = broker.alloc(
                sid, caller, AllocRequest(name="a", shape=[2 * MiB], dtype="uint8"), request="r1"
            )
        task = asyncio.ensure_future(call)
        while broker.stat().bytes_reserved == 0:  # the segment is being made
            await asyncio.sleep(0)
        assert not task.done()
        broker.release(sid, caller, [], ["r1"])  # the client will never read the answer
        with pytest.raises(Cancelled):
            await task
        st = broker.stat()
        assert (st.versions, st.bytes_in_use) == (0, 0), st

    asyncio.run(go())
    broker.end_session(broker.sessions.get(sid), verified=True)
