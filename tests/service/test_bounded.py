"""Broker state is bounded by live work, never by history: requests that
leave nothing live leave nothing behind (measured with tracemalloc on the
broker's own objects, in this process)."""

from __future__ import annotations

import asyncio
import gc
import os
import tracemalloc
from collections.abc import Iterator

import pytest
from _harness import in_process_broker
from tensordepot import TensorNotFound
from tensordepot.service import Broker
from tensordepot.service._registry._sessions import Caller


@pytest.fixture
def broker() -> Iterator[Broker]:
    yield from in_process_broker("bounded")


def _grown(work: object, warm: object) -> int:
    """Bytes still allocated after ``work()``, once ``warm()`` ran first."""
    warm()  # type: ignore[operator]
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        work()  # type: ignore[operator]
        gc.collect()
        return tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize("many", [False, True], ids=["get", "get_many"])
def test_timed_out_gets_of_names_never_seen_leave_nothing(broker: Broker, many: bool) -> None:
    caller = Caller("uid:test", os.getpid())
    sid = broker.open_session(caller).session

    def gets(start: int, n: int) -> None:
        async def go() -> None:
            for i in range(start, start + n):
                with pytest.raises(TensorNotFound):
                    if many:
                        await broker.reads.get_many(
                            sid, caller, [f"never-{i}"], 0.0001, request=f"r{i}"
                        )
                    else:
                        await broker.reads.get(sid, caller, f"never-{i}", 0.0001, request=f"r{i}")

        asyncio.run(go())

    grown = _grown(lambda: gets(500, 2000), lambda: gets(0, 500))
    assert grown < 64 << 10, f"2,000 timed-out gets left {grown} bytes in the broker"
    assert broker.waiting == 0 and broker.stat().leases == 0
