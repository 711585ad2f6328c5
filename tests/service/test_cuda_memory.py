"""The broker's GPU bookkeeping, without a GPU: the real Broker and the real
CudaMemory (pools, write and release events, deferred reuse, shares), with
``FakeGpus`` standing in for the GPU.

The fake has the interface of ``tensordepot.shm._cuda.Gpus``: it hands out
blocks and events with random 64-byte handles and lets a test say whether an
event has completed, the way a reader's kernel would.  Everything else is
what runs on a GPU machine.  ``tests/e2e/test_cuda.py`` runs the same paths
against a real GPU.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import subprocess
import sys
from collections.abc import Awaitable, Callable, Coroutine, Iterator
from typing import Any, TypeVar

import pytest
from _harness import TEST_PREFIX, shm_entries
from tensordepot import InvalidRequest, OutOfMemory, TensorNotFound
from tensordepot._wire import (
    AllocRequest,
    Handle,
    LiveRequest,
    ShareRequest,
    decode_ipc,
    encode_ipc,
)
from tensordepot.service import Broker
from tensordepot.service._http._render import handle
from tensordepot.service._registry._cuda import CudaMemory
from tensordepot.service._registry._quotas import Limits
from tensordepot.service._registry._sessions import Caller
from tensordepot.shm._device import DeviceMap
from tensordepot.shm._pool import Pool

MiB = 1 << 20
T = TypeVar("T")
U0 = "GPU-8932f937-d72c-4106-c12f-20bd9faed9f6"
U1 = "GPU-1b2c3d4e-aaaa-bbbb-cccc-000000000002"
HIDDEN = "GPU-00000000-1111-2222-3333-444444444444"


class FakeEvent:
    def __init__(self, gpu: FakeGpu) -> None:
        self.handle = os.urandom(64)
        self.done = True  # an event nobody recorded is complete
        self.destroyed = False
        gpu.events.append(self)

    def query(self) -> bool | None:
        assert not self.destroyed, "queried a destroyed event"
        return self.done

    def destroy(self) -> None:
        assert not self.destroyed, "destroyed twice"
        self.destroyed = True


class FakeBlock:
    kind = "cuda"

    def __init__(self, name: str, size: int) -> None:
        self.name, self.size = name, size
        self.ipc_handle = os.urandom(64)
        self.freed = False

    def unlink(self) -> None:
        assert not self.freed, "freed twice"
        self.freed = True


class FakeGpu:
    total_memory = 64 * MiB
    context_bytes = 500 * MiB

    def __init__(self) -> None:
        self.blocks: dict[str, FakeBlock] = {}
        self.events: list[FakeEvent] = []

    def block(self, name: str, size: int, **posix_options: Any) -> FakeBlock:
        b = self.blocks[name] = FakeBlock(name, size)
        return b

    def event(self) -> FakeEvent:
        return FakeEvent(self)


class FakeGpus:
    def __init__(self, uuids: list[str], reason: str | None = None) -> None:
        self.map = DeviceMap(uuids)
        self.reason = reason
        self.opened: dict[str, FakeGpu] = {}

    def unavailable(self) -> str | None:
        return self.reason

    def devices(self) -> DeviceMap:
        return self.map

    def open(self, ordinal: int, uuid: str) -> FakeGpu:
        assert uuid not in self.opened, "a GPU is opened once"
        g = self.opened[uuid] = FakeGpu()
        return g


def drive(coro: Coroutine[Any, Any, T]) -> T:
    """Run a broker coroutine from a test: with ``asyncio.run`` outside an event
    loop; inside one (a test's ``main``), step it, since allocating on a GPU
    never waits (only a CPU segment being made does)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)  # type: ignore[arg-type]
    try:
        coro.send(None)
    except StopIteration as done:
        return done.value  # type: ignore[no-any-return]
    coro.close()
    raise AssertionError("a GPU allocation waited inside a test's event loop")


class Rig:
    caller = Caller("uid:test", os.getpid())

    def __init__(self, broker: Broker, gpus: FakeGpus) -> None:
        self.broker, self.gpus = broker, gpus
        self.callers: dict[str, Caller] = {}
        self.sid = self.session()

    def session(self, pid: int | None = None) -> str:
        caller = Caller(self.caller.identity, pid or os.getpid())
        sid = self.broker.open_session(caller).session
        self.callers[sid] = caller  # a unix session is its process's alone
        return sid

    def alloc(
        self, name: str, nbytes: int, device: str = f"cuda:{U0}", sid: str | None = None
    ) -> Any:
        req = AllocRequest(name=name, shape=[nbytes], dtype="uint8", device=device)
        v, _ = drive(self.broker.alloc(sid or self.sid, self.caller, req))
        return v

    def put(
        self, name: str, nbytes: int, device: str = f"cuda:{U0}", sid: str | None = None
    ) -> Any:
        v = self.alloc(name, nbytes, device, sid)
        return self.broker.publish(sid or self.sid, self.caller, name, v.number)

    async def get(self, name: str, sid: str | None = None) -> Handle:
        sid = sid or self.sid
        v, lease = await self.broker.get(sid, self.callers.get(sid, self.caller), name, 0)
        return handle(self.broker, v, lease)

    def release(self, lease: int | None) -> None:
        self.broker.release(self.sid, self.caller, [lease or 0])

    def end(self, sid: str) -> None:
        self.broker.close_session(sid, self.caller)

    def share(self, sid: str, req: ShareRequest) -> Any:
        return drive(self.broker.cuda.share(self.broker, sid, self.caller, req))

    def event(self, event_handle: str | None) -> FakeEvent:
        assert event_handle is not None
        raw = decode_ipc(event_handle)
        return next(e for g in self.gpus.opened.values() for e in g.events if e.handle == raw)


@pytest.fixture
def rig() -> Iterator[Callable[..., Rig]]:
    made: list[tuple[Broker, str]] = []

    def make(
        uuids: list[str] | None = None,
        reason: str | None = None,
        cuda_memory: int | None = 16 * MiB,
        **broker_options: Any,
    ) -> Rig:
        prefix = f"{TEST_PREFIX}cudamem-{secrets.token_hex(4)}-"
        gpus = FakeGpus(uuids or [U0, U1], reason)
        pool = Pool(prefix, max_memory=8 * MiB, segment_size=1 * MiB, prefault=False)
        cuda = CudaMemory(prefix + "cuda-", max_memory=cuda_memory, segment_size=4 * MiB, gpus=gpus)
        broker = Broker(pool, cuda=cuda, **broker_options)
        made.append((broker, prefix))
        return Rig(broker, gpus)

    yield make
    for broker, prefix in made:
        broker.close()
        assert shm_entries(prefix) == []


def run(coro: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(coro())  # type: ignore[arg-type]


async def until(cond: Callable[[], Any], timeout: float = 5.0) -> None:
    """Let the event loop (and the event checker) run until ``cond()`` holds."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not cond():
        assert loop.time() < deadline, f"timed out waiting for {cond}"
        await asyncio.sleep(0.001)


def test_nothing_on_a_gpu_until_first_used(rig: Callable[..., Rig]) -> None:
    r = rig()
    assert r.broker.stat().devices == [] and r.gpus.opened == {}
    r.put("cpu-only", 100, device="cpu")
    assert r.gpus.opened == {}, "a CPU tensor touches no GPU"
    r.put("w", 1000)
    assert list(r.gpus.opened) == [U0], "only the GPU that was asked for"
    (dev,) = r.broker.stat().devices
    assert dev.device == f"cuda:{U0}" and dev.context_bytes == 500 * MiB
    assert dev.bytes_in_use == 1024 and dev.segments == 1 and dev.max_memory == 16 * MiB
    assert r.broker.stat().bytes_in_use == 1100


def test_a_cuda_handle_carries_the_block_and_the_events(rig: Callable[..., Rig]) -> None:
    r = rig()

    async def main() -> None:
        v = r.put("w", 3000)
        h = await r.get("w")
        assert (h.kind, h.device, h.nbytes, h.version) == ("cuda", f"cuda:{U0}", 3000, v.number)
        assert h.cuda is not None and h.cuda.uuid == U0
        block = r.gpus.opened[U0].blocks[h.segment]
        assert decode_ipc(h.cuda.ipc_handle) == block.ipc_handle
        assert h.cuda.block_size == block.size and h.offset + h.nbytes <= block.size
        assert r.event(h.cuda.event_handle) is not r.event(h.cuda.release_event_handle)
        assert h.cuda.owner_pid is None, "a broker block has no producer to outlive"
        again = Handle.model_validate_json(h.model_dump_json())
        assert again == h
        info = r.broker.list()[0]
        assert info.device == f"cuda:{U0}"
        r.release(h.lease)

    run(main)


@pytest.mark.parametrize(
    "device,match",
    [
        pytest.param("cuda:0", "name the GPU by UUID", id="ordinal"),
        pytest.param("cuda", "name the GPU by UUID", id="plain-cuda"),
        pytest.param(f"cuda:{HIDDEN}", "not visible", id="hidden-gpu"),
        pytest.param("cuda:banana", "use 'cpu'", id="junk"),
        pytest.param("tpu:0", "use 'cpu'", id="tpu"),
    ],
)
def test_bad_devices_are_400_and_leave_nothing(
    rig: Callable[..., Rig], device: str, match: str
) -> None:
    r = rig()
    with pytest.raises(InvalidRequest, match=match):
        r.alloc("w", 10, device=device)
    st = r.broker.stat()
    assert (st.versions, st.bytes_in_use, st.tensors) == (0, 0, 0) and r.broker.entries == {}


def test_a_broker_without_cuda_says_why(rig: Callable[..., Rig]) -> None:
    r = rig(reason="cupy is not installed")
    with pytest.raises(InvalidRequest, match="cannot hold GPU memory: cupy is not installed"):
        r.alloc("w", 10)
    r.put("cpu", 10, device="cpu")  # the CPU never notices
    assert r.broker.stat().devices == []


def test_the_per_gpu_limit_is_out_of_memory(rig: Callable[..., Rig]) -> None:
    r = rig(cuda_memory=8 * MiB)
    r.put("a", 3 * MiB)
    r.put("b", 3 * MiB)
    with pytest.raises(OutOfMemory, match="--cuda-memory"):
        r.alloc("c", 3 * MiB)
    r.put("c", 3 * MiB, device=f"cuda:{U1}")  # another GPU has its own limit
    r.put("d", 3 * MiB, device="cpu")
    assert {d.device for d in r.broker.stat().devices} == {f"cuda:{U0}", f"cuda:{U1}"}


def test_auto_limit_is_half_the_gpu(rig: Callable[..., Rig]) -> None:
    r = rig(cuda_memory=None)
    r.put("w", 10)
    assert r.broker.stat().devices[0].max_memory == FakeGpu.total_memory // 2


def test_a_batch_shares_one_write_event(rig: Callable[..., Rig]) -> None:
    r = rig()

    async def main() -> None:
        a, b = r.alloc("a", 100), r.alloc("b", 5 * MiB)  # one pass of the loop: one batch
        other = r.session()
        c = r.alloc("c", 100, sid=other)
        await asyncio.sleep(0)
        d = r.alloc("d", 100)
        ev = [handle(r.broker, v).cuda.event for v in (a, b, c, d)]  # type: ignore[union-attr]
        assert ev[0] == ev[1], "one event per batch"
        assert len({ev[0], ev[2], ev[3]}) == 3, "not across sessions or loop passes"
        r.end(other)

    run(main)


@pytest.mark.parametrize("how", ["alloc-ttl", "abort"])
def test_the_event_of_a_write_never_published_is_never_handed_out_again(
    rig: Callable[..., Rig], how: str
) -> None:
    """Its writer may still be alive and record it (stopped past --alloc-ttl,
    or a copy still queued when it gave up): as another lease's release event,
    that record could end the wait for a reader's kernels before they finish."""
    now = [0.0]
    r = rig(limits=Limits(alloc_ttl=5.0), clock=lambda: now[0])

    async def main() -> None:
        v = r.alloc("w", 4096)
        written = handle(r.broker, v).cuda
        assert written is not None and written.event_handle is not None
        await asyncio.sleep(0)  # the batch, whose own hold kept the event, ends
        if how == "abort":
            r.broker.abort(r.sid, r.caller, "w", v.number)
        else:
            now[0] = 6.0
            r.broker.expire()
        assert r.broker.stat().versions == 0
        assert r.event(written.event_handle).destroyed
        r.put("x", 4096)
        h = await r.get("x")
        assert h.cuda is not None
        handed = {h.cuda.event_handle, h.cuda.release_event_handle}
        assert written.event_handle not in handed
        r.release(h.lease)

    run(main)


def test_the_event_of_a_published_write_is_used_again(rig: Callable[..., Rig]) -> None:
    """Its writer recorded it for the last time before it published."""
    r = rig()

    async def main() -> None:
        v = r.put("w", 4096)
        written = handle(r.broker, v).cuda
        assert written is not None and written.event_handle is not None
        await asyncio.sleep(0)
        r.broker.delete("w")
        assert not r.event(written.event_handle).destroyed
        r.put("x", 4096)
        h = await r.get("x")
        assert h.cuda is not None
        assert written.event_handle in {h.cuda.event_handle, h.cuda.release_event_handle}
        r.release(h.lease)

    run(main)


@pytest.mark.parametrize("freed_when", ["it says so", "its session ends"])
def test_a_block_a_reader_may_still_map_is_not_freed_and_counts_against_the_limit(
    rig: Callable[..., Rig], freed_when: str
) -> None:
    """cudaFree under an importer's mapping is undefined, and its memory stays
    pinned: a block the pool lets go of while a reader's process may map it
    is held, counted against --cuda-memory, and freed once every session it
    was handed to (the writer's too) says (``/v1/cuda/live`` without it) it
    no longer maps it, or has ended."""
    r = rig(cuda_memory=8 * MiB)

    async def main() -> None:
        r.put("a", 3 * MiB)
        reader = r.session()
        h = await r.get("a", sid=reader)
        block = r.gpus.opened[U0].blocks[h.segment]
        r.broker.release(reader, r.callers[reader], [h.lease or 0])
        r.broker.delete("a")
        await until_settled()
        with pytest.raises(OutOfMemory, match="a client process may still map"):
            r.alloc("b", 7 * MiB)  # the pool drops a's block, which the reader may map
        assert not block.freed, "freed under the reader's mapping"
        (dev,) = r.broker.stat().devices
        assert dev.bytes_reserved >= 3 * MiB and dev.max_memory == 8 * MiB
        r.broker.cuda.live(r.broker, LiveRequest(segments=[h.segment]), reader)
        assert not block.freed, "the reader still maps it"
        if freed_when == "it says so":
            r.broker.cuda.live(r.broker, LiveRequest(segments=[]), reader)
        else:
            r.end(reader)
        assert not block.freed, "its writer was handed it too, and may still map it"
        r.broker.cuda.live(r.broker, LiveRequest(segments=[]), r.sid)
        assert block.freed
        r.put("b", 7 * MiB)  # its bytes are back under the limit

    async def until_settled() -> None:
        await until(lambda: not r.broker.cuda.pending())  # the release event checked off

    run(main)


def test_reuse_waits_for_the_readers_release_event(rig: Callable[..., Rig]) -> None:
    r = rig()

    async def main() -> None:
        r.put("w", 4096)
        h = await r.get("w")
        assert h.cuda is not None
        reading = r.event(h.cuda.release_event_handle)
        r.put("w", 4096)  # v1 is retired; the reader still holds it
        reading.done = False  # the reader's kernel is still queued when it releases
        r.release(h.lease)
        assert r.broker.counters.get("cuda_frees_deferred") == 1
        (dev,) = r.broker.stat().devices
        assert dev.bytes_pending == 4096
        busy = r.alloc("x", 4096)
        assert (busy.block.segment, busy.block.offset) != (h.segment, h.offset), (
            "memory a queued kernel may read is not handed out"
        )
        await asyncio.sleep(0.05)
        assert r.broker.stat().devices[0].bytes_pending == 4096, (
            "still pending while the kernel runs"
        )
        reading.done = True
        await until(lambda: r.broker.stat().devices[0].bytes_pending == 0)
        made = len(r.gpus.opened[U0].events)
        await asyncio.sleep(0)  # a new batch: it needs a write event
        again = r.alloc("y", 4096)
        assert (again.block.segment, again.block.offset) == (h.segment, h.offset), (
            "reused once done"
        )
        assert len(r.gpus.opened[U0].events) == made, "the completed release event was reused"
        h2 = await r.get("w")
        r.release(h2.lease)
        await until(lambda: not r.broker.cuda.pending())

    run(main)


def test_an_event_whose_reader_died_counts_as_complete(rig: Callable[..., Rig]) -> None:
    r = rig()
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        reader = r.session(pid=proc.pid)

        async def main() -> None:
            r.put("w", 4096)
            h = await r.get("w", sid=reader)
            assert h.cuda is not None
            ev = r.event(h.cuda.release_event_handle)
            ev.done = False  # recorded before the reader died; it never completes
            r.put("w", 4096)
            proc.kill()
            proc.wait()
            assert r.broker.reap() == [reader]
            await until(lambda: r.broker.stat().devices[0].bytes_pending == 0)
            assert ev.destroyed, "an event a dead process recorded is never reused"

        run(main)
    finally:
        proc.kill()
        proc.wait()


def share_request(
    name: str, nbytes: int, handle: bytes, offset: int = 256, alloc_size: int = 2 * MiB
) -> ShareRequest:
    return ShareRequest(
        name=name,
        shape=[nbytes // 4],
        dtype="float32",
        device=f"cuda:{U0}",
        ipc_handle=encode_ipc(handle),
        offset=offset,
        alloc_size=alloc_size,
    )


def test_a_share_lives_with_its_producer(rig: Callable[..., Rig]) -> None:
    r = rig()
    raw = os.urandom(64)

    async def main() -> None:
        producer = r.session()
        v = r.share(producer, share_request("s", 4096, raw))
        assert v.state == "ready" and r.broker.stat().bytes_in_use == 4096
        h = await r.get("s")
        assert h.cuda is not None and decode_ipc(h.cuda.ipc_handle) == raw
        assert (h.offset, h.cuda.block_size, h.cuda.owner_pid) == (256, 2 * MiB, os.getpid())
        assert h.cuda.event is None, "the producer's writes were done before it shared"
        seg = h.segment
        live = r.broker.cuda.live(r.broker, LiveRequest(segments=[seg, "nope"]))
        assert (live.live, live.busy, live.orphaned) == ([seg], [seg], [])
        assert r.gpus.opened[U0].blocks == {}, "a share allocates nothing"
        r.end(producer)
        with pytest.raises(TensorNotFound):
            await r.get("s")  # the name is withdrawn with its producer
        live = r.broker.cuda.live(r.broker, LiveRequest(segments=[seg]))
        assert live.orphaned == [seg], "a reader can tell its producer is gone"
        r.release(h.lease)
        await until(lambda: not r.broker.cuda.live(r.broker, LiveRequest(segments=[seg])).live)
        st = r.broker.stat()
        assert (st.bytes_in_use, st.versions, st.leases) == (0, 0, 0)

    run(main)


def test_a_share_must_fit_its_allocation(rig: Callable[..., Rig]) -> None:
    r = rig()
    with pytest.raises(InvalidRequest, match="does not fit"):
        r.share(r.sid, share_request("s", 4096, os.urandom(64), offset=2 * MiB - 100))
    with pytest.raises(InvalidRequest, match="name the GPU by UUID"):
        r.share(
            r.sid, share_request("s", 4, os.urandom(64)).model_copy(update={"device": "cuda:0"})
        )
    assert r.broker.entries == {} and r.broker.stat().bytes_in_use == 0


def test_close_frees_every_block_and_event(rig: Callable[..., Rig]) -> None:
    r = rig()

    async def main() -> None:
        r.put("a", 100)
        r.put("b", 5 * MiB)
        h = await r.get("a")
        assert h.cuda is not None
        r.event(h.cuda.release_event_handle).done = False
        r.put("a", 100)
        r.release(h.lease)  # pending at close
        r.broker.close()

    run(main)
    gpu = r.gpus.opened[U0]
    assert gpu.blocks and all(b.freed for b in gpu.blocks.values())
    assert gpu.events and all(e.destroyed for e in gpu.events)


def test_metrics_label_each_gpu_in_use(rig: Callable[..., Rig]) -> None:
    """/metrics' broker collector, read back through prometheus_client's parser:
    shared memory is device="cpu", each GPU in use a device of its own."""
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.parser import text_string_to_metric_families
    from tensordepot.service._metrics import BrokerCollector

    r = rig()
    registry = CollectorRegistry(auto_describe=False)
    registry.register(BrokerCollector(lambda: r.broker))

    def scrape() -> dict[tuple[str, str], float]:
        families = list(text_string_to_metric_families(generate_latest(registry).decode()))
        assert all(f.documentation.strip() for f in families), "HELP on every metric"
        return {(s.name, s.labels.get("device", "")): s.value for f in families for s in f.samples}

    assert not [k for k in scrape() if k[1].startswith("cuda:")], "no GPU series before one is used"
    g0, g1 = f"cuda:{U0}", f"cuda:{U1}"
    r.put("cpu-only", 100, device="cpu")  # outside the loop below: making a segment waits

    async def main() -> None:
        r.put("w", 1000)  # on U0
        r.put("x", 3 * MiB, device=g1)
        h = await r.get("w")
        assert h.cuda is not None
        reading = r.event(h.cuda.release_event_handle)
        r.put("w", 1000)  # v1 retired while read ...
        reading.done = False  # ... by a kernel still queued when its reader releases it
        r.release(h.lease)
        producer = r.session()
        r.share(producer, share_request("s", 4096, os.urandom(64)))

        m = scrape()
        devices = {d.device: d for d in r.broker.stat().devices}
        assert set(devices) == {g0, g1}
        assert m[("tensordepot_memory_in_use_bytes", "cpu")] == 256, "the CPU tensor's block only"
        assert m[("tensordepot_memory_in_use_bytes", g0)] == 1024
        assert m[("tensordepot_cuda_pending_bytes", g0)] == 1024
        assert m[("tensordepot_cuda_pending_bytes", g1)] == 0
        assert m[("tensordepot_cuda_shared_bytes", g0)] == 4096
        assert m[("tensordepot_cuda_shared_bytes", g1)] == 0
        for dev, d in devices.items():
            assert m[("tensordepot_memory_in_use_bytes", dev)] == d.bytes_in_use > 0
            assert m[("tensordepot_memory_reserved_bytes", dev)] == d.bytes_reserved > 0
            assert m[("tensordepot_memory_warm_free_bytes", dev)] == (
                d.bytes_reserved - d.bytes_in_use - d.bytes_pending
            )
            assert m[("tensordepot_memory_limit_bytes", dev)] == 16 * MiB
            assert m[("tensordepot_segments", dev)] == d.segments >= 1
            assert m[("tensordepot_cuda_context_bytes", dev)] == 500 * MiB
            assert m[("tensordepot_cuda_events", dev)] == d.events
            assert ("tensordepot_memory_retired_bytes", dev) not in m, "shared memory only"
        assert m[("tensordepot_memory_limit_bytes", "cpu")] == 8 * MiB

        reading.done = True
        await until(lambda: not r.broker.cuda.pending())
        assert scrape()[("tensordepot_cuda_pending_bytes", g0)] == 0
        r.end(producer)

    run(main)
