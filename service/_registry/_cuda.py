"""The broker's GPU memory: one pool of CUDA blocks per GPU, interprocess
events, deferred reuse, and producer-owned shares.

The broker calls in through a few hooks (``alloc``, ``free``, ``handle``,
``on_lease``, ``on_release``, ``end_session``, ``stat``, ``close``); the
names, versions and leases stay the broker's.  Everything runs on the
event loop, except event queries, which a task runs in a worker thread.

* **Nothing on a GPU until it is used.**  The first allocation on a GPU
  creates the broker's context there, its pool and its events; ``stat``
  lists only GPUs in use.  Without cupy or a GPU, a CUDA request is a 400
  that says why, and the CPU never notices.
* **Write events.**  Every allocation gets an interprocess event that the
  writer records after its copy or fill and waits for before it publishes;
  readers make their stream wait on it.  One event serves a whole batch:
  allocations of one session on one GPU in one pass of the event loop (a
  batch's) share it.
* **Release events, and deferred reuse.**  Every lease of a CUDA version
  gets its own event.  The reader records it, at release, on each stream
  that used the tensor, and sends the release without waiting.  A block
  (or a range of one) whose leases have ended is handed to a new tensor
  only after every such event has completed, which a task checks off the
  event loop.  An event recorded by a process that has since died counts as
  complete: its context, and every kernel in it, died with it.
* **Shares.**  ``share()`` publishes memory a producer owns, by its IPC
  handle and offset.  The broker never frees it; it withdraws the names of
  a producer's shares when the producer's session ends.

* **Blocks a client may still map.**  A block the pool lets go of while a
  live session that was handed it may still map it is held, not freed
  (``cudaFree`` under an importer's mapping is undefined, and pins the
  memory), and counted against --cuda-memory until each such session says
  (``live``) that its process no longer maps it, or ends.

Why one module of over 600 lines: its parts share three tables, the live
leases' release events, the blocks waiting for them, and the sessions each
block was handed to, and each part changes them; split, each file would
import the others' private state.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import itertools
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from ..._errors import InvalidRequest, OutOfMemory
from ..._proto import proc_stat
from ..._wire import (
    AllocRequest,
    CudaHandle,
    DeviceStat,
    Handle,
    LiveReply,
    LiveRequest,
    ShareRequest,
    decode_ipc,
    encode_ipc,
)
from ...shm import dtype_from_name
from ...shm._device import DeviceError, DeviceMap, parse_device, uuid_key
from ...shm._pool import Block, Pool, PoolExhausted

if TYPE_CHECKING:
    from ._records import Entry, Lease, Version
    from ._sessions import Caller, Session, Sessions

log = logging.getLogger("tensordepot.broker")

MiB = 1 << 20
_FIRST_POLL = 0.0005  # s between event checks while they complete; backs off to _LAST_POLL
_LAST_POLL = 0.05


class GpuEvent(Protocol):
    handle: bytes

    def query(self) -> bool | None: ...
    def destroy(self) -> None: ...


class GpuBlock(Protocol):
    kind: str
    name: str
    size: int
    ipc_handle: bytes

    def unlink(self) -> None: ...


class Gpu(Protocol):
    """One GPU, opened (``tensordepot.shm._cuda.Gpu``)."""

    total_memory: int
    context_bytes: int | None

    def block(self, name: str, size: int, **posix_options: Any) -> GpuBlock: ...
    def event(self) -> GpuEvent: ...


class Gpus(Protocol):
    """The broker's way into CUDA (``tensordepot.shm._cuda.Gpus``)."""

    def unavailable(self) -> str | None: ...
    def devices(self) -> DeviceMap: ...
    def open(self, ordinal: int, uuid: str) -> Gpu: ...


class Registry(Protocol):
    """What shares and session ends need of the broker (``_broker.Broker``)."""

    @property
    def closing(self) -> bool: ...
    @property
    def entries(self) -> dict[str, Entry]: ...
    @property
    def sessions(self) -> Sessions: ...

    def delete(self, name: str) -> None: ...
    async def alloc(
        self,
        sid: str | None,
        caller: Caller,
        req: AllocRequest,
        block: Block | None = None,
        request: str | None = None,
    ) -> tuple[Version, int | None]: ...
    def publish(self, sid: str | None, caller: Caller, name: str, number: int) -> Version: ...


@dataclass(eq=False)
class _Event:
    id: int
    ev: GpuEvent
    handle: str  # base64, as it goes on the wire
    dev: _Device
    refs: int = 0  # blocks that use it as their write event, plus one per lease that holds it
    # A writer may still record it: a block of its was freed unpublished (an
    # abort, an --alloc-ttl expiry) while its writer lived.  Never reused.
    live_writer: bool = False


@dataclass(eq=False)
class _Pending:
    """A released lease's event: the block waits until it completes."""

    event: _Event
    segment: str
    block: Block
    pid: int | None
    start: int | None


@dataclass(eq=False)
class _Lent:
    """A live lease's release event, and who holds it."""

    event: _Event
    block: Block
    pid: int | None
    start: int | None


@dataclass(eq=False)
class _Share:
    session: str
    pid: int | None
    start: int | None
    ipc_handle: str


@dataclass(eq=False)
class _Device:
    uuid: str
    ordinal: int
    gpu: Gpu
    pool: Pool
    ipc: dict[str, tuple[str, int]]  # block name -> (IPC handle, size)
    free_events: list[_Event] = field(default_factory=list)
    events: set[_Event] = field(default_factory=set)  # every event not destroyed yet
    limit: int = 0  # --cuda-memory for this GPU
    # segment -> sessions that were handed a handle into it, and may have it mapped
    mapped_by: dict[str, set[str]] = field(default_factory=dict)
    # Segments the pool let go of while a live session may still map them: not
    # freed until each says it no longer does (or ends), and counted meanwhile.
    held: dict[str, Any] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return f"cuda:{self.uuid}"

    @property
    def held_bytes(self) -> int:
        """Bytes of the held segments: counted against the limit, not the pool's."""
        return sum(seg.size for seg in self.held.values())


def _never(_what: str, _n: int = 1) -> None:
    pass


class CudaMemory:
    """Every GPU the broker serves.  See the module docstring."""

    def __init__(
        self,
        prefix: str = "tensordepot-cuda-",
        *,
        max_memory: int | None = None,
        segment_size: int = 256 * MiB,
        gpus: Gpus | None = None,
    ) -> None:
        self.prefix = prefix
        self.max_memory = max_memory  # per GPU; None: half of each GPU's memory
        self.segment_size = segment_size
        self._gpus = gpus
        self.count: Callable[..., None] = _never  # the broker's counters
        self._devices: dict[str, _Device] = {}  # by uuid_key
        self._event_ids = itertools.count(1)
        self._write: dict[Block, _Event] = {}
        self._batch: dict[tuple[str, str], _Event] = {}
        self._batch_ends = False
        self._leases: dict[int, _Lent] = {}
        self._leased: dict[str, int] = {}  # segment -> live leases on its blocks
        self._pending: list[_Pending] = []
        self._pending_blocks: dict[Block, int] = {}
        self._freeing: set[Block] = set()
        self._shares: dict[Block, _Share] = {}
        self._share_names: dict[str, int] = {}  # segment -> share blocks not yet gone
        self._checker: asyncio.Task[None] | None = None
        self._closed = False

    # -- devices -----------------------------------------------------------------
    @property
    def gpus(self) -> Gpus:
        if self._gpus is None:
            from ...shm._cuda import Gpus as CudaGpus  # imports no CUDA until used

            self._gpus = CudaGpus()
        return self._gpus

    @staticmethod
    def wire_uuid(device: str) -> str:
        """The GPU a request names.  Requests name GPUs by UUID: an ordinal
        means a different GPU in each process (CUDA_VISIBLE_DEVICES)."""
        try:
            d = parse_device(device)
        except DeviceError as exc:
            raise InvalidRequest(str(exc)) from None
        if not d.is_cuda:
            raise InvalidRequest(f"device {device!r} is not a GPU")
        if d.uuid is None:
            raise InvalidRequest(
                f"device {device!r}: name the GPU by UUID, cuda:GPU-<uuid> (nvidia-smi -L lists "
                "them); an ordinal differs between processes with different CUDA_VISIBLE_DEVICES. "
                "The Python client does this for you"
            )
        return d.uuid

    def check_device(self, device: str) -> None:
        """The broker's check of an allocation on any device that is not the CPU."""
        self.wire_uuid(device)

    def _device(self, uuid: str) -> _Device:
        key = uuid_key(uuid)
        dev = self._devices.get(key)
        if dev is not None:
            return dev
        reason = self.gpus.unavailable()
        if reason is not None:
            raise InvalidRequest(
                f"this broker cannot hold GPU memory: {reason}. Start it where cupy is installed "
                f"and the GPU is visible, or put the tensor on the CPU (device='cpu')"
            )
        try:
            ordinal = self.gpus.devices().ordinal(uuid)
        except DeviceError as exc:
            raise InvalidRequest(f"the broker cannot use that GPU: {exc}") from None
        try:
            gpu = self.gpus.open(ordinal, uuid)
        except Exception as exc:  # a CUDA failure is a fact about the machine
            raise InvalidRequest(
                f"the broker cannot open GPU {uuid} (cuda:{ordinal}): {exc}"
            ) from None
        limit = self.max_memory if self.max_memory is not None else gpu.total_memory // 2
        ipc: dict[str, tuple[str, int]] = {}
        factory = functools.partial(_new_block, gpu, ipc)
        factory.kind = "cuda"  # type: ignore[attr-defined]  # how the pool names the segments
        made: list[_Device] = []
        pool = Pool(
            self.prefix,
            max_memory=limit,
            segment_size=self.segment_size,
            segment_factory=factory,
            device=f"cuda:{uuid}",
            unlinker=lambda seg: self._unlink(made[0], seg),
        )
        pool.on_drop = ipc.__delitem__
        dev = self._devices[key] = _Device(uuid, ordinal, gpu, pool, ipc, limit=limit)
        made.append(dev)
        log.info(
            "GPU %s (cuda:%d in the broker) in use: limit %d MiB, context %s",
            uuid,
            ordinal,
            limit // MiB,
            "unknown" if gpu.context_bytes is None else f"{gpu.context_bytes // MiB} MiB",
        )
        return dev

    def _dev_of(self, block: Block) -> _Device:
        return self._devices[uuid_key(block.device.split(":", 1)[1])]

    # -- blocks clients may still map ----------------------------------------------
    def _mapped(self, dev: _Device, segment: str, session: str) -> None:
        dev.mapped_by.setdefault(segment, set()).add(session)

    def _unlink(self, dev: _Device, seg: Any) -> None:
        """The pool lets a segment go.  Freed now unless a live session may
        still map it: cudaFree under an importer's mapping is undefined, and
        its memory stays pinned, so it is held (and counted against
        --cuda-memory) until each such session says it no longer maps it."""
        if dev.mapped_by.get(seg.name) and not self._closed:
            dev.held[seg.name] = seg
            self._limit_pool(dev)
            self.count("cuda_blocks_held_open")
            return
        dev.mapped_by.pop(seg.name, None)
        seg.unlink()

    def _limit_pool(self, dev: _Device) -> None:
        dev.pool.max_memory = dev.limit - dev.held_bytes

    def _unmapped(self, dev: _Device, segment: str, session: str) -> None:
        """``session`` no longer maps ``segment``: free it if it was held for it."""
        holders = dev.mapped_by.get(segment)
        if holders is None:
            return
        holders.discard(session)
        if not holders and segment in dev.held:
            del dev.mapped_by[segment]
            dev.held.pop(segment).unlink()
            self._limit_pool(dev)

    # -- events --------------------------------------------------------------------
    def _acquire(self, dev: _Device) -> _Event:
        if dev.free_events:
            return dev.free_events.pop()
        e = _Event(next(self._event_ids), dev.gpu.event(), "", dev)
        e.handle = encode_ipc(e.ev.handle)
        dev.events.add(e)
        return e

    def _unref(self, e: _Event, *, reusable: bool = True) -> None:
        e.refs -= 1
        if e.refs > 0:
            return
        if reusable and not e.live_writer and not self._closed:
            e.dev.free_events.append(e)
        else:
            e.dev.events.discard(e)
            e.ev.destroy()

    def _write_event(self, session: str, dev: _Device) -> _Event:
        """The event for a new block: shared by a session's allocations on one
        GPU within one pass of the event loop (one batch)."""
        key = (session, dev.uuid)
        e = self._batch.get(key)
        if e is None:
            e = self._acquire(dev)
            try:
                asyncio.get_running_loop().call_soon(self._end_batch, key)
            except RuntimeError:  # no loop (a direct call): no batch to share with
                e.refs += 1
                return e
            e.refs += 1  # the batch's own hold: the event cannot be handed out meanwhile
            self._batch[key] = e
        e.refs += 1
        return e

    def _end_batch(self, key: tuple[str, str]) -> None:
        e = self._batch.pop(key, None)
        if e is not None:
            self._unref(e)

    # -- broker hooks -----------------------------------------------------------------
    def alloc(self, session: Session, name: str, device: str, nbytes: int) -> Block:
        """A block for ``name`` on the GPU ``device`` names; OutOfMemory past
        --cuda-memory."""
        dev = self._device(self.wire_uuid(device))
        try:
            block = dev.pool.alloc(nbytes)
        except PoolExhausted as exc:
            held = dev.held_bytes
            why = (
                f" ({held} bytes of it are blocks a client process may still map: they "
                f"come back once its client reports them unmapped, within seconds when "
                f"idle, or its session ends)"
                if held
                else ""
            )
            fix = exc.fix(
                "--cuda-memory",
                "--cuda-segment-size",
                f"GPU {dev.uuid} (nvidia-smi shows who holds it)",
            )
            raise OutOfMemory(
                f"cannot place {name!r} ({nbytes} bytes) on GPU {dev.uuid}: {exc}{why}; {fix}"
            ) from None
        self._write[block] = self._write_event(session.id, dev)
        self._mapped(dev, block.segment, session.id)
        return block

    def free(self, block: Block, *, written: bool = True) -> None:
        """A block no version uses any more: reuse it once readers' kernels are done.
        ``written``: its version was published, so its writer has recorded
        the write event for the last time; otherwise a live writer may still
        record it, and the event is destroyed, never handed out again."""
        e = self._write.pop(block, None)
        if e is not None:
            e.live_writer = e.live_writer or not written
            self._unref(e)
        if self._pending_blocks.get(block):
            self._freeing.add(block)
            self.count("cuda_frees_deferred")
            return
        self._finish(block)

    def _finish(self, block: Block) -> None:
        self._freeing.discard(block)
        share = self._shares.pop(block, None)
        if share is not None:
            n = self._share_names[block.segment] - 1
            if n:
                self._share_names[block.segment] = n
            else:
                del self._share_names[block.segment]
            return
        self._dev_of(block).pool.free(block)

    def on_lease(self, lease_id: int, held: tuple[Version, ...], session: Session) -> None:
        """A lease of a GPU version gets its own release event.  ``held``: the
        lease's versions, which share one block when they are several (a
        pack, in host memory)."""
        block = held[0].block
        if block.device == "cpu":
            return
        dev = self._dev_of(block)
        self._mapped(dev, block.segment, session.id)
        e = self._acquire(dev)
        e.refs += 1
        # The reader's pid, to tell later whether a pending record can still complete.
        pid, start = (session.pid, session.start_time) if session.tracked else (None, None)
        self._leases[lease_id] = _Lent(e, block, pid, start)
        self._leased[block.segment] = self._leased.get(block.segment, 0) + 1

    def on_release(self, lease: Lease) -> None:
        """The lease ended: its block waits for the release event before reuse."""
        got = self._leases.pop(lease.id, None)
        if got is None:
            return
        block = got.block
        n = self._leased[block.segment] - 1
        if n:
            self._leased[block.segment] = n
        else:
            del self._leased[block.segment]
        self._pending.append(_Pending(got.event, block.segment, block, got.pid, got.start))
        self._pending_blocks[block] = self._pending_blocks.get(block, 0) + 1
        self._kick()

    def handle(self, v: Version, lease: int | None, strides: list[int]) -> Handle:
        block = v.block
        dev = self._dev_of(block)
        share = self._shares.get(block)
        if share is not None:
            ipc, size = share.ipc_handle, block.size
        else:
            ipc, size = dev.ipc[block.segment]
        w = self._write.get(block)
        r = self._leases.get(lease) if lease is not None else None
        cuda = CudaHandle.model_construct(
            uuid=dev.uuid,
            ipc_handle=ipc,
            block_size=size,
            event=None if w is None else w.id,
            event_handle=None if w is None else w.handle,
            release_event=None if r is None else r.event.id,
            release_event_handle=None if r is None else r.event.handle,
            owner_pid=None if share is None else share.pid,
            owner_start=None if share is None else share.start,
        )
        return Handle(
            name=v.name,
            version=v.number,
            kind="cuda",
            segment=block.segment,
            offset=block.offset,
            nbytes=block.nbytes,
            shape=list(v.shape),
            strides=strides,
            dtype=v.dtype,
            device=block.device,
            state=v.state,
            lease=lease,
            cuda=cuda,
        )

    def end_session(self, broker: Registry, session: Session) -> None:
        """Withdraw the names whose current version is memory this session
        shared, and free the blocks held for it alone."""
        for dev in self._devices.values():
            for segment in [n for n, who in dev.mapped_by.items() if session.id in who]:
                self._unmapped(dev, segment, session.id)
        mine = {b for b, s in self._shares.items() if s.session == session.id}
        if not mine or broker.closing:
            return
        for name, entry in list(broker.entries.items()):
            v = entry._ready  # shared GPU memory is a Version's, never a pack's row
            if v is not None and v.block in mine:
                broker.delete(name)
                self.count("shares_withdrawn")

    async def share(
        self, broker: Registry, sid: str | None, caller: Caller, req: ShareRequest
    ) -> Version:
        """Publish producer-owned memory as the next version of ``req.name``."""
        uuid = self.wire_uuid(req.device)
        dev = self._device(uuid)  # the leases' release events live on this GPU
        try:
            itemsize = dtype_from_name(req.dtype).itemsize
        except ValueError as exc:
            raise InvalidRequest(str(exc)) from None
        nbytes = math.prod(req.shape) * itemsize
        if req.offset + nbytes > req.alloc_size:
            raise InvalidRequest(
                f"a {nbytes} byte tensor at offset {req.offset} does not fit in the "
                f"{req.alloc_size} byte allocation the handle maps"
            )
        s = broker.sessions.get(sid or "")
        segment = "share-" + hashlib.sha256(decode_ipc(req.ipc_handle)).hexdigest()[:32]
        block = Block(segment, req.offset, nbytes, req.alloc_size, device=dev.name)
        tracked = s is not None and s.tracked
        self._shares[block] = _Share(
            sid or "",
            s.pid if tracked and s else None,
            s.start_time if tracked and s else None,
            req.ipc_handle,
        )
        self._share_names[segment] = self._share_names.get(segment, 0) + 1
        alloc = AllocRequest(
            name=req.name, shape=req.shape, dtype=req.dtype, device=req.device, ttl=req.ttl
        )
        try:
            v, _ = await broker.alloc(sid, caller, alloc, block=block)
        except BaseException:
            self._finish(block)
            raise
        self.count("shares")
        return broker.publish(sid, caller, req.name, v.number)

    def live(self, broker: Registry, req: LiveRequest, sid: str | None = None) -> LiveReply:
        """Which of these blocks (or shared allocations) the broker still has,
        which a lease or a reader's queued kernel still uses, and which shared
        allocations lost their producer (its session ended, or its process is
        gone right now: checked here, not at the next reap).  A client names
        every block its process still maps: a held block it does not name,
        it no longer maps (session ``sid``)."""
        if sid is not None:
            asked = set(req.segments)
            for dev in self._devices.values():
                for segment in [n for n in dev.held if n not in asked]:
                    self._unmapped(dev, segment, sid)
        names: set[str] = set()
        for dev in self._devices.values():
            names.update(dev.ipc)
        names.update(self._share_names)
        pending = {p.segment for p in self._pending}
        live = [n for n in req.segments if n in names]
        busy = [n for n in live if n in self._leased or n in pending]
        wanted = set(live) & set(self._share_names)
        orphaned = set()
        for block, share in self._shares.items():
            if block.segment not in wanted:
                continue
            if share.session not in broker.sessions:
                orphaned.add(block.segment)
            elif share.pid is not None:
                ident = proc_stat(share.pid, broker.sessions.proc)
                if ident is None or ident[0] != share.start or ident[1] in ("Z", "X"):
                    orphaned.add(block.segment)
        return LiveReply(live=live, busy=busy, orphaned=sorted(orphaned))

    def stat(self) -> list[DeviceStat]:
        out = []
        for dev in self._devices.values():
            pending = sum(b.size for b in self._freeing if b.device == dev.name)
            shared = sum(b.nbytes for b in self._shares if b.device == dev.name)
            out.append(
                DeviceStat(
                    device=dev.name,
                    bytes_in_use=dev.pool.used - pending,
                    bytes_reserved=dev.pool.reserved + dev.held_bytes,
                    bytes_pending=pending,
                    bytes_shared=shared,
                    max_memory=dev.limit,
                    segments=dev.pool.segments,
                    events=len(dev.events),
                    context_bytes=dev.gpu.context_bytes,
                )
            )
        return out

    # -- checking release events off the event loop --------------------------------------
    def _kick(self) -> None:
        if self._checker is not None and not self._checker.done():
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return  # no loop: settle() is called directly
        self._checker = loop.create_task(self._check())

    async def _check(self) -> None:
        delay = _FIRST_POLL
        while self._pending and not self._closed:
            batch = list(self._pending)
            done = await asyncio.to_thread(_query, [p.event.ev for p in batch])
            if self._closed:
                return
            progressed = self.settle(batch, done)
            delay = _FIRST_POLL if progressed else min(delay * 2, _LAST_POLL)
            if self._pending:
                await asyncio.sleep(delay)

    def settle(self, batch: list[_Pending], done: list[bool | None]) -> bool:
        """Apply one round of event queries (on the event loop).  Returns
        whether anything completed."""
        progressed = False
        for p, ok in zip(batch, done, strict=True):
            if ok is False and p.pid is not None:
                ident = proc_stat(p.pid)
                if ident is None or ident[0] != p.start or ident[1] in ("Z", "X"):
                    ok = None  # its recorder died, and its kernels with it
            if ok is False:
                continue
            progressed = True
            self._pending.remove(p)
            self._unref(p.event, reusable=ok is True)
            left = self._pending_blocks[p.block] - 1
            if left:
                self._pending_blocks[p.block] = left
                continue
            del self._pending_blocks[p.block]
            if p.block in self._freeing:
                self._finish(p.block)
        return progressed

    def pending(self) -> list[_Pending]:
        return list(self._pending)

    def close(self) -> None:
        """Free every block and event (broker shutdown)."""
        self._closed = True
        if self._checker is not None:
            self._checker.cancel()
        self._pending.clear()
        for dev in self._devices.values():
            for e in dev.events:
                e.ev.destroy()
            dev.events.clear()
            dev.free_events.clear()
            dev.pool.close()
            for seg in dev.held.values():  # shutdown: their importers lose them now
                seg.unlink()
            dev.held.clear()
        self._devices.clear()


def _new_block(
    gpu: Gpu, ipc: dict[str, tuple[str, int]], name: str, size: int, **posix_options: Any
) -> GpuBlock:
    """A pool's segment factory: a CUDA block, its IPC handle remembered for handles."""
    try:
        blk = gpu.block(name, size)
    except OSError:
        raise
    except Exception as exc:  # the pool turns OSError into "could not create ..."
        raise OSError(f"{type(exc).__name__}: {exc}") from exc
    ipc[name] = (encode_ipc(blk.ipc_handle), size)
    return blk


def _query(events: list[GpuEvent]) -> list[bool | None]:
    out: list[bool | None] = []
    for ev in events:
        try:
            out.append(ev.query())
        except Exception as exc:  # treat as done, never reuse the event
            log.warning("event query failed: %s", exc)
            out.append(None)
    return out
