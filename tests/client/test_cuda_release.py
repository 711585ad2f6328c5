"""A GPU lease's finalizer only queues, without a GPU: ``FakeCuda``
(tests/_fakecuda.py) stands in for cupy, and a real broker and Client do
the rest.  The finalizer runs wherever the last view dies, even inside
shm._cuda's own code holding its lock (a GC pass in ``open_mapping``); so it
makes no CUDA call and takes no lock, and the client's background thread
records the release event, then sends the release."""

from __future__ import annotations

import collections
import threading
from typing import Any

import pytest
from _fakecuda import FakeCuda
from _harness import BrokerProc, wait_for
from tensordepot import Client
from tensordepot.client._cuda_handles import gpu_lease
from tensordepot.client._cuda_tensor import Streams
from tensordepot.shm import _cuda
from tensordepot.shm._dlpack import STREAM_LEGACY, STREAM_PER_THREAD


@pytest.fixture
def cuda(monkeypatch: pytest.MonkeyPatch) -> FakeCuda:
    fake = FakeCuda()
    monkeypatch.setattr(_cuda, "_cupy", lambda: fake.module)
    monkeypatch.setattr(_cuda, "_streams", {})  # our own stream comes from the fake
    monkeypatch.setattr(_cuda, "_closing", collections.deque())
    return fake


def test_the_finalizer_only_queues_and_the_background_thread_records(
    broker: BrokerProc, cuda: FakeCuda
) -> None:
    with Client(broker.url) as c:
        c.list()  # a session, and its background thread
        core: Any = c._core
        streams = Streams(0, None, release_event=77)
        streams.consumed_on(None)  # the legacy default stream
        streams.consumed_on(0x55)  # and a stream of the consumer's
        held = [gpu_lease(core, 10**9, streams)]  # a lease id the broker never gave: ignored
        assert held[0] is not None
        dropped = threading.Event()

        def drop() -> None:
            held.clear()  # the last view goes: the finalizer runs here
            dropped.set()

        with _cuda._lock:  # as open_mapping holds it when a GC pass runs the finalizer
            threading.Thread(target=drop).start()
            assert dropped.wait(5), "the finalizer waited for shm._cuda's lock"
            assert cuda.recorded == [], "the finalizer called CUDA"
        own = wait_for(lambda: [r for r in cuda.recorded if r[0] == 77], what="the record")
        assert {name for *_, name in cuda.recorded + cuda.waited} == {"tensordepot-client"}
        # Both consumer streams joined on our own stream, where the event is recorded.
        assert {s for s, *_ in cuda.waited} == {own[0][1]}
        assert len(cuda.recorded) == 3 and len(cuda.waited) == 2
        wait_for(lambda: not core.bg.pending and not core.bg.records, what="the release sent")


def test_the_per_thread_default_stream_is_released_on_the_legacy_one() -> None:
    """Stream 2 names the calling thread's own stream; the release event is
    recorded from the background thread, so it goes on the legacy default
    stream, which waits for every thread's per-thread default stream."""
    streams = Streams(0, None, release_event=77)
    streams.consumed_on(STREAM_PER_THREAD)  # no write event: nothing to wait on
    assert streams.streams == {STREAM_LEGACY}


def test_a_mapping_closes_only_once_its_readers_kernels_are_done(
    broker: BrokerProc, cuda: FakeCuda
) -> None:
    """A reader's ``del`` (after ``Client.close()``, or after the broker let
    the block go) drops the last view while a kernel may still read it: the
    mapping is queued, and closed only once the lease's release event is
    recorded and complete."""
    with Client(broker.url) as c:
        c.list()
        core: Any = c._core
        uses = _cuda.Uses()
        streams = Streams(0, None, release_event=91)
        streams.consumed_on(0x66)  # the reader's stream, where its kernel is queued
        held = [gpu_lease(core, 10**9, streams, uses)]
        assert uses.unrecorded == {10**9}
        _cuda._closing.append(("blk", 0, 0xB10C, uses))  # what the mapping's finalizer queues
        _cuda.close_finished()
        assert cuda.closed == [], "closed before the release event was even recorded"
        held.clear()  # the last view goes
        wait_for(lambda: uses.events == [91] and not uses.unrecorded, what="the record")
        _cuda.close_finished()
        assert cuda.closed == [], "closed while the reader's kernel still runs"
        assert "blk" in _cuda.open_names(), "the broker must not free what is still mapped"
        cuda.completed.add(91)  # the kernel is done
        _cuda.close_finished()
        assert cuda.closed == [0xB10C] and not _cuda._closing
        assert "blk" not in _cuda.open_names()
