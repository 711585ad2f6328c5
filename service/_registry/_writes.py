"""Writes: new versions, from allocation to publish (or reclaim).

``alloc`` places version N+1 of a name in the *writing* state, owned by the
allocating session, in memory the pool (or a GPU) has; ``publish`` makes it
*ready*, for good, and retires the previous ready version; ``abort`` and
``abandon`` reclaim a version never published.  Batches (``*_many``) do the
same for a state dict, all or none.  Inline puts and ``link`` are the two
shortcuts: a small tensor's bytes in the request, and published bytes
shared under a second name.  ``Broker`` answers with these methods.

``_publish`` is where the second invariant (``_broker``) is kept:
**published bytes never change**.  The broker writes only into versions
being written (``_fill_inline``), publishing ends that state, and ``link``
shares only published bytes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Literal

from ..._errors import Conflict, DepotError, InvalidRequest, TensorNotFound
from ..._wire import INLINE_MAX, AllocRequest
from ...shm._pool import Block
from ._batches import Batches
from ._packs import PACK_MOST, Plans
from ._records import CPU, Checked, Row, Version, check_item

if TYPE_CHECKING:
    from ...shm._pool import Pool
    from ._cuda import CudaMemory
    from ._leases import Leases
    from ._memory import Memory
    from ._quotas import Charge, Quotas
    from ._records import Records
    from ._sessions import Caller, Session, Sessions
    from ._waits import Waits


class Writes(Batches):
    """The writing side of the registry."""

    def __init__(
        self,
        *,
        sessions: Sessions,
        records: Records,
        memory: Memory,
        quotas: Quotas,
        lending: Leases,
        waits: Waits,
        alloc_ttl: float,
        clock: Callable[[], float],
        count: Callable[..., None],
    ) -> None:
        self.sessions = sessions
        self.records = records
        self.memory = memory
        self.pool: Pool = memory.pool
        self.cuda: CudaMemory = memory.cuda
        self.quotas = quotas
        self.lending = lending
        self.waits = waits
        self.alloc_ttl = alloc_ttl  # unpublished past this: reclaimed (0: never)
        self.clock = clock
        self._count = count
        self.plans = Plans(self.pool.align, min(PACK_MOST, self.pool.dedicated_threshold))

    # -- placing -------------------------------------------------------------
    def _check_item(self, device: str, dtype: str, dims: list[int]) -> Checked:
        self.memory.check_device(device)
        return check_item(dtype, dims)

    async def alloc(
        self,
        sid: str | None,
        caller: Caller,
        req: AllocRequest,
        block: Block | None = None,
        request: str | None = None,
    ) -> tuple[Version, int | None]:
        """A new version in the writing state, and the writer's hold if asked.
        ``block``: place it there (a producer's shared CUDA memory)."""
        s = self.sessions.admit(sid, caller)
        shape, dtype, itemsize, nbytes = self._check_item(req.device, req.dtype, req.shape)
        # Charged before the first await: concurrent allocations see each other's bytes.
        with self.quotas.charge(s, nbytes, req.name) as charge:
            if block is None:
                block = await self.memory.place(s, req.name, req.device, nbytes)
                try:
                    self.sessions.resumed(s, sid, caller, request)
                except BaseException:
                    self.memory.give_back(block)  # nobody maps it yet
                    raise
            return self._place(
                s,
                req.name,
                req.ttl,
                req.hold,
                shape,
                dtype,
                itemsize,
                block,
                charge,
                request=request,
            )

    def try_alloc(
        self,
        sid: str | None,
        caller: Caller,
        req: AllocRequest,
        checked: Checked | None = None,
        request: str | None = None,
    ) -> tuple[Version, int | None] | None:
        """``alloc`` when it needs no new segment (a CPU tensor that fits in
        existing memory), without awaiting; None when it does.  ``checked``:
        what ``_check_item`` returned for ``req``, if the caller called it already."""
        s = self.sessions.admit(sid, caller)
        shape, dtype, itemsize, nbytes = checked or self._check_item(
            req.device, req.dtype, req.shape
        )
        if req.device not in CPU:
            return None
        with self.quotas.charge(s, nbytes, req.name) as charge:
            block = self.pool.try_alloc(nbytes)
            if block is None:
                return None
            return self._place(
                s,
                req.name,
                req.ttl,
                req.hold,
                shape,
                dtype,
                itemsize,
                block,
                charge,
                request=request,
            )

    def _place(
        self,
        s: Session,
        name: str,
        ttl: float | None,
        hold: bool,
        shape: tuple[int, ...],
        dtype: str,
        itemsize: int,
        block: Block,
        charge: Charge,
        count: bool = True,
        request: str | None = None,
        shared: bool = False,
        at: int = 0,
        nbytes: int | None = None,
    ) -> tuple[Version, int | None]:
        """The new writing version of ``name`` in ``block``, carrying its bytes
        of ``charge`` (``count``: in the metrics now; a batch counts its
        versions at once).  ``request``: the id of the request that allocated
        it, which cancels it if its answer was never read (and its hold, if
        any).  ``shared``: ``block`` is another version's too (``link``, tied
        weights and packs in a batch).  ``at``, ``nbytes``: where in
        ``block`` its bytes are (all of it by default)."""
        n = block.nbytes if nbytes is None else nbytes
        item = (shape, dtype, itemsize, n)
        (v,) = self._place_versions(s, [name], ttl, [item], [(block, at, shared)], charge, request)
        if count:
            self._count("allocs")
        return v, (self.lending.take(s, v, request, count=False, hold=True) if hold else None)

    def _place_versions(
        self,
        s: Session,
        names: list[str],
        ttl: float | None,
        items: list[Checked],
        places: list[tuple[Block, int, bool]],
        charge: Charge,
        request: str | None,
        ready: bool = False,
    ) -> list[Version]:
        """``_place`` of each of ``names``, of ``items`` (shape, dtype, item
        size, bytes), at ``places`` (its block, where in it its bytes start,
        whether the block is another version's too), in one loop: a batch
        places a version per tensor.  ``ready``: placed ready, as a put_many
        publishes its versions (``_publish_all``) before anything awaits."""
        entries, entry, memory = self.records.entries, self.records.entry, self.memory
        deadline = self.clock() + self.alloc_ttl if self.alloc_ttl else None
        sid, writing = s.id, s.writing
        state: Literal["writing", "ready"] = "ready" if ready else "writing"
        owner = None if ready else sid
        placed: list[Version] = []
        fresh = 0  # the bytes of the blocks no version was in
        for name, (shape, dtype, itemsize, n), (block, at, shared) in zip(
            names, items, places, strict=True
        ):
            e = entries.get(name) or entry(name)
            v = Version(
                name,
                e.next_version,
                block,
                shape,
                dtype,
                itemsize,
                state,
                owner,
                ttl=ttl,
                entry=e,
                nbytes=n,
                at=at,
            )
            e.next_version += 1
            if not ready:
                v.deadline, v.request = deadline, request
                e.writing[v.number] = v
                writing.add(v)
            if shared:
                block.refs += 1
            else:
                fresh += block.nbytes
            placed.append(v)
        memory.placed(len(placed), fresh)
        charge.attach(placed)
        return placed

    # -- publishing --------------------------------------------------------
    def _writing(self, s: Session, name: str, number: int) -> Version:
        e = self.records.entries.get(name)
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
        s = self.sessions.admit(sid, caller)
        return self._publish(s, self._writing(s, name, number))

    def publish_many(
        self, sid: str | None, caller: Caller, items: list[tuple[str, int]]
    ) -> list[Version]:
        """All or nothing: every item is checked before any is published.  A
        batch that cannot be published gives back every version of it that
        this session is writing, so a failed batch holds no memory."""
        s = self.sessions.admit(sid, caller)
        try:
            if len(set(items)) != len(items):
                raise InvalidRequest("a batch publishes each (name, version) once")
            versions = [self._writing(s, name, number) for name, number in items]
        except DepotError as exc:
            batch = set(items)
            dead = [v for v in s.writing if (v.name, v.number) in batch]
            for v in dead:
                self.abandon(v)
            raise type(exc)(
                f"{exc}; nothing of this batch was published, and the {len(dead)} "
                f"versions of it this session was writing were given back: put the "
                f"batch again"
            ) from None
        return self._publish_all(s, versions)

    def _publish(self, s: Session, v: Version) -> Version:
        """``v`` becomes ready, for good: its bytes never change again."""
        return self._publish_all(s, [v])[0]

    def _publish_all(
        self, s: Session, versions: list[Version], placed_ready: bool = False
    ) -> list[Version]:
        """Each of ``versions`` becomes ready, for good: its bytes never
        change again (``placed_ready``: they were placed ready, see
        ``_place_versions``).  Per version, what its name now refers to: it, or a
        newer version published first (then it is superseded at once)."""
        writing = s.writing
        wake = self.waits.wake if self.waits.asleep() else None  # nothing here wakes one
        now = None
        out: list[Version] = []
        retired: list[Version] = []  # retired together, once all are published
        rows: list[Row] = []  # of packs, likewise
        put = 0
        words = self.records.words()  # the board (shm._board), written before the answer
        for v in versions:
            e = v.entry
            assert e is not None
            if not placed_ready:  # ready already: see _place_versions
                del e.writing[v.number]
                writing.discard(v)
                v.state, v.owner, v.deadline = "ready", None, None
            q = e.pack  # the name's newest is a row of a pack
            if q is not None and q.numbers[e.index] < v.number:
                rows.append((q, e.index))
                e.pack = None
            old = e._ready if q is None else e.ready
            if old is not None and old.number > v.number:
                retired.append(v)  # a newer version was published first
                out.append(old)
                continue
            e.ready = v
            if words is not None and e.slot >= 0:
                words[e.slot] = v.number
            if v.ttl is None:
                e.expires_at = None
            else:
                now = self.clock() if now is None else now
                e.expires_at = now + v.ttl
            if old is not None:
                retired.append(old)
            put += v.nbytes
            if wake is not None:
                wake(v.name)
            out.append(v)
        self.memory.retire_after(retired, rows)
        self._count("publishes", sum(v is got for v, got in zip(versions, out, strict=True)))
        self._count("bytes_put", put)
        return out

    def abort(self, sid: str | None, caller: Caller, name: str, number: int) -> None:
        """Give back a version this session allocated and will not publish."""
        s = self.sessions.admit(sid, caller)
        for v in list(s.writing):
            if v.name == name and v.number == number:
                self.abandon(v)
                return
        raise TensorNotFound(f"this session is not writing version {number} of {name!r}")

    def abandon(self, v: Version) -> None:
        """Reclaim a version that was allocated but never published (once:
        a version already reclaimed is left as it is)."""
        if not v.current:
            return
        if v.owner:
            s = self.sessions.get(v.owner)
            if s is not None:
                s.writing.discard(v)
        e = self.records.entries.get(v.name)
        if e is not None and e.writing.get(v.number) is v:
            del e.writing[v.number]
            if not e.published and not e.writing:
                self.records.drop(e)
        self.memory.retire(v)
        self._count("writes_reclaimed")

    async def put_inline(
        self, sid: str | None, caller: Caller, req: AllocRequest, data: bytes
    ) -> Version:
        """Allocate, fill and publish a small tensor whose bytes came in the request."""
        self._check_inline(req, data)
        v, _ = await self.alloc(sid, caller, req)
        return self._fill_inline(sid, caller, v, data)

    def try_put_inline(
        self, sid: str | None, caller: Caller, req: AllocRequest, data: bytes
    ) -> Version | None:
        """``put_inline`` when it needs no new segment, without awaiting; None when it does."""
        got = self.try_alloc(sid, caller, req, self._check_inline(req, data))
        return None if got is None else self._fill_inline(sid, caller, got[0], data)

    def _check_inline(self, req: AllocRequest, data: bytes) -> Checked:
        checked = self._check_item(req.device, req.dtype, req.shape)
        shape, nbytes = checked[0], checked[3]
        if nbytes > INLINE_MAX:
            raise InvalidRequest(
                f"inline puts carry at most {INLINE_MAX} bytes; use alloc + publish"
            )
        if len(data) != nbytes:
            raise InvalidRequest(
                f"data has {len(data)} bytes but shape {list(shape)} of {req.dtype} needs {nbytes}"
            )
        return checked

    def _fill_inline(self, sid: str | None, caller: Caller, v: Version, data: bytes) -> Version:
        self.memory.fill(v, data)  # len(data) == v.nbytes, checked: the block holds it
        return self.publish(sid, caller, v.name, v.number)

    def link(
        self,
        sid: str | None,
        caller: Caller,
        name: str,
        lease_id: int,
        ttl: float | None = None,
        source: str | None = None,
    ) -> Version:
        """Publish the bytes a lease holds as the next version of ``name``, without a copy.

        ``source``: which of the lease's versions, by name (a pack's lease
        holds several).  The new version shares the block; the memory is
        freed when every version that shares it is gone.  It is charged to
        this session and its identity like a put of the same bytes (``_quotas``)."""
        s = self.sessions.admit(sid, caller)
        lease = self.lending.table.get(lease_id)
        if lease is None or lease.session != s.id:
            raise TensorNotFound(
                f"lease {lease_id} is not held by this session; get the source tensor again"
            )
        p = lease.pack
        held = [
            v
            for v in (lease.versions if p is None else [p.describe(i) for i in lease.rows])
            if source is None or v.name == source
        ]
        if len(held) != 1 or held[0].block is None:
            raise TensorNotFound(
                f"lease {lease_id} holds {len(held)} tensors: name the one to link (source)"
                if len(held) > 1
                else f"lease {lease_id} holds no {source!r}; get the source tensor again"
            )
        src = held[0]
        if src.state != "ready":
            raise Conflict(f"{src.name!r} v{src.number} is not published yet; publish it first")
        # An alias is charged to whoever makes it, as a copy would be: when the
        # original goes, the bytes it leaves held are still counted.
        with self.quotas.charge(s, src.nbytes, name) as charge:
            v, _ = self._place(
                s,
                name,
                ttl,
                False,
                src.shape,
                src.dtype,
                src.itemsize,
                src.block,
                charge,
                count=False,
                shared=True,
                at=src.at,
                nbytes=src.nbytes,
            )
        self._count("links")
        return self._publish(s, v)
