"""Leases: which session holds which version, so its memory stays put.

A get leases the version it answers with; an ``alloc(hold=True)`` leases the
version being written for the writer's own views; a forked child gets copies
of its parent's leases.  A lease belongs to one session and ends when that
session releases it, cancels the request that took it, or ends.  When the
last lease of a version that is no longer current ends, its memory is freed
(``Memory.free_if_unreachable``); until then, a version that only a reader's
lease keeps is charged to that reader (``reader_of``, ``Quotas.repin``).  A
get_many's lease of rows of a put_many's ``Pack`` counts once on the pack
(``Pack.readers``); its rows that no name points at any more go with the
pack's last lease (``Memory.pack_released``), still charged to whoever put
the pack.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

from ..._errors import LimitExceeded
from ._records import Found, Lease, Whole, name_of, nbytes_of

if TYPE_CHECKING:
    from ._cuda import CudaMemory
    from ._memory import Memory
    from ._records import Entry, Pack, Version
    from ._sessions import Session, Sessions


class Leases:
    """Every live lease, by id."""

    def __init__(
        self,
        sessions: Sessions,
        memory: Memory,
        cuda: CudaMemory,
        count: Callable[..., None],
        per_session: int = 65536,
    ) -> None:
        self.sessions = sessions
        self.per_session = per_session  # --max-leases-per-session
        # Reclaims a version being written (Writes.abandon): set by the broker.
        self.abandoned: Callable[[Version], None] | None = None
        self.memory = memory
        self.cuda = cuda
        self._count = count
        self.table: dict[int, Lease] = {}
        self._next = 1  # the next lease id: ids are never reused

    def take(
        self,
        s: Session,
        v: Found,
        request: str | None = None,
        *,
        count: bool = True,
        hold: bool = False,
        copy: bool = False,
    ) -> int:
        """A new lease of ``v`` for ``s``; ``request``: the id of the request
        that took it, which releases it if its answer is never read;
        ``copy``: a copy of a lease held already (a fork's), never refused
        for what the reader pins."""
        lid = self.take_many(s, [v], request, hold=hold, copy=copy)[0]
        if count:
            self._count("gets")
            self._count("bytes_got", nbytes_of(v))
        return lid

    def take_many(
        self,
        s: Session,
        found: Sequence[Found],
        request: str | None = None,
        *,
        hold: bool = False,
        copy: bool = False,
    ) -> list[int]:
        """Leases of ``found`` (versions, or rows of packs) for ``s``, as
        ``take`` (not counted: a batch is counted by its caller): per item,
        the id of the lease that holds it.  What a get finds in one pack
        shares one lease, which keeps the pack: the rows of a ``Pack``, or
        the versions of a block in ``Memory.packs``; any other version has a
        lease of its own.  Raises ``LimitExceeded``, taking none, past
        ``--max-leases-per-session``."""
        if found and not (hold or copy):
            self.memory.quotas.check_reader(s, name_of(found[0]))
        groups = (
            self._group(found)
            if not hold and (len(found) > 1 or (found and type(found[0]) is tuple))
            else None
        )
        n = len(found) if groups is None else len(groups)
        if len(s.leases) + n > self.per_session:
            self._count("lease_refusals")
            raise LimitExceeded(
                f"this session holds {len(s.leases)} leases, and {n} more would pass "
                f"--max-leases-per-session ({self.per_session}): release what you no longer read "
                f"(drop its views, or t.release()), or get fewer tensors at once"
            )
        first = self._next
        self._next = first + n
        if groups is None:
            lids = list(range(first, self._next))
            for lid, v in zip(lids, found, strict=True):
                self._lend(s, lid, (v,), request, hold)  # type: ignore[arg-type]
        elif len(groups) == 1:  # the usual batch: one pack
            held, pack, _ = groups[0]
            if pack is None:
                self._lend(s, first, held, request, hold)
            else:
                self._lend_pack(s, first, pack, held, request)
            lids = [first] * len(found)
        else:
            lids = [0] * len(found)
            for lid, (held, pack, at) in enumerate(groups, first):
                if pack is None:
                    self._lend(s, lid, held, request, hold)
                else:
                    self._lend_pack(s, lid, pack, held, request)
                for i in at:
                    lids[i] = lid
        if request is not None and lids:  # no entry for nothing: a get that finds
            # nothing and times out never comes back to remove one
            ids = s.by_request.get(request)
            if ids is None:
                s.by_request[request] = set(lids)
            else:
                ids.update(lids)
        return lids

    def _group(
        self, found: Sequence[Found]
    ) -> list[tuple[tuple[Any, ...], Pack | None, Sequence[int]]]:
        """(what, its pack, its positions) per lease: the rows of one ``Pack``
        together (each once, however often it was asked for), with the pack;
        the versions of one block of ``Memory.packs`` together; any other
        version alone."""
        if type(found) is Whole:  # every row of one pack, in order
            return [(tuple(range(len(found))), found.pack, range(len(found)))]
        first = found[0]
        if type(first) is tuple:  # the usual batch: rows of one pack, each once
            pack = first[0]
            rows = [f[1] for f in found if type(f) is tuple and f[0] is pack]
            if len(rows) == len(found) and len(set(rows)) == len(rows):
                return [(tuple(rows), pack, range(len(found)))]
        packs = self.memory.packs
        of_pack: dict[Any, tuple[dict[Any, None], Pack | None, list[int]]] = {}
        groups: list[tuple[dict[Any, None], Pack | None, list[int]]] = []
        for i, f in enumerate(found):
            if type(f) is tuple:
                key: Any = f[0]
                item: Any = f[1]
            else:
                key, item = f.block, f  # type: ignore[union-attr]
            group = of_pack.get(key)
            if group is None:
                group = ({}, key if type(f) is tuple else None, [])
                groups.append(group)
                if type(f) is tuple or key in packs:
                    of_pack[key] = group
            group[0][item] = None
            group[2].append(i)
        return [(tuple(held), pack, at) for held, pack, at in groups]

    def _lend(
        self, s: Session, lid: int, held: tuple[Version, ...], request: str | None, hold: bool
    ) -> None:
        self.table[lid] = Lease(lid, s.id, held, request, hold)
        if hold:
            for v in held:
                v.readers += 1
        else:
            for v in held:
                v.readers += 1
                v.reader = lid
                v.got += 1
                e = v.entry
                if e is not None:
                    e.readers += 1
        self.cuda.on_lease(lid, held, s)
        s.leases.add(lid)

    def _lend_pack(
        self, s: Session, lid: int, pack: Pack, rows: tuple[int, ...], request: str | None
    ) -> None:
        """A lease of ``rows`` of ``pack`` (host memory: nothing for the GPUs)."""
        self.table[lid] = Lease(lid, s.id, (), request, pack=pack, rows=rows)
        pack.readers += 1  # its names' readers are counted when asked (``row_readers``)
        s.leases.add(lid)

    def copy(self, s: Session, lease: Lease) -> int:
        """A copy of ``lease`` for ``s`` (a forked child's): the same versions,
        one lease, never refused for what the reader pins."""
        lid = self._next
        self._next += 1
        if lease.pack is None:
            self._lend(s, lid, lease.versions, None, lease.hold)
        else:
            self._lend_pack(s, lid, lease.pack, lease.rows, None)
        return lid

    def reader_of(self, v: Version) -> Session | None:
        """A session holding a get's lease of ``v`` (None: only writers' holds
        do): the last one to get it, if it still holds it, else any."""
        if not v.got:
            return None
        last = self.table.get(v.reader)
        if last is not None:
            return self.sessions.get(last.session)
        for lease in self.table.values():  # rare: the last reader let go, others still hold
            if v in lease.versions and not lease.hold:
                return self.sessions.get(lease.session)
        return None

    def row_readers(self) -> dict[Entry, int]:
        """Per name (its ``Entry``), the leases of pack rows it has: counted
        here, when a list asks, not at each get and release of a batch's
        thousand rows (``Entry.readers`` counts the leases of Versions)."""
        out: dict[Entry, int] = {}
        for lease in self.table.values():
            pack = lease.pack
            if pack is not None:
                entries = pack.entries
                for i in lease.rows:
                    e = entries[i]
                    out[e] = out.get(e, 0) + 1
        return out

    def of(self, s: Session) -> list[Lease]:
        return [self.table[lid] for lid in s.leases]

    def release_ids(self, s: Session, lease_ids: Iterable[int]) -> int:
        """End those of ``lease_ids`` that ``s`` holds (others are ignored)."""
        n = 0
        table, sid = self.table, s.id
        for lid in list(lease_ids):
            lease = table.get(lid)
            if lease is not None and lease.session == sid:
                del table[lid]
                self._end(lease, s)
                n += 1
        if n:
            self._count("releases", n)
        return n

    def release_one(self, lid: int, *, count: bool = True) -> None:
        lease = self.table.pop(lid)
        self._end(lease, self.sessions.get(lease.session))
        if count:
            self._count("releases")

    def _end(self, lease: Lease, s: Session | None) -> None:
        """``lease``, out of the table, ends: ``s`` (its session, if it is
        still open) forgets it, and its version's memory is freed if nothing
        else reaches it."""
        lid = lease.id
        if s is not None:
            s.leases.discard(lid)
            if lease.request is not None:
                ids = s.by_request.get(lease.request)
                if ids is not None:
                    ids.discard(lid)  # a set: a batch's thousand releases stay linear
                    if not ids:
                        del s.by_request[lease.request]
        pack = lease.pack
        if pack is not None:
            self.memory.pack_released(pack)
            return
        if lease.doubt:  # its views are gone: nothing maps the expired write any more
            self.memory.trust(lease.versions[0].block)
        for v in lease.versions:
            v.readers -= 1
            if not lease.hold:
                v.got -= 1
                if v.entry is not None:
                    v.entry.readers -= 1
        self.cuda.on_release(lease)
        if lease.hold and self.abandoned:
            for v in lease.versions:
                if v.readers == 0 and v.state == "writing":
                    # An empty() whose every view is gone, unpublished: nobody can
                    # publish it now, so its memory and quota come back at once.
                    self.abandoned(v)
        self.memory.free_if_unreachable(*lease.versions)
