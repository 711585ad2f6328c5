"""Batches: a state dict's tensors allocated, or put, in one request per step.

``alloc_many`` places a writing version per tensor (published later with
``publish_many``); ``put_many`` places, fills and publishes tensors whose
bytes came in the request, all or none, without awaiting between.  A
put_many's small host tensors share packs (``_packs``); each pack is one
record, a ``Pack``: its names point at its rows, and no ``Version`` is made
for a row until something needs one (``Entry.ready``).  Publishing a pack
retires what its names pointed at, rows of an earlier pack included, in
one pass.  ``Writes`` is this class with the single-tensor side
(``_writes``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from ..._errors import InvalidRequest
from ._packs import check_carried, packed
from ._records import CPU, Entry, Found, Pack, Row, Version, whole, whole_pack

if TYPE_CHECKING:
    from ..._wire import ManyAlloc
    from ...shm._pool import Block, Pool
    from ._memory import Memory
    from ._packs import Plan, Plans
    from ._quotas import Charge, Quotas
    from ._records import Records
    from ._sessions import Caller, Session, Sessions
    from ._waits import Waits


class Batches:
    """The batch side of ``Writes`` (which sets these attributes)."""

    sessions: Sessions
    records: Records
    memory: Memory
    pool: Pool
    quotas: Quotas
    waits: Waits
    plans: Plans
    clock: Callable[[], float]
    _count: Callable[..., None]
    _place_versions: Callable[..., list[Version]]  # Writes': the single-tensor side
    _publish_all: Callable[..., list[Version]]

    def _batch(
        self, sid: str | None, caller: Caller, req: ManyAlloc, carried: int | None
    ) -> tuple[Session, Plan, Charge]:
        """The session, the batch's plan (every item checked, and the GPUs
        ``req.devices`` names) and its bytes charged, before anything is
        placed.  A tensor that is another's bytes (``same``) is charged as
        a copy would be, as ``link`` charges it.  ``carried``: the bytes the
        request carries for the batch (``put_many``)."""
        s = self.sessions.admit(sid, caller)
        names = req.names
        plan = self.plans.plan(
            req, lambda: self._check_devices(req.devices or [], len(names), req.same, carried)
        )
        if carried is not None:
            check_carried(plan.need, carried)
        what = f"{len(names)} tensors" if len(names) != 1 else names[0]
        return s, plan, self.quotas.charge(s, plan.total, what)

    def _check_devices(
        self, devices: list[str], n: int, same: list[int] | None, carried: int | None
    ) -> None:
        if len(devices) != n:
            raise InvalidRequest(
                f"a batch that names devices names one per tensor: {n} names, "
                f"{len(devices)} devices"
            )
        gpus = {d for d in devices if d not in CPU}
        if not gpus:
            return
        if carried is not None:
            raise InvalidRequest(
                "the bytes a put_many carries go to host memory: allocate GPU tensors "
                "with /v1/many/alloc and publish them with /v1/many/publish"
            )
        if same is not None and any(j >= 0 for j in same):
            raise InvalidRequest("same (tensors stored once) is for host memory only")
        for d in sorted(gpus):
            self.memory.check_device(d)

    # -- alloc_many: writing versions ----------------------------------------------
    def try_alloc_many(
        self, sid: str | None, caller: Caller, req: ManyAlloc, request: str | None = None
    ) -> list[Version] | None:
        """``alloc_many`` when every tensor fits in existing memory, without
        awaiting; None (and nothing allocated) when one does not, or when
        one goes to a GPU."""
        if req.devices is not None and any(d not in CPU for d in req.devices):
            return None
        s, plan, charge = self._batch(sid, caller, req, None)
        with charge:
            got = self.pool.try_alloc_many(plan.sizes)
            if got is None:
                return None
            return self._place_all(s, req, plan, got, charge, request)

    async def alloc_many(
        self, sid: str | None, caller: Caller, req: ManyAlloc, request: str | None = None
    ) -> list[Version]:
        """A new writing version of each name of ``req``, all or none, in
        host memory or on the GPU ``req.devices`` names for it."""
        s, plan, charge = self._batch(sid, caller, req, None)
        with charge:
            blocks = await self._blocks(s, sid, caller, req, plan, request)
            return self._place_all(s, req, plan, blocks, charge, request)

    async def _blocks(
        self,
        s: Session,
        sid: str | None,
        caller: Caller,
        req: ManyAlloc,
        plan: Plan,
        request: str | None,
    ) -> list[Block]:
        """The blocks of ``plan``, new segments made where needed (``request``:
        see ``Sessions.resumed``)."""
        first: dict[int, int] = {}  # block -> the first tensor in it
        for i, (k, _) in enumerate(plan.where):
            if k >= 0:
                first.setdefault(k, i)
        blocks: list[Block] = []
        try:
            for k, n in enumerate(plan.sizes):
                i = first[k]
                device = "cpu" if req.devices is None else req.devices[i]
                blocks.append(await self.memory.place(s, req.names[i], device, n))
            self.sessions.resumed(s, sid, caller, request)
        except BaseException:
            for b in blocks:
                self.memory.give_back(b)  # nobody maps them yet
            raise
        return blocks

    def _place_all(
        self,
        s: Session,
        req: ManyAlloc,
        plan: Plan,
        blocks: list[Block],
        charge: Charge,
        request: str | None,
    ) -> list[Version]:
        """The batch's writing versions in ``blocks``."""
        places = packed(blocks, plan)
        packs = self.memory.packs
        for k in plan.packs:
            packs.setdefault(blocks[k], [])  # two tensors of the batch in one block
        placed = self._place_versions(s, req.names, req.ttl, plan.items, places, charge, request)
        self._count("allocs", len(placed))
        return placed

    # -- put_many: the bytes came in the request ---------------------------------------
    def try_put_many(
        self, sid: str | None, caller: Caller, req: ManyAlloc, data: memoryview
    ) -> list[Found] | None:
        """``put_many`` when it needs no new segment, without awaiting; None
        (and nothing allocated) when it does, or when the batch names a GPU
        (``put_many`` says why it cannot)."""
        if req.devices is not None and any(d not in CPU for d in req.devices):
            return None
        s, plan, charge = self._batch(sid, caller, req, len(data))
        with charge:
            got = self.pool.try_alloc_many(plan.sizes)
            if got is None:
                return None
            return self._put_all(s, sid, caller, req, plan, got, charge, data)

    async def put_many(
        self, sid: str | None, caller: Caller, req: ManyAlloc, data: memoryview
    ) -> list[Found]:
        """Allocate, fill and publish a batch of small tensors whose bytes came
        in the request (``data``: each tensor's C-ordered bytes in order, once
        for tensors that are an earlier one's, ``same``); all or none.  Per
        tensor, in order, what its name now refers to (a ``Version``, or a
        row of a pack)."""
        s, plan, charge = self._batch(sid, caller, req, len(data))
        with charge:
            blocks = await self._blocks(s, sid, caller, req, plan, None)
            return self._put_all(s, sid, caller, req, plan, blocks, charge, data)

    def _put_all(
        self,
        s: Session,
        sid: str | None,
        caller: Caller,
        req: ManyAlloc,
        plan: Plan,
        blocks: list[Block],
        charge: Charge,
        data: memoryview,
    ) -> list[Found]:
        """Place, fill and publish, without awaiting: every tensor is this
        session's to publish, and nothing else sees them before."""
        places = packed(blocks, plan, plan.lone)
        names = req.names
        out: list[Found] = list(names)  # type: ignore[arg-type]  # each replaced below
        lone = plan.lone
        versions: list[Version] = []
        if lone:
            versions = self._place_versions(
                s,
                [names[i] for i in lone],
                req.ttl,
                [plan.items[i] for i in lone],
                places,
                charge,
                None,
                ready=True,
            )
            for i, v in zip(lone, versions, strict=True):
                out[i] = v
        # The usual batch: one pack of every tensor, its rows in their order.
        single = not lone and len(plan.rows) == 1 and len(plan.rows[0][1]) == len(names)
        packs = self._place_packs(plan, blocks, req.ttl, None if single else out)
        charge.attach([p for p, _ in packs])  # type: ignore[misc]  # charged as one version each
        self._count("allocs", len(names))
        try:
            self.sessions.admit(sid, caller)
            self.memory.fill_runs(blocks, plan.runs, data)
        except BaseException:
            self.memory.retire(*versions)  # placed ready, yet no name refers to them
            for p, _ in packs:
                self.memory.pack_dropped(p)
            raise
        if versions:
            for i, v in zip(lone, self._publish_all(s, versions, placed_ready=True), strict=True):
                out[i] = v
        self._publish_packs(packs)
        return whole(packs[0][0]) if single else out

    def _place_packs(
        self, plan: Plan, blocks: list[Block], ttl: float | None, out: list[Found] | None
    ) -> list[tuple[Pack, Pack | None]]:
        """Each pack of ``plan`` as one ``Pack``, with ``out`` (if given) its
        rows' positions; its rows take their names' next numbers here, or
        (the pack before it: ``_again``) when it is published."""
        entries, entry, memory = self.records.entries, self.records.entry, self.memory
        packs = []
        for k, at, names, items, ats, shapes, key in plan.rows:
            before = _again(entries, names, ttl)
            numbers: list[int] = []
            if before is not None:
                ents = list(before.entries)
            else:
                ents = []
                for name in names:
                    e = entries.get(name) or entry(name)
                    numbers.append(e.next_version)
                    e.next_version += 1
                    ents.append(e)
            p = Pack(
                blocks[k],
                names,
                numbers,
                items,
                ats,
                shapes,
                ents,
                ttl,
                memory,
                plan.used[k],
                key=key,
            )
            memory.pack_placed(p)
            packs.append((p, before))
            if out is not None:
                for j, i in enumerate(at):
                    out[i] = (p, j)
        return packs

    def _publish_packs(self, packs: list[tuple[Pack, Pack | None]]) -> None:
        """Each row of ``packs`` becomes its name's newest, for good: what the
        names pointed at is retired (a Version, or a row of another pack).
        A pack placed over the pack before it (``_again``) takes its names'
        numbers now, in the one pass that points them at it, and retires
        that pack whole."""
        asleep = self.waits.asleep()  # else nothing here wakes one
        retired: list[Version] = []
        rows: list[Row] = []
        now = None
        words = self.records.words()  # the board (shm._board), written before the answer
        memory = self.memory
        for p, before in packs:
            if before is not None:
                numbers = p.numbers
                for e in p.entries:
                    n = e.next_version
                    e.next_version = n + 1
                    numbers.append(n)
                    e.pack = p
                    if words is not None and e.slot >= 0:
                        words[e.slot] = n
                p.slots = before.slots  # the same names' (a name keeps its slot)
                memory.retire_pack(before)
            else:
                expires = None
                if p.ttl is not None:
                    now = self.clock() if now is None else now
                    expires = now + p.ttl
                for i, e in enumerate(p.entries):
                    old = e._ready
                    if old is not None:
                        retired.append(old)
                        e._ready = None
                    else:
                        q = e.pack
                        if q is not None:
                            rows.append((q, e.index))
                    e.pack, e.index, e.expires_at = p, i, expires
                    if words is not None and e.slot >= 0:
                        words[e.slot] = p.numbers[i]
            p.live = len(p.entries)
            if asleep:
                self.waits.wake_many(p.names)
        memory.retire_after(retired, rows)
        self._count("publishes", sum(len(p.names) for p, _ in packs))
        self._count("bytes_put", sum(p.nbytes for p, _ in packs))


def _again(entries: dict[str, Entry], names: list[str], ttl: float | None) -> Pack | None:
    """The pack a put_many's pack of ``names`` is placed over, when its names
    all point at that pack's rows in the same order (a state dict put again
    step after step: ``whole_pack``), and neither pack has a TTL: then every
    entry of it only moves on to the same row of the new pack (its
    ``index``, ``expires_at``, ``_ready`` and slot stay), and it is retired
    whole.  None: place row by row."""
    if not names or ttl is not None:
        return None
    q = whole_pack(entries.get(names[0]), names)
    return q if q is not None and q.ttl is None else None
