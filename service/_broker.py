"""The broker's state: names, versions, leases and sessions.

Everything here runs on the event loop thread, so nothing needs a lock.

Lifetime rules (README, "Lifetime"):

* A name holds versions.  ``alloc`` creates version N+1 in the *writing*
  state, owned by the allocating session; ``publish`` makes it *ready* and
  retires the previous ready version.
* ``get`` leases the newest ready version.  A version's memory is freed when
  it is retired (superseded, deleted, expired, or never published) **and**
  no lease holds it.  Readers of an old version keep its bytes.
* A session ends on close, on its process's death (pid + start time), or on
  missed heartbeats.  Its leases are released and its unpublished versions
  reclaimed.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import os
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from .._errors import BrokerUnavailable, Conflict, InvalidRequest, OutOfMemory, TensorNotFound
from .._wire import (
    INLINE_MAX,
    AllocRequest,
    Handle,
    SessionInfo,
    SessionOpen,
    Stat,
    TensorInfo,
)
from ..shm import PosixMapping, UnsupportedDType, byte_view, dtype_from_name
from ..shm._pool import Block, Pool, PoolExhausted
from ._cuda import CudaMemory

log = logging.getLogger("tensordepot.broker")

MAX_NBYTES = 1 << 62
UNKNOWN_SESSION = "unknown_session"


def proc_identity(pid: int, proc: str = "/proc") -> tuple[int, str] | None:
    """(start time, state) of ``pid`` from /proc/<pid>/stat, or None if gone.

    The start time (field 22, clock ticks since boot) tells a reused pid from
    the process that opened the session; state Z/X is a dead process its
    parent has not reaped yet."""
    try:
        with open(f"{proc}/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return None
    # comm (field 2) may contain spaces and parentheses: split after the last ')'.
    rest = data[data.rfind(b")") + 2:].split()
    try:
        return int(rest[19]), rest[0].decode()
    except (IndexError, ValueError):
        return None


@dataclass(eq=False)
class Session:
    id: str
    pid: int | None
    start_time: int | None
    tracked: bool
    label: str | None
    last_seen: float
    leases: set[int] = field(default_factory=set)
    writing: set[Version] = field(default_factory=set)
    # Mappings the broker opened to write inline puts are shared, not per session.


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
    readers: int = 0
    ttl: float | None = None
    entry: Entry | None = None  # the incarnation of the name it was written under

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
    readers: int = 0  # live leases on any version of this incarnation of the name


@dataclass(eq=False)
class Lease:
    id: int
    session: str
    version: Version


def c_strides(shape: tuple[int, ...]) -> list[int]:
    strides, acc = [], 1
    for dim in reversed(shape):
        strides.append(acc)
        acc *= max(dim, 1)
    return strides[::-1]


class Broker:
    def __init__(self, pool: Pool, *, session_ttl: float = 15.0,
                 clock: Callable[[], float] = time.monotonic, proc: str = "/proc",
                 cuda: CudaMemory | None = None) -> None:
        self.pool = pool
        self.cuda = cuda if cuda is not None else CudaMemory()  # GPUs: nothing until first used
        self.session_ttl = session_ttl
        self.clock = clock
        self.proc = proc
        self.entries: dict[str, Entry] = {}
        self.sessions: dict[str, Session] = {}
        self.leases: dict[int, Lease] = {}
        self.bytes_in_use = 0
        self.versions_live = 0
        self.closing = False
        self._lease_ids = itertools.count(1)
        self._events: dict[str, asyncio.Event] = {}
        self._closing_event: asyncio.Event | None = None
        self._maps: dict[str, PosixMapping] = {}
        pool.on_drop = self._forget_mapping
        # Version numbers keep counting after a delete, so a reader waiting
        # for "newer than N" never mistakes a re-created name for an old one.
        self._last_version: dict[str, int] = {}
        self.counters: dict[str, int] = {}
        self.cuda.count = self._count

    # -- helpers -----------------------------------------------------------
    def _count(self, what: str, n: int = 1) -> None:
        self.counters[what] = self.counters.get(what, 0) + n

    def _session(self, sid: str | None) -> Session:
        if self.closing:
            raise BrokerUnavailable("the broker is shutting down; retry against the new broker")
        if not sid:
            raise InvalidRequest(
                "this call needs a session: send the x-tensordepot-session header "
                "(POST /v1/sessions opens one; the Python Client does this for you)"
            )
        s = self.sessions.get(sid)
        if s is None:
            exc = Conflict(
                f"session {sid[:8]}... is unknown: it ended (process exit, missed heartbeats) "
                f"or the broker restarted; open a new one"
            )
            exc.code = UNKNOWN_SESSION
            raise exc
        s.last_seen = self.clock()
        return s

    def _known(self) -> str:
        names = sorted(n for n, e in self.entries.items() if e.ready is not None)
        if not names:
            return "no tensors are published"
        shown = ", ".join(names[:10]) + (f", ... ({len(names)} in all)" if len(names) > 10 else "")
        return f"known: {shown}"

    def _not_found(self, name: str) -> TensorNotFound:
        return TensorNotFound(
            f"tensor {name!r} not found ({self._known()}); did the producer publish it? "
            f"pass timeout= to wait for it"
        )

    def handle(self, v: Version, lease: int | None = None) -> Handle:
        if v.block.device != "cpu":
            return self.cuda.handle(v, lease, c_strides(v.shape))
        return Handle(name=v.name, version=v.number, kind="posix", segment=v.block.segment,
                      offset=v.block.offset, nbytes=v.block.nbytes, shape=list(v.shape),
                      strides=c_strides(v.shape), dtype=v.dtype, device="cpu", state=v.state,
                      lease=lease)

    def _info(self, e: Entry, v: Version) -> TensorInfo:
        readers = e.readers
        expires = None if e.expires_at is None else max(0.0, e.expires_at - self.clock())
        return TensorInfo(name=e.name, version=v.number, shape=list(v.shape), dtype=v.dtype,
                          nbytes=v.nbytes, device=v.block.device, state=v.state, readers=readers,
                          expires_in=expires)

    def _maybe_free(self, v: Version) -> None:
        if not v.current and v.readers == 0 and v.block is not None:
            block, v.block = v.block, None  # type: ignore[assignment]
            self.versions_live -= 1
            block.refs -= 1
            if block.refs == 0:  # no other version (see link) shares the bytes
                (self.pool if block.device == "cpu" else self.cuda).free(block)
                self.bytes_in_use -= block.nbytes

    def _retire(self, v: Version) -> None:
        v.current = False
        self._maybe_free(v)

    # -- sessions ----------------------------------------------------------
    def open_session(self, req: SessionOpen, peer_pid: int | None) -> SessionInfo:
        if self.closing:
            raise BrokerUnavailable("the broker is shutting down")
        pid, start, tracked = req.pid, None, False
        if peer_pid:
            # SO_PEERCRED is the kernel's word for who is on the other end of
            # the unix socket: trust it over the pid the client claims.
            pid = peer_pid
            ident = proc_identity(pid, self.proc)
            if ident is not None:
                start, tracked = ident[0], True
        else:
            ident = proc_identity(pid, self.proc)
            if ident is not None and req.start_time is not None and ident[0] == req.start_time:
                start, tracked = ident[0], True
        sid = secrets.token_hex(16)
        self.sessions[sid] = Session(sid, pid, start, tracked, req.label, self.clock())
        self._count("sessions_opened")
        interval = None if tracked else self.session_ttl / 3
        return SessionInfo(session=sid, pid=pid, tracked=tracked, heartbeat_interval=interval)

    def heartbeat(self, sid: str) -> None:
        self._session(sid)

    def end_session(self, sid: str) -> bool:
        s = self.sessions.pop(sid, None)
        if s is None:
            return False
        for lid in list(s.leases):
            self._release_one(lid)
        for v in list(s.writing):
            self.abandon(v)
        self.cuda.end_session(self, s)
        self._count("sessions_ended")
        return True

    def abandon(self, v: Version) -> None:
        """Reclaim a version that was allocated but never published."""
        if v.owner and v.owner in self.sessions:
            self.sessions[v.owner].writing.discard(v)
        e = self.entries.get(v.name)
        if e is not None and e.writing.get(v.number) is v:
            del e.writing[v.number]
            self._drop_entry_if_empty(e)
        self._retire(v)
        self._count("writes_reclaimed")

    def _drop_entry_if_empty(self, e: Entry) -> None:
        if e.ready is None and not e.writing and self.entries.get(e.name) is e:
            del self.entries[e.name]

    def reap(self) -> list[str]:
        """End sessions whose process died or that missed heartbeats."""
        now = self.clock()
        dead = []
        for s in list(self.sessions.values()):
            if s.tracked:
                ident = proc_identity(s.pid, self.proc) if s.pid else None
                if ident is None or ident[0] != s.start_time or ident[1] in ("Z", "X"):
                    dead.append(s.id)
            elif now - s.last_seen > self.session_ttl:
                dead.append(s.id)
        for sid in dead:
            log.info("session %s (pid %s) is gone; reclaiming", sid[:8], self.sessions[sid].pid)
            self.end_session(sid)
        return dead

    def expire(self) -> list[str]:
        now = self.clock()
        gone = [n for n, e in self.entries.items() if e.expires_at is not None and e.expires_at <= now]
        for n in gone:
            self.delete(n)
            self._count("expired")
        return gone

    # -- writing -----------------------------------------------------------
    def _check_alloc(self, req: AllocRequest) -> tuple[tuple[int, ...], str, int, int]:
        if req.device not in ("cpu", "cpu:0"):
            self.cuda.check_device(req.device)
        try:
            dt = dtype_from_name(req.dtype)
        except UnsupportedDType as exc:
            raise InvalidRequest(str(exc)) from None
        shape = tuple(req.shape)
        nelem = math.prod(shape)
        nbytes = nelem * dt.itemsize
        # Zero dims do not save huge ones: the strides (and DLPack's int64
        # shape) must still be representable.
        span = math.prod(max(d, 1) for d in shape) * dt.itemsize
        if max(nbytes, span) > MAX_NBYTES:
            raise InvalidRequest(
                f"shape {list(shape)} of {dt.name} is {nbytes} bytes, which overflows; check the shape"
            )
        return shape, dt.name, dt.itemsize, nbytes

    def alloc(self, sid: str | None, req: AllocRequest, block: Block | None = None) -> Version:
        """A new version in the writing state; ``block``: place it there (share)."""
        s = self._session(sid)
        shape, dtype, itemsize, nbytes = self._check_alloc(req)
        try:
            if block is None:
                block = (self.pool.alloc(nbytes) if req.device in ("cpu", "cpu:0")
                         else self.cuda.alloc(s, req, nbytes))
        except PoolExhausted as exc:
            raise OutOfMemory(
                f"cannot place {req.name!r} ({nbytes} bytes): {exc}; free tensors with delete(), "
                f"or start the broker with a larger --max-memory"
            ) from None
        e = self.entries.get(req.name)
        if e is None:
            e = self.entries[req.name] = Entry(req.name, next_version=self._last_version.pop(req.name, 0) + 1)
        v = Version(req.name, e.next_version, block, shape, dtype, itemsize, "writing", s.id,
                    ttl=req.ttl, entry=e)
        e.next_version += 1
        e.writing[v.number] = v
        s.writing.add(v)
        self.bytes_in_use += nbytes
        self.versions_live += 1
        self._count("allocs")
        return v

    def publish(self, sid: str | None, name: str, number: int) -> Version:
        s = self._session(sid)
        e = self.entries.get(name)
        v = e.writing.get(number) if e is not None else None
        if v is None:
            for orphan in list(s.writing):
                if orphan.name == name and orphan.number == number:
                    self.abandon(orphan)  # its name was deleted while it was written
            raise TensorNotFound(
                f"no unpublished version {number} of {name!r}: it was published already, "
                f"deleted while being written, or reclaimed when its writer's session ended"
            )
        if v.owner != s.id:
            raise Conflict(f"version {number} of {name!r} belongs to another session")
        assert e is not None
        del e.writing[number]
        s.writing.discard(v)
        v.state, v.owner = "ready", None
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
        ev = self._events.pop(name, None)
        if ev is not None:
            ev.set()
        return v

    def abort(self, sid: str | None, name: str, number: int) -> None:
        """Give back a version this session allocated and will not publish."""
        s = self._session(sid)
        for v in list(s.writing):
            if v.name == name and v.number == number:
                self.abandon(v)
                return
        raise TensorNotFound(f"this session is not writing version {number} of {name!r}")

    def put_inline(self, sid: str | None, req: AllocRequest, data: bytes) -> Version:
        """Allocate, fill and publish a small tensor whose bytes came in the request."""
        shape, _, _, nbytes = self._check_alloc(req)
        if nbytes > INLINE_MAX:
            raise InvalidRequest(f"inline puts carry at most {INLINE_MAX} bytes; use alloc + publish")
        if len(data) != nbytes:
            raise InvalidRequest(
                f"data has {len(data)} bytes but shape {list(shape)} of {req.dtype} needs {nbytes}"
            )
        v = self.alloc(sid, req)
        if nbytes:
            m = self._map(v.block.segment)
            byte_view(m, v.block.offset, nbytes, writable=True)[:] = memoryview(data)
        return self.publish(sid, req.name, v.number)

    def _forget_mapping(self, segment: str) -> None:
        self._maps.pop(segment, None)

    def _map(self, segment: str) -> PosixMapping:
        m = self._maps.get(segment)
        if m is None:  # the pool's on_drop forgets mappings of unlinked segments
            m = self._maps[segment] = PosixMapping(segment, writable=True)
        return m

    def link(self, sid: str | None, name: str, lease_id: int, ttl: float | None = None) -> Version:
        """Publish the bytes a lease holds as the next version of ``name``, without a copy.

        The new version shares the block; the memory is freed when every
        version that shares it is gone."""
        s = self._session(sid)
        lease = self.leases.get(lease_id)
        if lease is None or lease.session != s.id or lease.version.block is None:
            raise TensorNotFound(f"lease {lease_id} is not held by this session; get the source tensor again")
        src = lease.version
        e = self.entries.get(name)
        if e is None:
            e = self.entries[name] = Entry(name, next_version=self._last_version.pop(name, 0) + 1)
        src.block.refs += 1
        v = Version(name, e.next_version, src.block, src.shape, src.dtype, src.itemsize, "writing",
                    s.id, ttl=ttl, entry=e)
        e.next_version += 1
        e.writing[v.number] = v
        s.writing.add(v)
        self.versions_live += 1
        self._count("links")
        return self.publish(sid, name, v.number)

    # -- reading -----------------------------------------------------------
    def _ready(self, name: str, newer_than: int) -> Version | None:
        e = self.entries.get(name)
        if e is None or e.ready is None or e.ready.number <= newer_than:
            return None
        return e.ready

    def lease(self, s: Session, v: Version) -> int:
        lid = next(self._lease_ids)
        self.leases[lid] = Lease(lid, s.id, v)
        s.leases.add(lid)
        v.readers += 1
        if v.entry is not None:
            v.entry.readers += 1
        self.cuda.on_lease(lid, v, s)
        self._count("gets")
        return lid

    async def get(self, sid: str | None, name: str, timeout: float | None,
                  newer_than: int = 0) -> tuple[Version, int]:
        s = self._session(sid)
        v = self._ready(name, newer_than)
        if v is not None:
            return v, self.lease(s, v)
        if timeout is not None and timeout <= 0:
            raise self._not_found(name)
        self._count("waits")  # gets that had to wait for a publish
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        while True:
            ev = self._events.get(name)
            if ev is None:
                ev = self._events[name] = asyncio.Event()
            remaining = None if deadline is None else deadline - loop.time()
            if remaining is not None and remaining <= 0:
                raise TensorNotFound(
                    f"tensor {name!r} was not published within {timeout:g} s ({self._known()})"
                )
            closing = self._closing_wait()
            waiter: asyncio.Future[Any] = asyncio.ensure_future(ev.wait())
            try:
                await asyncio.wait({waiter, closing}, timeout=remaining,
                                   return_when=asyncio.FIRST_COMPLETED)
            finally:
                waiter.cancel()
                closing.cancel()
            s = self._session(sid)  # raises if shutting down or the session ended meanwhile
            v = self._ready(name, newer_than)
            if v is not None:
                return v, self.lease(s, v)

    def _closing_wait(self) -> asyncio.Future[Any]:
        if self._closing_event is None:
            self._closing_event = asyncio.Event()
        return asyncio.ensure_future(self._closing_event.wait())

    def release(self, sid: str | None, lease_ids: list[int]) -> int:
        s = self.sessions.get(sid or "")
        if s is None:
            # Only the session that took a lease may release it: leases of an
            # ended session are gone already, and anyone else's must stay.
            return 0
        n = 0
        for lid in lease_ids:
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
        v = lease.version
        v.readers -= 1
        if v.entry is not None:
            v.entry.readers -= 1
        self.cuda.on_release(lease)
        self._maybe_free(v)
        self._count("releases")

    # -- names ---------------------------------------------------------------
    def delete(self, name: str) -> None:
        if self.closing:
            raise BrokerUnavailable("the broker is shutting down")
        e = self.entries.pop(name, None)
        if e is None:
            raise self._not_found(name)
        if e.ready is not None:
            self._retire(e.ready)
        # Versions being written stay reserved until their writer publishes
        # (which then fails with 404) or its session ends: freeing them now
        # would let a new tensor land under the writer's copy.
        self._last_version[name] = e.next_version - 1
        self._count("deletes")

    def list(self) -> list[TensorInfo]:
        out = []
        for name in sorted(self.entries):
            e = self.entries[name]
            v = e.ready if e.ready is not None else max(e.writing.values(), key=lambda x: x.number, default=None)
            if v is not None:
                out.append(self._info(e, v))
        return out

    def stat(self) -> Stat:
        return Stat(bytes_in_use=self.bytes_in_use, bytes_reserved=self.pool.reserved,
                    max_memory=self.pool.max_memory,
                    tensors=sum(1 for e in self.entries.values() if e.ready is not None),
                    versions=self.versions_live, leases=len(self.leases),
                    sessions=len(self.sessions), segments=self.pool.segments,
                    devices=self.cuda.stat())

    # -- shutdown ------------------------------------------------------------
    def begin_shutdown(self) -> None:
        """Refuse new work and wake every waiting get with 503."""
        self.closing = True
        if self._closing_event is None:
            self._closing_event = asyncio.Event()
        self._closing_event.set()

    def close(self) -> None:
        self.closing = True
        self._maps.clear()
        self.cuda.close()
        self.pool.close()
        log.info("unlinked all shared memory (pid %d)", os.getpid())
