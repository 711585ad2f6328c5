"""The broker's state: names, versions and leases (sessions: ``_sessions``).

Everything here runs on the event loop thread, so nothing needs a lock; the
slow parts of memory (creating, pre-faulting and unlinking segments) run in
worker threads and never on the loop (README, Lifetime: M7).

Lifetime rules (README, "Lifetime"):

* A name holds versions.  ``alloc`` creates version N+1 in the *writing*
  state, owned by the allocating session; ``publish`` makes it *ready* and
  retires the previous ready version.  Version numbers of a name only grow,
  across delete, abort, reclaim and expiry (M3).
* ``get`` leases the newest ready version, and ``alloc(hold=True)`` leases
  the version being written for the writer's own views.  A version's memory
  is freed when it is no longer current (superseded, deleted, expired, never
  published) **and** no lease holds it (M1).
* Memory that a process the broker cannot vouch for may still map (a lapsed
  heartbeat session, an unpublished write that expired) is retired: never
  handed to another tensor.
"""

from __future__ import annotations

import asyncio
import ctypes
import itertools
import logging
import math
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from .._errors import (
    BrokerUnavailable,
    Conflict,
    DepotError,
    Forbidden,
    InvalidRequest,
    OutOfMemory,
    TensorNotFound,
)
from .._wire import (
    INLINE_MAX,
    AllocRequest,
    ForkInfo,
    Handle,
    SessionInfo,
    Stat,
    TensorInfo,
)
from ..shm import PosixMapping, UnsupportedDType, byte_view, dtype_from_name
from ..shm._base import Segment
from ..shm._pool import Block, Pool, PoolExhausted
from ._cuda import CudaMemory
from ._sessions import LOCAL, Caller, Session, Sessions

log = logging.getLogger("tensordepot.broker")

MAX_NBYTES = 1 << 62
MAX_LAPSED = 4096  # lapsed sessions whose retired leases can still be given back


class ClientGone(Exception):
    """The client hung up (or cancelled the request) while it waited: nobody
    will read the answer, so no lease is granted."""


@dataclass(frozen=True)
class Limits:
    """What keeps the broker's state bounded by live work (README, Limits)."""

    session_ttl: float = 15.0  # heartbeat sessions end after this long unheard
    claim_window: float = 10.0  # a forked child's session must be claimed within this
    alloc_ttl: float = 600.0  # unpublished allocations expire after this (0: never)
    max_sessions: int = 16384
    max_sessions_per_peer: int = 256
    max_memory_per_session: int = 0  # 0: no limit beyond --max-memory
    max_memory_per_identity: int = 0


@dataclass(eq=False)
class Replica:
    """Where a version pulled from a peer came from (set by service/_peers.py)."""

    peer: str  # the peer's Flight URL it was copied from
    origin: str  # Flight URL of the broker that published it
    instance: str  # that broker's id for its run: version numbers restart with a broker
    version: int  # its version there
    checked_at: float  # when a peer last confirmed it is the newest (broker clock)


class PeerHook(Protocol):
    """Pull-through from brokers on other hosts (service/_peers.py)."""

    poll_interval: float  # how often a waiting get asks the peers again

    async def before_get(self, name: str, newer_than: int, can_wait: bool) -> None:
        """A get missed, or hit a replica: publish a newer replica of ``name``
        if a peer has one, or raise."""

    def explain(self, name: str) -> str:
        """What the peers said about ``name``, for a not-found message."""


@dataclass(eq=False)
class Version:
    name: str
    number: int
    block: Block
    shape: tuple[int, ...]
    dtype: str
    itemsize: int
    state: Literal["writing", "ready"]
    owner: str | None  # session id while writing
    current: bool = True  # referenced by its name (writing, or the newest ready)
    readers: int = 0  # leases, the writer's hold included
    ttl: float | None = None
    entry: Entry | None = None  # the incarnation of the name it was written under
    charged: int = 0  # bytes counted against its creator's quotas
    creator: str | None = None  # session id
    identity: str | None = None  # creator's identity (per-identity quota)
    deadline: float | None = None  # unpublished past this: reclaimed (--alloc-ttl)
    request: str | None = None  # the request id that allocated it, so the client can cancel it
    replica: Replica | None = None  # pulled from a peer
    wire: tuple[bytes, bytes] | None = None  # its published handle's JSON around the lease (lane)

    @property
    def nbytes(self) -> int:
        return self.block.nbytes


@dataclass(eq=False)
class Entry:
    name: str
    ready: Version | None = None
    writing: dict[int, Version] = field(default_factory=dict)
    next_version: int = 1
    expires_at: float | None = None
    readers: int = 0  # live leases on any version of this incarnation (writers' holds excluded)


@dataclass(eq=False)
class Lease:
    id: int
    session: str
    version: Version
    request: str | None = None  # the request id that took it, so the client can cancel it
    hold: bool = False  # the writer's own (alloc with hold, or its copy in a forked child)


class _Waker:
    """One parked get.  Whatever should end its wait or make it look again
    (a publish of the name, the clock, a cancel, a hang-up, shutdown)
    resolves its one future, so the get resumes in the loop's next step."""

    __slots__ = ("future", "stopped")

    def __init__(self) -> None:
        self.future: asyncio.Future[None] | None = None
        self.stopped = False  # cancelled, hung up, or shutting down: give up

    def wake(self, *_: object) -> None:
        f = self.future
        if f is not None and not f.done():
            f.set_result(None)

    def stop(self, *_: object) -> None:
        self.stopped = True
        self.wake()


@dataclass(eq=False)
class _Wait:
    wakers: set[_Waker] = field(default_factory=set)  # the gets parked on one name


def c_strides(shape: tuple[int, ...]) -> list[int]:
    strides, acc = [], 1
    for dim in reversed(shape):
        strides.append(acc)
        acc *= max(dim, 1)
    return strides[::-1]


class Broker:
    def __init__(self, pool: Pool, *, limits: Limits | None = None,
                 clock: Callable[[], float] = time.monotonic, proc: str = "/proc",
                 cuda: CudaMemory | None = None) -> None:
        self.limits = limits or Limits()
        self.pool = pool
        self.cuda = cuda if cuda is not None else CudaMemory()  # GPUs: nothing until first used
        self.clock = clock
        lim = self.limits
        self.sessions = Sessions(session_ttl=lim.session_ttl, claim_window=lim.claim_window,
                                 max_sessions=lim.max_sessions,
                                 max_per_peer=lim.max_sessions_per_peer, clock=clock, proc=proc)
        self.entries: dict[str, Entry] = {}
        self.leases: dict[int, Lease] = {}
        self.bytes_in_use = 0
        self.versions_live = 0
        self.waiting = 0  # gets parked now
        self.closing = False
        self._lease_ids = itertools.count(1)
        self._waits: dict[str, _Wait] = {}
        self._parked: set[_Waker] = set()  # every parked get, for shutdown
        self._maps: dict[str, PosixMapping] = {}
        self._identity_bytes: dict[str, int] = {}
        # Lapsed sessions: session id -> (owner identity, lease id -> block it held).
        self._lapsed: OrderedDict[str, tuple[str, dict[int, Block]]] = OrderedDict()
        # Versions of every name start above every number any dropped name
        # ever had, so versions only grow without remembering dropped names.
        self._version_floor = 0
        self.counters: dict[str, int] = {}
        # Slow memory work happens in threads: creating (fallocate) and unlinking.
        self._creator = ThreadPoolExecutor(2, thread_name_prefix="tensordepot-create")
        self._unlinker = ThreadPoolExecutor(1, thread_name_prefix="tensordepot-unlink")
        self._fresh: set[Segment] = set()  # created in a thread, not yet handed to the pool
        self._fresh_lock = threading.Lock()
        self._growing: asyncio.Future[None] | None = None  # a pool segment being made
        self._closed = False
        pool._unlinker = self._unlink_later
        pool.on_drop = self._forget_mapping
        self.peers: PeerHook | None = None  # set when --peer is given
        self.cuda.count = self._count

    # -- helpers -----------------------------------------------------------
    def _count(self, what: str, n: int = 1) -> None:
        self.counters[what] = self.counters.get(what, 0) + n

    def _session(self, sid: str | None, caller: Caller) -> Session:
        if self.closing:
            raise BrokerUnavailable("the broker is shutting down; retry against the new broker")
        return self.sessions.use(sid, caller)

    def _known(self) -> str:
        names = sorted(n for n, e in self.entries.items() if e.ready is not None)
        if not names:
            return "no tensors are published"
        shown = ", ".join(names[:10]) + (f", ... ({len(names)} in all)" if len(names) > 10 else "")
        return f"known: {shown}"

    def _not_found(self, name: str) -> TensorNotFound:
        peers = "" if self.peers is None else self.peers.explain(name)
        return TensorNotFound(
            f"tensor {name!r} not found ({self._known()}){peers}; did the producer publish it? "
            f"pass timeout= to wait for it"
        )

    def handle(self, v: Version, lease: int | None = None) -> Handle:
        if v.block.device != "cpu":
            return self.cuda.handle(v, lease, c_strides(v.shape))
        # Built from the broker's own state, valid by construction: not validated again.
        return Handle.model_construct(
            name=v.name, version=v.number, kind="posix", segment=v.block.segment,
            offset=v.block.offset, nbytes=v.block.nbytes, shape=list(v.shape),
            strides=c_strides(v.shape), dtype=v.dtype, device="cpu", state=v.state, lease=lease,
            cuda=None)

    def _info(self, e: Entry, v: Version) -> TensorInfo:
        expires = None if e.expires_at is None else max(0.0, e.expires_at - self.clock())
        r = v.replica
        return TensorInfo(name=e.name, version=v.number, shape=list(v.shape), dtype=v.dtype,
                          nbytes=v.nbytes, device=v.block.device, state=v.state, readers=e.readers,
                          expires_in=expires, origin=r.origin if r else None,
                          origin_version=r.version if r else None)

    def _maybe_free(self, v: Version) -> None:
        if not v.current and v.readers == 0 and v.block is not None:
            block, v.block = v.block, None  # type: ignore[assignment]
            self.versions_live -= 1
            self._uncharge(v)
            block.refs -= 1
            if block.refs == 0:  # no other version (see link) shares the bytes
                # A block with stale holders is retired instead of freed.
                (self.pool if block.device == "cpu" else self.cuda).free(block)
                self.bytes_in_use -= block.nbytes

    def _retire(self, v: Version) -> None:
        v.current = False
        self._maybe_free(v)

    def _drop_entry(self, e: Entry) -> None:
        if self.entries.get(e.name) is e:
            del self.entries[e.name]
            self._version_floor = max(self._version_floor, e.next_version - 1)

    def _entry(self, name: str) -> Entry:
        e = self.entries.get(name)
        if e is None:
            e = self.entries[name] = Entry(name, next_version=self._version_floor + 1)
        return e

    # -- quotas ------------------------------------------------------------
    def _charge(self, s: Session, nbytes: int, name: str) -> None:
        lim = self.limits
        if lim.max_memory_per_session and s.bytes + nbytes > lim.max_memory_per_session:
            self._count("quota_refusals")
            raise OutOfMemory(
                f"cannot place {name!r} ({nbytes} bytes): this session already holds {s.bytes} "
                f"bytes and --max-memory-per-session is {lim.max_memory_per_session}; delete "
                f"tensors or publish what you are writing"
            )
        held = self._identity_bytes.get(s.owner, 0)
        if lim.max_memory_per_identity and held + nbytes > lim.max_memory_per_identity:
            self._count("quota_refusals")
            raise OutOfMemory(
                f"cannot place {name!r} ({nbytes} bytes): {s.owner} already holds {held} bytes "
                f"and --max-memory-per-token is {lim.max_memory_per_identity}; delete tensors"
            )

    def _record_charge(self, s: Session, v: Version) -> None:
        v.charged, v.creator, v.identity = v.nbytes, s.id, s.owner
        s.bytes += v.charged
        self._identity_bytes[s.owner] = self._identity_bytes.get(s.owner, 0) + v.charged

    def _uncharge(self, v: Version) -> None:
        if not v.charged:
            return
        s = self.sessions.get(v.creator or "")
        if s is not None:
            s.bytes -= v.charged
        if v.identity is not None:
            left = self._identity_bytes.get(v.identity, 0) - v.charged
            if left > 0:
                self._identity_bytes[v.identity] = left
            else:
                self._identity_bytes.pop(v.identity, None)
        v.charged = 0

    # -- sessions ----------------------------------------------------------
    def open_session(self, caller: Caller, label: str | None = None) -> SessionInfo:
        if self.closing:
            raise BrokerUnavailable("the broker is shutting down")
        s = self.sessions.open(caller, label=label)
        self._count("sessions_opened")
        return self._session_info(s)

    def _session_info(self, s: Session) -> SessionInfo:
        interval = None if s.tracked else s.ttl / 3
        return SessionInfo(session=s.id, pid=s.pid, tracked=s.tracked, heartbeat_interval=interval)

    def heartbeat(self, sid: str, caller: Caller) -> None:
        self._session(sid, caller)

    def close_session(self, sid: str, caller: Caller) -> None:
        """The client ends its own session: it holds no view any more, so its
        memory is safe to reuse."""
        s = self.sessions.use(sid, caller)
        self.end_session(s, verified=True)

    def end_local_session(self, sid: str) -> None:
        """End a session the broker opened for its own work (a Flight stream, a
        pull): the broker knows when its own mappings are done with."""
        s = self.sessions.get(sid)
        if s is not None:
            self.end_session(s, verified=True)

    def fork_session(self, sid: str, caller: Caller) -> ForkInfo:
        """A session for a child about to be forked, with copies of the
        parent's leases (a writer's holds included)."""
        parent = self._session(sid, caller)
        child = self.sessions.open(caller, label=f"fork of {parent.label or sid[:8]}",
                                   claimed=False)
        mapping = {}
        for lid in sorted(parent.leases):
            src = self.leases[lid]
            mapping[str(lid)] = self.lease(child, src.version, count=False, hold=src.hold)
        self._count("forks")
        return ForkInfo(session=child.id, leases=mapping, claim_within=child.ttl)

    def claim_session(self, sid: str, caller: Caller) -> SessionInfo:
        s = self.sessions.use(sid, caller)
        self.sessions.claim(s, caller)
        return self._session_info(s)

    def end_session(self, s: Session, *, verified: bool) -> None:
        """Release a session's leases and reclaim its unpublished writes.

        ``verified``: the broker knows no process of this session maps its
        memory any more (the process is gone, or the client closed).  If not,
        every block the session could reach is retired instead of reused."""
        if self.sessions.get(s.id) is not s:
            return
        if not verified:
            # Its process may be paused, not dead, and still map all of this:
            # the blocks get a stale holder each, so freeing retires them.  Its
            # leases are remembered so that the process, when it resumes and
            # its views die, can give them back (``release_stale``).
            held = {}
            for lid in s.leases:
                lease = self.leases[lid]
                if lease.version.block is not None:
                    lease.version.block.stale += 1
                    held[lid] = lease.version.block
            holds = {self.leases[lid].version for lid in s.leases if self.leases[lid].hold}
            for v in s.writing:
                if v not in holds:  # a put's fill in flight: no lease ever says it is done
                    v.block.stale += 1
            if held:
                self._lapsed[s.id] = (s.owner, held)
                # Beyond the bound, the oldest are forgotten: retired until their segment drains.
                while len(self._lapsed) > MAX_LAPSED:
                    self._lapsed.popitem(last=False)
        self.sessions.remove(s)
        for lid in list(s.leases):
            self._release_one(lid)
        for v in list(s.writing):
            self.abandon(v)
        for fut in s.waits.values():
            if not fut.done():
                fut.set_result(None)
        self.cuda.end_session(self, s)
        self._count("sessions_ended")
        if not verified:
            self._count("sessions_lapsed")

    def abandon(self, v: Version) -> None:
        """Reclaim a version that was allocated but never published."""
        if v.owner:
            s = self.sessions.get(v.owner)
            if s is not None:
                s.writing.discard(v)
        e = self.entries.get(v.name)
        if e is not None and e.writing.get(v.number) is v:
            del e.writing[v.number]
            if e.ready is None and not e.writing:
                self._drop_entry(e)
        self._retire(v)
        self._count("writes_reclaimed")

    def reap(self) -> list[str]:
        """End sessions whose process died or that missed heartbeats."""
        dead = self.sessions.dead()
        for s, known in dead:
            log.info("session %s (pid %s) %s; reclaiming", s.id[:8], s.pid,
                     "is gone" if known else "missed its heartbeats")
            self._count("sessions_reaped")
            self.end_session(s, verified=known)
        return [s.id for s, _ in dead]

    def expire(self) -> list[str]:
        now = self.clock()
        gone = [n for n, e in self.entries.items() if e.expires_at is not None
                and e.expires_at <= now]
        for n in gone:
            self.delete(n)
            self._count("expired")
        if self.limits.alloc_ttl:
            for s in self.sessions.values():
                for v in [v for v in s.writing if v.deadline is not None and v.deadline <= now]:
                    # The writer is alive and may still be copying into it.
                    v.block.stale += 1
                    self.abandon(v)
                    self._count("allocs_expired")
        return gone

    # -- memory --------------------------------------------------------------
    async def _block(self, nbytes: int) -> Block:
        """A block for ``nbytes``; a new segment is made in a worker thread.
        Requests that need a pool segment while one is being made wait for it
        and share it, instead of each making (and reserving) one of their own."""
        while True:
            blk = self.pool.try_alloc(nbytes)
            if blk is not None:
                return blk
            size, dedicated = self.pool.plan(nbytes)
            if dedicated or self._growing is None:
                break
            await asyncio.shield(self._growing)
        self.pool.reserve(size)
        loop = asyncio.get_running_loop()
        growing = None if dedicated else loop.create_future()
        if growing is not None:
            self._growing = growing
        try:
            seg = await loop.run_in_executor(self._creator, self._create, size)
        except BaseException:
            self.pool.unreserve(size)
            raise
        finally:
            if growing is not None:
                self._growing = None
                growing.set_result(None)
        with self._fresh_lock:
            self._fresh.discard(seg)
        return self.pool.take(self.pool.add(seg, dedicated), nbytes)

    def _create(self, size: int) -> Segment:
        seg = self.pool.create(size)
        with self._fresh_lock:
            if self._closed:  # the broker shut down while this segment was made
                seg.unlink()
                raise BrokerUnavailable("the broker is shutting down")
            self._fresh.add(seg)
        return seg

    def _unlink_later(self, seg: Segment) -> None:
        if self._closed:
            seg.unlink()
        else:
            self._unlinker.submit(seg.unlink)

    # -- writing -----------------------------------------------------------
    def _check_alloc(self, req: AllocRequest) -> tuple[tuple[int, ...], str, int, int]:
        return self._check_item(req.device, req.dtype, req.shape)

    def _check_item(self, device: str, dtype: str,
                    dims: list[int]) -> tuple[tuple[int, ...], str, int, int]:
        """(shape, dtype name, item size, bytes) of an allocation; raises InvalidRequest."""
        if device not in ("cpu", "cpu:0"):
            self.cuda.check_device(device)
        try:
            dt = dtype_from_name(dtype)
        except UnsupportedDType as exc:
            raise InvalidRequest(str(exc)) from None
        shape = tuple(dims)
        nelem = math.prod(shape)
        nbytes = nelem * dt.itemsize
        # Zero dims do not save huge ones: the strides (and DLPack's int64
        # shape) must still be representable.
        span = math.prod(max(d, 1) for d in shape) * dt.itemsize
        if max(nbytes, span) > MAX_NBYTES:
            raise InvalidRequest(
                f"shape {list(shape)} of {dt.name} is {nbytes} bytes, which overflows; check the "
                "shape"
            )
        return shape, dt.name, dt.itemsize, nbytes

    async def alloc(self, sid: str | None, caller: Caller, req: AllocRequest,
                    block: Block | None = None,
                    request: str | None = None) -> tuple[Version, int | None]:
        """A new version in the writing state, and the writer's hold if asked.
        ``block``: place it there (a producer's shared CUDA memory)."""
        s = self._session(sid, caller)
        shape, dtype, itemsize, nbytes = self._check_alloc(req)
        self._charge(s, nbytes, req.name)
        try:
            if block is None:
                block = (await self._block(nbytes) if req.device in ("cpu", "cpu:0")
                         else self.cuda.alloc(s, req, nbytes))
        except PoolExhausted as exc:
            raise self._refused(req.name, nbytes, exc) from None
        if self.closing or self.sessions.get(s.id) is not s:  # it ended while a segment was made
            (self.pool if block.device == "cpu" else self.cuda).free(block)  # nobody maps it yet
            self._session(sid, caller)  # raises the reason
        return self._place(s, req.name, req.ttl, req.hold, shape, dtype, itemsize, nbytes, block,
                           request=request)

    def try_alloc(self, sid: str | None, caller: Caller, req: AllocRequest,
                  checked: tuple[tuple[int, ...], str, int, int] | None = None,
                  ) -> tuple[Version, int | None] | None:
        """``alloc`` when it needs no new segment (a CPU tensor that fits in
        existing memory), without awaiting; None when it does.  ``checked``:
        what ``_check_alloc(req)`` returned, if the caller called it already."""
        s = self._session(sid, caller)
        shape, dtype, itemsize, nbytes = checked or self._check_alloc(req)
        if req.device not in ("cpu", "cpu:0"):
            return None
        self._charge(s, nbytes, req.name)
        block = self.pool.try_alloc(nbytes)
        if block is None:
            return None
        return self._place(s, req.name, req.ttl, req.hold, shape, dtype, itemsize, nbytes, block)

    def _refused(self, name: str, nbytes: int, exc: Exception) -> OutOfMemory:
        self._count("quota_refusals")
        return OutOfMemory(
            f"cannot place {name!r} ({nbytes} bytes): {exc}; free tensors with delete(), "
            f"or start the broker with a larger --max-memory"
        )

    def _place(self, s: Session, name: str, ttl: float | None, hold: bool, shape: tuple[int, ...],
               dtype: str, itemsize: int, nbytes: int, block: Block, count: bool = True,
               request: str | None = None) -> tuple[Version, int | None]:
        """The new writing version of ``name`` in ``block`` (``count``: in the
        metrics now; a batch counts its versions at once).  ``request``: the id
        of the request that allocated it, which cancels it if its answer was
        never read (and its hold, if any)."""
        e = self._entry(name)
        v = Version(name, e.next_version, block, shape, dtype, itemsize, "writing", s.id,
                    ttl=ttl, entry=e)
        if self.limits.alloc_ttl:
            v.deadline = self.clock() + self.limits.alloc_ttl
        e.next_version += 1
        e.writing[v.number] = v
        s.writing.add(v)
        self.bytes_in_use += nbytes
        self.versions_live += 1
        self._record_charge(s, v)
        v.request = request
        if count:
            self._count("allocs")
        return v, (self.lease(s, v, request, count=False, hold=True) if hold else None)

    # -- batches (a state dict in one request per step) ------------------------
    def _batch(self, sid: str | None, caller: Caller, names: list[str], shapes: list[list[int]],
               dtypes: list[str]) -> tuple[Session, list[tuple[tuple[int, ...], str, int, int]]]:
        """The session and every item checked (CPU memory), before anything is placed."""
        s = self._session(sid, caller)
        if not len(names) == len(shapes) == len(dtypes):
            raise InvalidRequest(f"a batch needs one shape and one dtype per name: {len(names)} "
                                 f"names, {len(shapes)} shapes, {len(dtypes)} dtypes")
        if len(set(names)) != len(names):
            raise InvalidRequest("a batch allocates each name once")
        seen: dict[tuple[str, tuple[int, ...]], tuple[tuple[int, ...], str, int, int]] = {}
        items = []
        # A state dict repeats a few (dtype, shape) pairs: each is checked once.
        for shape, d in zip(shapes, dtypes, strict=True):
            key = (d, tuple(shape))
            item = seen.get(key)
            if item is None:
                item = seen[key] = self._check_item("cpu", d, shape)
            items.append(item)
        total = sum(item[3] for item in items)
        self._charge(s, total, f"{len(names)} tensors" if len(names) != 1 else names[0])
        return s, items

    def try_alloc_many(self, sid: str | None, caller: Caller, names: list[str],
                       shapes: list[list[int]], dtypes: list[str], ttl: float | None = None,
                       request: str | None = None) -> list[Version] | None:
        """``alloc_many`` when every tensor fits in existing memory, without
        awaiting; None (and nothing allocated) when one does not."""
        s, items = self._batch(sid, caller, names, shapes, dtypes)
        blocks: list[Block] = []
        for item in items:
            blk = self.pool.try_alloc(item[3])
            if blk is None:
                for b in blocks:
                    self.pool.free(b)  # never handed out: safe to reuse at once
                return None
            blocks.append(blk)
        return self._place_all(s, names, items, blocks, ttl, request)

    async def alloc_many(self, sid: str | None, caller: Caller, names: list[str],
                         shapes: list[list[int]], dtypes: list[str], ttl: float | None = None,
                         request: str | None = None) -> list[Version]:
        """A new writing version of each name (CPU memory), all or none."""
        s, items = self._batch(sid, caller, names, shapes, dtypes)
        blocks: list[Block] = []
        try:
            for name, item in zip(names, items, strict=True):
                try:
                    blocks.append(await self._block(item[3]))
                except PoolExhausted as exc:
                    raise self._refused(name, item[3], exc) from None
            if self.closing or self.sessions.get(s.id) is not s:  # while segments were made
                self._session(sid, caller)  # raises the reason
        except BaseException:
            for b in blocks:
                self.pool.free(b)  # nobody maps them yet
            raise
        return self._place_all(s, names, items, blocks, ttl, request)

    def _place_all(self, s: Session, names: list[str],
                   items: list[tuple[tuple[int, ...], str, int, int]], blocks: list[Block],
                   ttl: float | None, request: str | None) -> list[Version]:
        placed = [self._place(s, name, ttl, False, shape, dtype, itemsize, nbytes, blk, False,
                              request)[0]
                  for name, (shape, dtype, itemsize, nbytes), blk
                  in zip(names, items, blocks, strict=True)]
        self._count("allocs", len(placed))
        return placed

    def try_get_many(self, sid: str | None, caller: Caller, names: list[str],
                     newer_than: int | list[int] = 0, *,
                     request: str | None = None) -> list[tuple[Version, int]] | None:
        """``get_many`` when every version is ready now and no peer needs
        asking, without awaiting; None (and no lease) when it would wait."""
        s = self._session(sid, caller)
        if self.peers is not None:
            return None
        if isinstance(newer_than, list) and len(newer_than) != len(names):
            return None  # get_many says what is wrong
        ready = self._ready
        found = []
        for i, name in enumerate(names):
            v = ready(name, newer_than if isinstance(newer_than, int) else newer_than[i])
            if v is None:
                return None
            found.append(v)
        got = [(v, self.lease(s, v, request, count=False)) for v in found]
        self._count("gets", len(got))
        self._count("bytes_got", sum(v.nbytes for v in found))
        return got

    def _writing(self, s: Session, name: str, number: int) -> Version:
        e = self.entries.get(name)
        v = e.writing.get(number) if e is not None else None
        if v is None:
            for orphan in list(s.writing):
                if orphan.name == name and orphan.number == number:
                    self.abandon(orphan)  # its name was deleted while it was written
            raise TensorNotFound(
                f"no unpublished version {number} of {name!r}: it was published already, "
                f"deleted while being written, or reclaimed (its writer's session ended, or it "
                f"stayed unpublished longer than --alloc-ttl)"
            )
        if v.owner != s.id:
            raise Conflict(f"version {number} of {name!r} belongs to another session")
        return v

    def publish(self, sid: str | None, caller: Caller, name: str, number: int) -> Version:
        s = self._session(sid, caller)
        return self._publish(s, self._writing(s, name, number))

    def publish_many(self, sid: str | None, caller: Caller,
                     items: list[tuple[str, int]]) -> list[Version]:
        """All or nothing: every item is checked before any is published."""
        s = self._session(sid, caller)
        if len(set(items)) != len(items):
            raise InvalidRequest("a batch publishes each (name, version) once")
        versions = [self._writing(s, name, number) for name, number in items]
        return [self._publish(s, v) for v in versions]

    def _publish(self, s: Session, v: Version) -> Version:
        e = v.entry
        assert e is not None
        del e.writing[v.number]
        s.writing.discard(v)
        v.state, v.owner, v.deadline = "ready", None, None
        old = e.ready
        if old is not None and old.number > v.number:
            # A newer version was published first; this one is superseded at once.
            self._retire(v)
            return old
        e.ready = v
        e.expires_at = None if v.ttl is None else self.clock() + v.ttl
        if old is not None:
            self._retire(old)
        self._count("publishes")
        self._count("bytes_put", v.nbytes)
        w = self._waits.pop(v.name, None)
        if w is not None:
            for waker in w.wakers:
                waker.wake()
        return v

    def abort(self, sid: str | None, caller: Caller, name: str, number: int) -> None:
        """Give back a version this session allocated and will not publish."""
        s = self._session(sid, caller)
        for v in list(s.writing):
            if v.name == name and v.number == number:
                self.abandon(v)
                return
        raise TensorNotFound(f"this session is not writing version {number} of {name!r}")

    async def put_inline(self, sid: str | None, caller: Caller, req: AllocRequest,
                         data: bytes) -> Version:
        """Allocate, fill and publish a small tensor whose bytes came in the request."""
        self._check_inline(req, data)
        v, _ = await self.alloc(sid, caller, req)
        return self._fill_inline(sid, caller, v, data)

    def try_put_inline(self, sid: str | None, caller: Caller, req: AllocRequest,
                       data: bytes) -> Version | None:
        """``put_inline`` when it needs no new segment, without awaiting; None when it does."""
        got = self.try_alloc(sid, caller, req, self._check_inline(req, data))
        return None if got is None else self._fill_inline(sid, caller, got[0], data)

    def _check_inline(self, req: AllocRequest,
                      data: bytes) -> tuple[tuple[int, ...], str, int, int]:
        checked = self._check_alloc(req)
        shape, nbytes = checked[0], checked[3]
        if nbytes > INLINE_MAX:
            raise InvalidRequest(f"inline puts carry at most {INLINE_MAX} bytes; use alloc + "
                                 "publish")
        if len(data) != nbytes:
            raise InvalidRequest(
                f"data has {len(data)} bytes but shape {list(shape)} of {req.dtype} needs {nbytes}"
            )
        return checked

    def _fill_inline(self, sid: str | None, caller: Caller, v: Version, data: bytes) -> Version:
        if v.nbytes:  # len(data) == v.nbytes, checked: the block holds it
            ctypes.memmove(self._map(v.block.segment).address + v.block.offset, data, v.nbytes)
        return self.publish(sid, caller, v.name, v.number)

    def _forget_mapping(self, segment: str) -> None:
        self._maps.pop(segment, None)

    def _map(self, segment: str) -> PosixMapping:
        m = self._maps.get(segment)
        if m is None:  # the pool's on_drop forgets mappings of unlinked segments
            m = self._maps[segment] = PosixMapping(segment, writable=True)
        return m

    def link(self, sid: str | None, caller: Caller, name: str, lease_id: int,
             ttl: float | None = None) -> Version:
        """Publish the bytes a lease holds as the next version of ``name``, without a copy.

        The new version shares the block; the memory is freed when every
        version that shares it is gone."""
        s = self._session(sid, caller)
        lease = self.leases.get(lease_id)
        if lease is None or lease.session != s.id or lease.version.block is None:
            raise TensorNotFound(f"lease {lease_id} is not held by this session; get the source "
                                 "tensor again")
        src = lease.version
        if src.state != "ready":
            raise Conflict(f"{src.name!r} v{src.number} is not published yet; publish it first")
        e = self._entry(name)
        src.block.refs += 1
        v = Version(name, e.next_version, src.block, src.shape, src.dtype, src.itemsize, "writing",
                    s.id, ttl=ttl, entry=e)
        e.next_version += 1
        e.writing[v.number] = v
        s.writing.add(v)
        self.versions_live += 1
        self._count("links")
        return self._publish(s, v)

    # -- reading -----------------------------------------------------------
    def _ready(self, name: str, newer_than: int) -> Version | None:
        e = self.entries.get(name)
        if e is None or e.ready is None or e.ready.number <= newer_than:
            return None
        return e.ready

    def lease(self, s: Session, v: Version, request: str | None = None, *, count: bool = True,
              hold: bool = False) -> int:
        lid = next(self._lease_ids)
        self.leases[lid] = Lease(lid, s.id, v, request, hold)
        s.leases.add(lid)
        if request is not None:
            s.by_request.setdefault(request, set()).add(lid)
        v.readers += 1
        if v.entry is not None and not hold:
            v.entry.readers += 1
        self.cuda.on_lease(lid, v, s)
        if count:
            self._count("gets")
            self._count("bytes_got", v.nbytes)
        return lid

    def try_get(self, sid: str | None, caller: Caller, name: str, newer_than: int = 0, *,
                request: str | None = None) -> tuple[Version, int] | None:
        """``get`` when a version is ready now and no peer needs asking, without
        awaiting: the version and its lease; None when ``get`` would wait,
        ask the peers, or answer not found."""
        s = self._session(sid, caller)
        v = self._ready(name, newer_than)
        if v is None or self.peers is not None:
            return None
        return v, self.lease(s, v, request)

    async def get(self, sid: str | None, caller: Caller, name: str, timeout: float | None,
                  newer_than: int = 0, *, request: str | None = None,
                  gone: Callable[[], Awaitable[Any]] | None = None) -> tuple[Version, int]:
        """Lease the newest ready version of ``name``, waiting up to ``timeout``
        seconds (None: forever).  ``gone()`` resolves if the client hangs up."""
        return (await self._get_all(sid, caller, [name], timeout, newer_than, request, gone))[0]

    async def get_many(self, sid: str | None, caller: Caller, names: list[str],
                       timeout: float | None, *, newer_than: int | list[int] = 0,
                       request: str | None = None,
                       gone: Callable[[], Awaitable[Any]] | None = None,
                       ) -> list[tuple[Version, int]]:
        """All of them under one deadline, or an error and none.  ``newer_than``:
        one version floor for every name, or one per name."""
        if isinstance(newer_than, list) and len(newer_than) != len(names):
            raise InvalidRequest(f"newer_than has {len(newer_than)} versions for {len(names)} "
                                 f"names; "
                                 f"give one per name, in the same order")
        return await self._get_all(sid, caller, names, timeout, newer_than, request, gone)

    async def _get_all(self, sid: str | None, caller: Caller, names: list[str],
                       timeout: float | None,
                       floors: int | list[int], request: str | None,
                       gone: Callable[[], Awaitable[Any]] | None) -> list[tuple[Version, int]]:
        s = self._session(sid, caller)
        got: list[tuple[Version, int]] = []
        deadline = None if timeout is None else asyncio.get_running_loop().time() + timeout
        try:
            for i, name in enumerate(names):
                newer_than = floors if isinstance(floors, int) else floors[i]
                v = self._ready(name, newer_than)
                if self.peers is not None and (v is None or v.replica is not None):
                    # A miss, or a replica that may be stale: the peers may publish one here.
                    await self.peers.before_get(name, newer_than, timeout is None or timeout > 0)
                    s = self._session(sid, caller)
                    v = self._ready(name, newer_than)
                if v is None:
                    if timeout == 0:
                        raise self._not_found(name)
                    v = await self._wait(s, name, newer_than, deadline, timeout, request, gone)
                    s = self._session(sid, caller)  # raises if shutting down or the session ended
                got.append((v, self.lease(s, v, request)))
        except BaseException:
            self._release_ids(s, [lid for _, lid in got])
            raise
        return got

    async def _wait(self, s: Session, name: str, newer_than: int, deadline: float | None,
                    timeout: float | None, request: str | None,
                    gone: Callable[[], Awaitable[Any]] | None) -> Version:
        loop = asyncio.get_running_loop()
        if deadline is not None and deadline <= loop.time():
            raise self._timed_out(name, newer_than, timeout)
        self._count("waits")  # gets that had to wait for a publish
        waker = _Waker()
        cancel: asyncio.Future[None] = loop.create_future()  # release(requests=[id]), session end
        cancel.add_done_callback(waker.stop)
        if request is not None:
            s.waits[request] = cancel
        watch, own = None, False
        if gone is not None:  # only now: a wait that never starts needs no hang-up watch
            hung_up = gone()
            watch = asyncio.ensure_future(hung_up)
            own = watch is not hung_up  # a task made here for a coroutine: ours to cancel
            watch.add_done_callback(waker.stop)
        w = self._waits.get(name)
        if w is None:
            w = self._waits[name] = _Wait()
        w.wakers.add(waker)
        self._parked.add(waker)
        waker.stopped = waker.stopped or self.closing
        self.waiting += 1
        try:
            while True:
                if waker.stopped:
                    self._session(s.id, Caller(s.owner))  # shutting down, or the session ended
                    raise ClientGone(name)
                remaining = None if deadline is None else deadline - loop.time()
                if self.peers is not None:  # wake up to ask the peers again
                    remaining = min(self.peers.poll_interval,
                                    math.inf if remaining is None else remaining)
                waker.future = loop.create_future()
                timer = (None if remaining is None
                         else loop.call_later(max(remaining, 0.0), waker.wake))
                try:
                    await waker.future
                finally:
                    waker.future = None
                    if timer is not None:
                        timer.cancel()
                if waker.stopped:
                    continue  # says why, above
                v = self._ready(name, newer_than)
                if v is None and self.peers is not None:
                    await self.peers.before_get(name, newer_than, True)
                    self._session(s.id, Caller(s.owner))
                    v = self._ready(name, newer_than)
                if v is not None:
                    return v
                if deadline is not None and loop.time() >= deadline:
                    raise self._timed_out(name, newer_than, timeout)
                if self._waits.get(name) is not w:  # popped by a publish of another version
                    w.wakers.discard(waker)
                    w = self._waits.get(name) or self._waits.setdefault(name, _Wait())
                    w.wakers.add(waker)
        finally:
            self.waiting -= 1
            self._parked.discard(waker)
            w.wakers.discard(waker)
            if not w.wakers and self._waits.get(name) is w:
                del self._waits[name]  # nobody waits: the state goes with the last waiter
            if watch is not None:
                watch.remove_done_callback(waker.stop)
                if own:
                    watch.cancel()
            if request is not None and s.waits.get(request) is cancel:
                del s.waits[request]

    def _timed_out(self, name: str, newer_than: int, timeout: float | None) -> TensorNotFound:
        e = self.entries.get(name)
        within = f"within {timeout:g} s" if timeout is not None else "in time"
        if newer_than and e is not None and e.ready is not None:
            return TensorNotFound(
                f"no version of {name!r} newer than v{newer_than} was published {within} "
                f"(the newest is v{e.ready.number})"
            )
        peers = "" if self.peers is None else self.peers.explain(name)
        return TensorNotFound(f"tensor {name!r} was not published {within} "
                              f"({self._known()}){peers}")

    def release(self, sid: str | None, caller: Caller, lease_ids: list[int],
                requests: list[str] | None = None) -> int:
        """Release this session's leases (others' ids are ignored), and cancel
        requests whose answers the client never read."""
        s = self.sessions.get(sid or "")
        if s is None:
            return 0  # leases of an ended session are gone already
        if s.owner != caller.identity:
            # Only the session that took a lease may release it.
            raise Forbidden(f"session {s.id[:8]}... belongs to another client; release under "
                            f"the session your own POST /v1/sessions returned")
        n = self._release_ids(s, lease_ids)
        for rid in requests or ():
            fut = s.waits.get(rid)
            if fut is not None and not fut.done():
                fut.set_result(None)
            n += self._release_ids(s, s.by_request.get(rid, ()))
            # An allocation whose answer the client never read: it cannot be
            # writing into it, and nobody else can publish it.
            for v in [v for v in s.writing if v.request == rid]:
                self.abandon(v)
        return n

    def release_stale(self, caller: Caller, stale: dict[str, list[int]]) -> int:
        """A client whose session lapsed (it was paused past its TTL) says the
        views of these leases of that old session are gone: their memory,
        retired when the session lapsed, may be reused."""
        n = 0
        for sid, lease_ids in stale.items():
            rec = self._lapsed.get(sid)
            if rec is None or rec[0] != caller.identity:
                continue  # not a lapsed session of this caller: nothing to give back
            held = rec[1]
            for lid in lease_ids:
                blk = held.pop(lid, None)
                if blk is None:
                    continue
                blk.stale -= 1
                n += 1
                if blk.stale == 0 and blk.retired and blk.device == "cpu":
                    self.pool.unretire(blk)
            if not held:
                del self._lapsed[sid]
        return n

    def _release_ids(self, s: Session, lease_ids: Iterable[int]) -> int:
        n = 0
        for lid in list(lease_ids):
            lease = self.leases.get(lid)
            if lease is not None and lease.session == s.id:
                self._release_one(lid)
                n += 1
        return n

    def _release_one(self, lid: int) -> None:
        lease = self.leases.pop(lid)
        s = self.sessions.get(lease.session)
        if s is not None:
            s.leases.discard(lid)
            if lease.request is not None:
                ids = s.by_request.get(lease.request)
                if ids is not None:
                    ids.discard(lid)  # a set: a batch's thousand releases stay linear
                    if not ids:
                        del s.by_request[lease.request]
        v = lease.version
        v.readers -= 1
        if v.entry is not None and not lease.hold:
            v.entry.readers -= 1
        self.cuda.on_release(lease)
        self._maybe_free(v)
        self._count("releases")

    def view(self, v: Version, *, writable: bool = False) -> Any:
        """The bytes of ``v`` as a flat uint8 numpy array over the broker's own
        mapping: the Flight service streams them, the peers fill replicas.
        The array keeps the mapping alive after the pool unlinks the segment."""
        return byte_view(self._map(v.block.segment), v.block.offset, v.nbytes, writable=writable)

    # -- names ---------------------------------------------------------------
    def delete(self, name: str) -> None:
        if self.closing:
            raise BrokerUnavailable("the broker is shutting down")
        e = self.entries.get(name)
        if e is None:
            raise TensorNotFound(f"tensor {name!r} not found ({self._known()}); nothing to delete")
        self._drop_entry(e)
        if e.ready is not None:
            self._retire(e.ready)
        # Versions being written stay reserved until their writer publishes
        # (which then fails with 404) or its session ends: freeing them now
        # would let a new tensor land under the writer's copy.
        self._count("deletes")

    def list(self) -> list[TensorInfo]:
        out = []
        for name in sorted(self.entries):
            e = self.entries[name]
            v = e.ready if e.ready is not None else max(e.writing.values(), key=lambda x: x.number,
                                                        default=None)
            # pulls in flight
            if v is not None and not (v.state == "writing" and v.replica is not None):
                out.append(self._info(e, v))
        return out

    def stat(self) -> Stat:
        return Stat(bytes_in_use=self.bytes_in_use, bytes_reserved=self.pool.reserved,
                    bytes_retired=self.pool.retired, retired_total=self.pool.retired_total,
                    max_memory=self.pool.max_memory,
                    tensors=sum(1 for e in self.entries.values() if e.ready is not None),
                    versions=self.versions_live, leases=len(self.leases),
                    sessions=len(self.sessions), segments=self.pool.segments, waiting=self.waiting,
                    devices=self.cuda.stat())

    # -- shutdown ------------------------------------------------------------
    def begin_shutdown(self) -> None:
        """Refuse new work and wake every waiting get with 503."""
        self.closing = True
        for waker in list(self._parked):
            waker.stop()

    def close(self) -> None:
        self.closing = True
        with self._fresh_lock:
            self._closed = True
        self._creator.shutdown(wait=True)
        self._unlinker.shutdown(wait=True)
        for seg in self._fresh:  # made, but the request that wanted it never resumed
            seg.unlink()
        self._fresh.clear()
        self._maps.clear()
        self.cuda.close()
        self.pool.close()
        log.info("unlinked all shared memory (pid %d)", os.getpid())


def local_session(broker: Broker, label: str = "broker") -> str:
    """A session owned by the broker itself (internal work and tests)."""
    return broker.open_session(LOCAL, label).session


__all__ = ["Broker", "Caller", "ClientGone", "DepotError", "Limits", "Version", "local_session"]
