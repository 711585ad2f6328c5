"""Memory: where versions live, when their bytes are freed, and when retired.

Host memory is a ``Pool`` of shared-memory segments; GPU memory is
``CudaMemory`` (``_cuda``).  This module places versions in them, keeps the
books (bytes in use, live versions, quotas through ``Quotas``), makes new
segments in worker threads and unlinks them there, never on the event loop
(README, Lifetime: M7), and maps segments for the broker's own reads and
writes (inline puts, Flight, peers).

It holds the broker's first invariant (``_broker`` lists them all):
**memory that a live view in any process can still reach is never handed
to another tensor.**  Two functions enforce it:

* ``_unreachable`` is the one place a block goes back to its pool: when
  the last reference of it goes.  A version holds one until its name no
  longer refers to it (``current`` false) and no lease holds it
  (``free_if_unreachable``); a put_many's ``Pack`` holds one until no name
  points at a row of it and no lease holds it (``_let_go``).  A block that
  versions and a pack share (``link``, ties, a row's ``Version``) is freed
  with the last of them.
* ``lapse`` and ``doubt`` mark memory that a process the broker cannot
  vouch for may still map (a session that missed its heartbeats, an
  unpublished write that expired): the pool then *retires* such a block
  instead of reusing it.

Retired memory comes back (``trust``) once the broker can prove that no
mapping of it is left, or after a bounded grace:

* an expired write's doubt ends with the writer's hold lease (its views are
  gone when the client releases it), or with the writer's session if that
  ends verified (the process is gone, or it closed);
* a lapsed session's leases come back when the resumed client says their
  views are gone (``release_stale``), and at the latest at the lapse's
  deadline (``expire_lapsed``): ``--lapse-grace`` after it lapsed (a fork
  never claimed lapses at the end of its claim window).
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from ..._errors import BrokerUnavailable, OutOfMemory
from ...shm import PosixMapping, byte_view
from ...shm._base import Segment
from ...shm._pool import Block, Pool, PoolExhausted
from ._records import CPU

if TYPE_CHECKING:
    from ._cuda import CudaMemory
    from ._quotas import Quotas
    from ._records import Lease, Pack, Row, Version
    from ._sessions import Caller, Session

log = logging.getLogger("tensordepot.broker")

MAX_LAPSED = 4096  # lapsed sessions whose retired leases can still be given back


class _Lapsed:
    """What a lapsed session could still map, until ``until`` (None: its segment drains)."""

    __slots__ = ("held", "owner", "unleased", "until")

    def __init__(
        self, owner: str, held: dict[int, Block], unleased: list[Block], until: float | None
    ) -> None:
        self.owner, self.held, self.unleased, self.until = owner, held, unleased, until


class Memory:
    """The broker's host pool and GPUs, and the books on them."""

    def __init__(
        self, pool: Pool, cuda: CudaMemory, quotas: Quotas, count: Callable[[str], None]
    ) -> None:
        self.pool = pool
        self.cuda = cuda
        self.quotas = quotas
        self._count = count
        self.bytes_in_use = 0
        self.versions_live = 0
        # Lapsed sessions, oldest first: session id -> what it could still map.
        self._lapsed: OrderedDict[str, _Lapsed] = OrderedDict()
        # Expired writes with no hold lease: session id -> blocks its process may still fill.
        self._doubts: dict[str, list[Block]] = {}
        self._maps: dict[str, PosixMapping] = {}
        # Slow memory work happens in threads: creating (fallocate) and unlinking.
        self._creator = ThreadPoolExecutor(2, thread_name_prefix="tensordepot-create")
        self._unlinker = ThreadPoolExecutor(1, thread_name_prefix="tensordepot-unlink")
        self._fresh: set[Segment] = set()  # created in a thread, not yet handed to the pool
        self._fresh_lock = threading.Lock()
        self._growing: asyncio.Future[None] | None = None  # a pool segment being made
        self._closed = False
        self.reader_of: Callable[[Version], Session | None] | None = None  # set by the broker
        # Published versions their name no longer refers to, kept by leases:
        # (name, number) -> version, so that a get of that exact version
        # finds it while it lives (numbers never repeat within a run).
        self.superseded: dict[tuple[str, int], Version] = {}
        # The same for rows of packs: the packs whose leases keep rows no
        # name points at (``Pack.kept``), each indexed by name only when a
        # get of an exact version looks there (``kept``): a put_many that
        # supersedes a leased pack costs no entry per row.
        self.kept_packs: dict[Pack, None] = {}
        # Packs (``_packs``): block -> its versions already gone, still charged
        # (and its ``Pack``, for a put_many's): what a pack keeps pinned counts
        # against whoever put it until it goes.
        self.packs: dict[Block, list[Version | Pack]] = {}
        # Retirements a publish left for after its answer (``retire_after``).
        self.unsettled: list[tuple[list[Version], list[Row]]] = []
        self.deferring = False  # set while a door's handler runs (``Gate.dispatch``)
        pool._unlinker = self._unlink_later
        pool.on_drop = self._forget_mapping

    # -- devices: the one place memory is chosen by where a tensor lives --------------
    def check_device(self, device: str) -> None:
        """Refuse a device this broker cannot place tensors on (a GPU it lacks)."""
        if device not in CPU:
            self.cuda.check_device(device)

    async def place(self, s: Session, name: str, device: str, nbytes: int) -> Block:
        """A block for ``name`` on ``device``: host memory (the pool, ``block``)
        or a GPU (``CudaMemory.alloc``); OutOfMemory, with its fix, when it
        does not fit."""
        if device not in CPU:
            return self.cuda.alloc(s, name, device, nbytes)
        try:
            return await self.block(nbytes)
        except PoolExhausted as exc:
            raise self.refused(name, nbytes, exc) from None

    def _free(self, block: Block, *, written: bool = True) -> None:
        """``block`` back to the memory it came from.  ``written``: its version
        was published (a GPU block's writer records its event no more)."""
        if block.device == "cpu":
            self.pool.free(block)
        else:
            self.cuda.free(block, written=written)

    # -- placing -------------------------------------------------------------------
    async def block(self, nbytes: int) -> Block:
        """A host block for ``nbytes``; a new segment is made in a worker thread.
        Requests that need a pool segment while one is being made wait for it
        and share it, instead of each making (and reserving) one of their own.
        Where none fits, replicas that no lease holds (a cache) are dropped
        for room first."""
        try:
            return await self._block(nbytes)
        except PoolExhausted:
            if self.quotas.evict is None or not self.quotas.evict(nbytes, None):
                raise
        return await self._block(nbytes)

    async def _block(self, nbytes: int) -> Block:
        while True:
            blk = self.pool.try_alloc(nbytes)
            if blk is not None:
                return blk
            size, dedicated = self.pool.plan(nbytes)
            if dedicated or self._growing is None:
                break
            await asyncio.shield(self._growing)
        self.pool.reserve(size, nbytes)
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

    def refused(self, name: str, nbytes: int, exc: PoolExhausted) -> OutOfMemory:
        """The 507 for an allocation no pool could place, with the fix for its cause."""
        self._count("quota_refusals")
        fix = exc.fix(
            "--max-memory",
            "--segment-size",
            "/dev/shm (`df -h /dev/shm`; in docker compose, shm_size)",
        )
        return OutOfMemory(f"cannot place {name!r} ({nbytes} bytes): {exc}; {fix}")

    def placed(self, versions: int, nbytes: int) -> None:
        """``versions`` new versions, in blocks of ``nbytes`` in all that no
        version was in (a version that shares a block already in use, a
        ``link``, counts its bytes once): they count as in use (their quota
        charges are their own, ``Charge.attach``, given back when freed)."""
        self.bytes_in_use += nbytes
        self.versions_live += versions

    def give_back(self, block: Block) -> None:
        """A block that was never handed out: nobody maps it, so reuse it at once."""
        self._free(block)

    # -- memory safety (the invariant in the module docstring) -------------------------
    def free_if_unreachable(self, *versions: Version) -> None:
        """Free the memory of each of ``versions`` that nothing can reach:
        its name no longer refers to it and no lease holds it.  The only way
        back to a pool."""
        superseded, packs = self.superseded, self.packs
        freed: list[Version] = []  # uncharged together (a batch's versions: one creator)
        for v in versions:
            if v.current or v.readers or v.block is None:
                continue
            key = (v.name, v.number)
            if superseded.get(key) is v:  # a kept row's key stays its pack's
                del superseded[key]
            block, v.block = v.block, None  # type: ignore[assignment]
            self.versions_live -= 1
            gone = packs.get(block)
            if gone is None:
                freed.append(v)
            else:  # charged until its pack goes
                gone.append(v)
            block.refs -= 1
            if block.refs == 0:  # no other version (see link) shares the bytes
                self._unreachable(block, v.state == "ready")
        if freed:
            self.quotas.uncharge_many(freed)

    def _unreachable(self, block: Block, written: bool) -> None:
        """Nothing refers to ``block`` any more: freed (a block with stale
        holders is retired instead), its bytes and its pack's charges given back."""
        self._free(block, written=written)
        self.bytes_in_use -= block.nbytes
        gone = self.packs.pop(block, None)
        if gone:
            self.quotas.uncharge_many(gone)  # type: ignore[arg-type]

    # -- a put_many's packs: rows, not versions (``Pack``) -------------------------
    def pack_placed(self, p: Pack) -> None:
        """``p`` holds its new block (its one reference): it counts as in use,
        each row as a live version, until its rows and leases are gone."""
        self.packs[p.block] = [p]
        self.placed(len(p.names), p.block.nbytes)

    def make(self, p: Pack, i: int, current: bool) -> Version:
        """The ``Version`` of row ``i`` of ``p``, which shares the block and
        is charged as part of ``p``: ``current``, its name's newest (the name
        then points at the Version, counted as the row was), else a row that
        leases of ``p`` keep, for a get of that exact version (a Version of
        its own each time, counted while its leases live; the row stays
        kept)."""
        v = p.describe(i)
        e = v.entry = p.entries[i]
        v.current = current
        p.block.refs += 1
        if current:
            e._ready, e.pack = v, None
            p.live -= 1
            if not p.live and not p.readers:
                self._let_go(p)
        else:  # the row stays kept: this Version lives as long as its own leases
            self.versions_live += 1
        return v

    def retire_rows(self, rows: list[Row]) -> None:
        """Their names no longer point at these rows: each is gone at once,
        or (its pack leased) kept until the pack's leases end."""
        kept_packs = self.kept_packs
        gone = 0
        last = None  # a batch's rows come in runs of one pack
        for p, i in rows:
            p.live -= 1
            if p.readers:
                p.kept.append(i)
                if p is not last:
                    last, p.kept_at = p, None
                    kept_packs[p] = None
            else:
                gone += 1
                if not p.live:
                    self._let_go(p)
        self.versions_live -= gone

    def retire_pack(self, p: Pack) -> None:
        """``retire_rows`` of every row of ``p``, each a live one (its names
        all moved on at once: ``_batches._again``)."""
        n, p.live = p.live, 0
        if p.readers:
            p.kept.extend(range(n))
            p.kept_at = None
            self.kept_packs[p] = None
        else:
            self.versions_live -= n
            self._let_go(p)

    def pack_released(self, p: Pack) -> None:
        """A lease of ``p`` ended: with the last, its kept rows are gone."""
        p.readers -= 1
        if p.readers:
            return
        if p.kept:
            del self.kept_packs[p]
            self.versions_live -= len(p.kept)
            p.kept.clear()
            p.kept_at = None
        if not p.live:
            self._let_go(p)

    def kept(self, name: str, number: int) -> Version | Row | None:
        """Version ``number`` of ``name`` if leases keep it though its name
        moved on: a ``Version``, or a row of a pack; None if none does."""
        v = self.superseded.get((name, number))
        if v is not None:
            return v
        for p in self.kept_packs:
            at = p.kept_at
            if at is None:  # a pack holds a name once
                at = p.kept_at = {p.names[i]: i for i in p.kept}
            i = at.get(name, -1)
            if i >= 0 and p.numbers[i] == number:
                return p, i
        return None

    def pack_dropped(self, p: Pack) -> None:
        """A pack placed but never published (its fill failed): gone."""
        self.versions_live -= len(p.names)
        self._let_go(p)

    def _let_go(self, p: Pack) -> None:
        """No name points at a row of ``p`` and no lease holds it: its
        reference of the block goes (the block with it, unless a Version made
        of a row, a link or a tie still shares it)."""
        if p.held:
            p.held = False
            block = p.block
            block.refs -= 1
            if block.refs == 0:
                self._unreachable(block, True)

    def retire(self, *versions: Version) -> None:
        """Their names no longer refer to ``versions``: each is freed once its
        last lease ends.  Until then what a reader pins is charged to the
        reader (``Quotas.repin``)."""
        for v in versions:
            v.current = False
        self.free_if_unreachable(*versions)
        for v in versions:
            if v.block is None:  # freed
                continue
            if v.state == "ready":
                self.superseded[(v.name, v.number)] = v
            if v.readers and self.reader_of is not None:
                holder = self.reader_of(v)
                if holder is not None:
                    self.quotas.repin(v, holder)

    # -- retirement after the answer ---------------------------------------------------
    def retire_after(self, versions: list[Version], rows: list[Row]) -> None:
        """``retire`` of ``versions`` and ``retire_rows`` of ``rows``: now, or,
        while a door's handler runs (``deferring``), once its answer is out:
        the door calls ``retire_pending`` right after writing it, in the same step of
        the loop, so its client hears back while the broker frees, and no
        other request (none runs in between) sees the books unsettled.  A
        door that did not settle leaves it to the next request's dispatch,
        or to the loop's next turn, whichever comes first."""
        if not self.deferring:
            self.retire(*versions)
            self.retire_rows(rows)
            return
        if not versions and not rows:
            return
        if not self.unsettled:
            asyncio.get_running_loop().call_soon(self.retire_pending)
        self.unsettled.append((versions, rows))

    def retire_pending(self) -> None:
        """What ``retire_after`` left, done now (nothing, mostly)."""
        after = self.unsettled
        while after:
            versions, rows = after.pop(0)
            self.retire(*versions)
            self.retire_rows(rows)

    @staticmethod
    def distrust(block: Block) -> None:
        """A process may still map ``block`` and nobody will say when it stops:
        when freed, the block is retired instead of reused."""
        block.stale += 1

    def trust(self, block: Block) -> None:
        """One reason to distrust ``block`` is gone: with none left, a retired
        block goes back to its pool."""
        block.stale -= 1
        if block.stale == 0 and block.retired and block.device == "cpu":
            self.pool.unretire(block)

    def doubt(self, s: Session, v: Version, leases: list[Lease]) -> None:
        """``v``, which ``s`` is still writing, expired (--alloc-ttl): its
        writer may still copy into it.  Distrusted until the writer's hold
        ends (its views are gone), or ``s`` ends verified."""
        self.distrust(v.block)
        for lease in leases:
            if lease.hold and v in lease.versions and not lease.doubt:
                lease.doubt = True
                return
        self._doubts.setdefault(s.id, []).append(v.block)

    def settle(self, s: Session) -> None:
        """``s`` ended verified: nothing of its process maps what it doubted."""
        for block in self._doubts.pop(s.id, ()):
            self.trust(block)

    def lapse(self, s: Session, leases: list[Lease], until: float | None) -> None:
        """``s`` ended unheard (its process may be paused, not dead): everything
        it could map is distrusted until ``until`` (None: until its segment
        drains).  Its leases are remembered so that the process, when it
        resumes and its views die, can give them back (``release_stale``)."""
        held = {}
        for lease in leases:
            # a pack lease's versions share it
            block = lease.versions[0].block if lease.pack is None else lease.pack.block
            if block is not None:
                self.distrust(block)
                held[lease.id] = block
        holds = {v for lease in leases if lease.hold for v in lease.versions}
        unleased = self._doubts.pop(s.id, [])  # distrusted already
        for v in s.writing:
            if v not in holds and v.block not in unleased:
                # a put's fill in flight: no lease ever says it is done
                self.distrust(v.block)
                unleased.append(v.block)
        if held or unleased:
            self._lapsed[s.id] = _Lapsed(s.owner, held, unleased, until)
            # Beyond the bound, the oldest are forgotten: retired until their segment drains.
            while len(self._lapsed) > MAX_LAPSED:
                self._lapsed.popitem(last=False)

    def expire_lapsed(self, now: float) -> int:
        """Give back what lapsed sessions past their deadline held: their
        processes count as gone (README, Limits).  The number of blocks."""
        n = 0
        for sid in [
            sid for sid, rec in self._lapsed.items() if rec.until is not None and rec.until <= now
        ]:
            rec = self._lapsed.pop(sid)
            for block in [*rec.held.values(), *rec.unleased]:
                self.trust(block)
                n += 1
        return n

    def still_held(self, owner: str, sids: list[str], until: float | None) -> None:
        """Views of ``owner``'s process still map what these lapsed sessions
        held: they stay retired until ``until`` at the earliest (None: until
        their segments drain)."""
        for sid in sids:
            rec = self._lapsed.get(sid)
            if rec is not None and rec.owner == owner and rec.until is not None:
                rec.until = None if until is None else max(rec.until, until)

    def release_stale(self, caller: Caller, stale: dict[str, list[int]]) -> int:
        """A client whose session lapsed says the views of these leases of
        that old session are gone: their memory, retired when the session
        lapsed, may be reused."""
        n = 0
        for sid, lease_ids in stale.items():
            rec = self._lapsed.get(sid)
            if rec is None or rec.owner != caller.identity:
                continue  # not a lapsed session of this caller: nothing to give back
            held = rec.held
            for lid in lease_ids:
                blk = held.pop(lid, None)
                if blk is None:
                    continue
                self.trust(blk)
                n += 1
            if not held and not rec.unleased:
                del self._lapsed[sid]
        return n

    # -- the broker's own mappings -------------------------------------------------
    def _forget_mapping(self, segment: str) -> None:
        self._maps.pop(segment, None)

    def _map(self, segment: str) -> PosixMapping:
        m = self._maps.get(segment)
        if m is None:  # the pool's on_drop forgets mappings of unlinked segments
            m = self._maps[segment] = PosixMapping(segment, writable=True)
        return m

    def view(self, v: Version, *, writable: bool = False) -> Any:
        """The bytes of ``v`` as a flat uint8 numpy array over the broker's own
        mapping.  The array keeps the mapping alive after the pool unlinks the
        segment."""
        return byte_view(self._map(v.block.segment), v.offset, v.nbytes, writable=writable)

    def fill(self, v: Version, data: bytes) -> None:
        """Copy ``data`` (``v.nbytes`` of them, checked) into an unpublished ``v``."""
        if v.nbytes:
            ctypes.memmove(self._map(v.block.segment).address + v.offset, data, v.nbytes)

    def fill_runs(
        self, blocks: list[Block], runs: list[tuple[int, int, int]], data: memoryview
    ) -> None:
        """Copy ``data`` into unpublished tensors, one after another: each run
        (its block's index in ``blocks``, where in it, its bytes) takes its
        bytes (their sum is ``len(data)``, checked: ``Plan.runs``).  Without
        numpy, which the broker would otherwise import on its first batch."""
        src = data.cast("B")
        at = 0
        for k, to, n in runs:
            block = blocks[k]
            address = self._map(block.segment).address + block.offset + to
            memoryview((ctypes.c_char * n).from_address(address)).cast("B")[:] = src[at : at + n]
            at += n

    # -- shutdown --------------------------------------------------------------------
    def close(self) -> None:
        """Stop the worker threads and unlink every segment (broker shutdown)."""
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
