"""The broker: names, versions, leases and sessions, one request at a time.

``Broker`` is what the HTTP layer, Flight, the peers and the CLI call.  It
checks the caller's session and composes the collaborators, one module each:

* ``_records``: names and their versions (``Version``, ``Entry``, ``Lease``,
  and ``Pack``: a put_many's tensors as one record);
* ``_memory``: where versions live, when memory is freed or retired;
* ``_leases``: which session holds which version;
* ``_writes`` and ``_batches``: allocations, puts and publishes, of one
  tensor or a batch (``_packs``: a batch's geometry);
* ``_reads``: gets, of one name or a batch, at once or after a wait;
* ``_waits``: gets parked until a publish (the long poll);
* ``_quotas``: the limits, and bytes charged per session and identity;
* ``_sessions``: who a client is and whether it is alive;
* ``_cuda``: GPU memory.

Everything runs on the event loop thread, so nothing needs a lock; the
slow parts of memory (creating, pre-faulting and unlinking segments) run in
worker threads and never on the loop (README, Lifetime: M7).

Lifetime (README, "Lifetime"): ``alloc`` creates version N+1 of a name in the
*writing* state, owned by the allocating session; ``publish`` makes it
*ready* and retires the previous ready version.  ``get`` leases the newest
ready version, and ``alloc(hold=True)`` leases the version being written for
the writer's own views.

The invariants, and the functions that keep them:

1. **Memory that a live view in any process can still reach is never
   handed to another tensor** (M1).  ``Memory._unreachable`` is the only
   way memory goes back to a pool: once nothing refers to its block, that
   is, for each version in it, its name no longer refers to it *and* no
   lease holds it (``Memory.free_if_unreachable``), and for a pack, no name
   points at a row of it *and* no lease holds it (``Memory._let_go``).
   Memory that a process the broker cannot vouch for may still map (a
   lapsed heartbeat session, an unpublished write that expired) is retired
   instead of reused:
   ``Memory.lapse`` and ``Memory.doubt``; it comes back (``Memory.trust``)
   once the broker can prove no mapping is left (the writer's hold ended,
   its session ended verified, the resumed client said so), or after a
   bounded grace (``--lapse-grace``; ``--alloc-ttl`` for a fork never
   claimed).
2. **Published bytes never change.**  The broker writes only into versions
   being written (``Broker._fill_inline``; peers and Flight fill what they
   allocated), ``Broker._publish`` ends the writing state for good, and
   ``link`` shares only published bytes; together with 1, the range of a
   ready version is never reused while it is readable.
3. **Versions of a name only grow** (M3), across delete, abort, reclaim and
   expiry: ``Records.entry`` and ``Records.drop``.
4. **Broker state is bounded by live work, never by history**: names go
   with their last version (``Records.drop``), waits with their last waiter
   (``Waits``), lapsed sessions' leases past ``MAX_LAPSED`` are forgotten
   (``Memory.lapse``), and sessions, unpublished allocations and memory
   have limits (``Limits``).
"""

from __future__ import annotations

import builtins
import logging
import os
import secrets
import time
from collections.abc import Callable, Sequence
from typing import Any

from ..._errors import BrokerUnavailable, Forbidden, InvalidRequest, TensorNotFound
from ..._wire import ForkInfo, HeldName, Holder, SessionInfo, Stat, TensorInfo
from ...shm._pool import Pool
from ._cuda import CudaMemory
from ._leases import Leases
from ._memory import Memory
from ._quotas import Limits, Quotas
from ._reads import Reads
from ._records import PeerHook, Records, Version
from ._sessions import LOCAL, Caller, Session, Sessions
from ._waits import Waits
from ._writes import Writes

log = logging.getLogger("tensordepot.broker")


class Broker:
    """The registry.  Its writing side is ``Writes`` (``_writes``), whose
    methods it answers with: ``alloc``, ``try_alloc``, ``alloc_many``,
    ``try_alloc_many``, ``publish``, ``publish_many``, ``abort``,
    ``abandon``, ``put_inline``, ``try_put_inline``, ``put_many``,
    ``try_put_many`` and ``link``; its
    reading side is ``Reads`` (``_reads``): ``try_get``, ``try_get_many``,
    ``get``, ``get_many`` and ``get_version``.
    ``ready(name, newer_than)``: the newest ready version
    of ``name`` newer than ``newer_than``, or None."""

    def __init__(
        self,
        pool: Pool,
        *,
        limits: Limits | None = None,
        clock: Callable[[], float] = time.monotonic,
        proc: str = "/proc",
        cuda: CudaMemory | None = None,
    ) -> None:
        self.limits = lim = limits or Limits()
        # This run's id: version numbers start again with a new broker, so
        # whatever names a version across runs (a pickle, a replica's
        # origin) names the run too.
        self.instance = secrets.token_hex(8)
        self.pool = pool
        self.cuda = cuda if cuda is not None else CudaMemory()  # GPUs: nothing until first used
        self.clock = clock
        self.counters: dict[str, int] = {}
        self.sessions = Sessions(
            session_ttl=lim.session_ttl,
            claim_window=lim.claim_window,
            max_sessions=lim.max_sessions,
            max_per_peer=lim.max_sessions_per_peer,
            clock=clock,
            proc=proc,
        )
        self.records = Records(clock)
        self.quotas = Quotas(lim, self.sessions, self._count)
        self.memory = Memory(pool, self.cuda, self.quotas, self._count)
        self.lending = Leases(
            self.sessions, self.memory, self.cuda, self._count, lim.max_leases_per_session
        )
        self.memory.reader_of = self.lending.reader_of
        self.waits = Waits()
        self.writes = w = Writes(
            sessions=self.sessions,
            records=self.records,
            memory=self.memory,
            quotas=self.quotas,
            lending=self.lending,
            waits=self.waits,
            alloc_ttl=lim.alloc_ttl,
            clock=clock,
            count=self._count,
        )
        self.lending.abandoned = w.abandon
        self.quotas.evict = self._evict
        self.reads = r = Reads(
            sessions=self.sessions,
            records=self.records,
            lending=self.lending,
            waits=self.waits,
            count=self._count,
            kept=self.memory.kept,
        )
        self.try_get, self.try_get_many, self.get, self.get_many = (
            r.try_get,
            r.try_get_many,
            r.get,
            r.get_many,
        )
        self.get_version = r.get_version
        self.entries = self.records.entries  # name -> Entry
        self.leases = self.lending.table  # lease id -> Lease
        self.ready = self.records.ready
        # The writing side answers as the broker's own methods, at no extra call.
        self.alloc, self.try_alloc, self.alloc_many, self.try_alloc_many = (
            w.alloc,
            w.try_alloc,
            w.alloc_many,
            w.try_alloc_many,
        )
        self.publish, self.publish_many, self.abort, self.abandon = (
            w.publish,
            w.publish_many,
            w.abort,
            w.abandon,
        )
        self.put_inline, self.try_put_inline, self.link = w.put_inline, w.try_put_inline, w.link
        self.put_many, self.try_put_many = w.put_many, w.try_put_many
        self.cuda.count = self._count

    # -- the books -----------------------------------------------------------
    @property
    def peers(self) -> PeerHook | None:
        """The other hosts' brokers (``--peer``), which gets may ask; None: none."""
        return self.reads.peers

    @peers.setter
    def peers(self, hook: PeerHook | None) -> None:
        self.reads.peers = hook

    @property
    def closing(self) -> bool:
        """Shutting down: new work is refused with 503."""
        return self.sessions.closing

    @closing.setter
    def closing(self, value: bool) -> None:
        self.sessions.closing = value

    @property
    def bytes_in_use(self) -> int:
        return self.memory.bytes_in_use

    @property
    def versions_live(self) -> int:
        return self.memory.versions_live

    @property
    def waiting(self) -> int:
        return self.waits.waiting

    def _count(self, what: str, n: int = 1) -> None:
        self.counters[what] = self.counters.get(what, 0) + n

    # -- sessions ----------------------------------------------------------
    def open_session(
        self, caller: Caller, label: str | None = None, holding: Sequence[str] = ()
    ) -> SessionInfo:
        """``holding``: as for ``heartbeat``, said at once by a process that
        resumes and finds its session lapsed."""
        if self.closing:
            raise BrokerUnavailable("the broker is shutting down")
        s = self.sessions.open(caller, label=label)
        self._count("sessions_opened")
        self._still_held(s, holding)
        return self._session_info(s)

    def own_session(self, label: str, caller: Caller = LOCAL) -> str:
        """A session for work the broker itself drives (a Flight stream, a
        pull): it never lapses, however long the work takes, and ends only
        with ``end_local_session``.  ``caller``: whom its allocations are
        charged to (a pushing token; the broker itself by default)."""
        if self.closing:
            raise BrokerUnavailable("the broker is shutting down")
        s = self.sessions.open(caller, label=label, own=True)
        self._count("sessions_opened")
        return s.id

    def _session_info(self, s: Session) -> SessionInfo:
        interval = None if s.tracked else s.ttl / 3
        return SessionInfo(
            session=s.id,
            pid=s.pid,
            tracked=s.tracked,
            heartbeat_interval=interval,
            instance=self.instance,
            floor_query=True,
        )

    def heartbeat(self, sid: str, caller: Caller, holding: Sequence[str] = ()) -> None:
        """``holding``: lapsed sessions of this process whose leases live views
        still hold.  The process is alive: their memory stays retired, the
        grace (``_lapse_deadline``) counting again from this heartbeat."""
        self._still_held(self.sessions.admit(sid, caller), holding)

    def _still_held(self, s: Session, holding: Sequence[str]) -> None:
        """What ``s``'s process says its views still hold (at most 64 lapsed sessions)."""
        if holding:
            self.memory.still_held(s.owner, list(holding[:64]), self._lapse_deadline(s))

    def close_session(self, sid: str, caller: Caller, *, exiting: bool = False) -> None:
        """The client ends its own session: it holds no view any more, so its
        memory is safe to reuse.  ``exiting``: its process is on its way out,
        perhaps with views alive; they die with it, so the session ends when
        the process is gone (or its heartbeats stop), counted as an exit."""
        s = self.sessions.use(sid, caller)
        if exiting and (s.leases or s.writing):
            s.exiting = True
            return
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
        parent = self.sessions.admit(sid, caller)
        child = self.sessions.open(
            caller, label=f"fork of {parent.label or sid[:8]}", claimed=False
        )
        mapping = {}
        for lid in sorted(parent.leases):
            mapping[str(lid)] = self.lending.copy(child, self.leases[lid])
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
        if verified:
            self.memory.settle(s)
        else:
            self.memory.lapse(s, self.lending.of(s), self._lapse_deadline(s))
        self.sessions.remove(s)
        for lid in list(s.leases):
            self.lending.release_one(lid)
        for v in list(s.writing):
            self.abandon(v)
        for fut in s.waits.values():
            if not fut.done():
                fut.set_result(None)
        self.cuda.end_session(self, s)
        self._count("sessions_ended")
        if not verified:
            self._count("sessions_lapsed")

    def _lapse_deadline(self, s: Session) -> float | None:
        """When a lapsed session's process counts as gone (README, Limits):
        ``--lapse-grace`` from now (None: never).  A fork never claimed too:
        a live child's client claims its session within a second of the fork
        (its background thread does, at once), so one still unclaimed after
        the claim window is a child that died, or was paused, like a session
        that lapsed."""
        grace = self.limits.lapse_grace
        return self.clock() + grace if grace else None

    def reap(self) -> list[str]:
        """End sessions whose process died or that missed heartbeats."""
        dead = self.sessions.dead()
        for s, known in dead:
            if s.exiting:  # a clean exit, not a crash: nothing to alert on
                self._count("sessions_exited")
            else:
                log.info(
                    "session %s (pid %s) %s; reclaiming",
                    s.id[:8],
                    s.pid,
                    "is gone" if known else "missed its heartbeats",
                )
                self._count("sessions_reaped")
            self.end_session(s, verified=known)
        return [s.id for s, _ in dead]

    def expire(self) -> list[str]:
        """Delete names past their ttl, and reclaim writes past --alloc-ttl."""
        now = self.clock()
        gone = [
            n for n, e in self.entries.items() if e.expires_at is not None and e.expires_at <= now
        ]
        for n in gone:
            self.delete(n)
            self._count("expired")
        if self.limits.alloc_ttl:
            for s in self.sessions.values():
                if s.own:
                    continue  # the broker's own writes (a pull, a DoPut) end with their work
                for v in [v for v in s.writing if v.deadline is not None and v.deadline <= now]:
                    # The writer is alive and may still be copying into it.
                    self.memory.doubt(s, v, self.lending.of(s))
                    self.abandon(v)
                    self._count("allocs_expired")
        self.memory.expire_lapsed(now)
        return gone

    def view(self, v: Version, *, writable: bool = False) -> Any:
        """The bytes of ``v`` as a flat uint8 numpy array over the broker's own
        mapping: the Flight service streams them, the peers fill replicas."""
        return self.memory.view(v, writable=writable)

    # -- reading: Reads (_reads) answers ----------------------------------------
    def release(
        self,
        sid: str | None,
        caller: Caller,
        lease_ids: list[int],
        requests: list[str] | None = None,
    ) -> int:
        """Release this session's leases (others' ids are ignored), and cancel
        requests whose answers the client never read."""
        s = self.sessions.get(sid or "")
        if s is None:
            # Leases of an ended session are gone already; if it lapsed, their
            # memory is retired, and a client that has not yet noticed the
            # lapse tells of its dropped views under the old id: as stale.
            return self.memory.release_stale(caller, {sid: lease_ids}) if sid else 0
        why = self.sessions.foreign(s, caller)
        if why is not None:  # only the session that took a lease may release it
            raise Forbidden(why)
        n = self.lending.release_ids(s, lease_ids)
        for rid in requests or ():
            s.cancel(rid)
            fut = s.waits.get(rid)
            if fut is not None and not fut.done():
                fut.set_result(None)
            n += self.lending.release_ids(s, s.by_request.get(rid, ()))
            # An allocation whose answer the client never read: it cannot be
            # writing into it, and nobody else can publish it.
            for v in [v for v in s.writing if v.request == rid]:
                self.abandon(v)
        return n

    def was_cancelled(self, sid: str, rid: str) -> bool:
        """Whether the client cancelled request ``rid`` of session ``sid``
        before it arrived (``release``): then it must not run."""
        s = self.sessions.get(sid)
        return s is not None and rid in s.cancelled

    def release_stale(self, caller: Caller, stale: dict[str, list[int]]) -> int:
        """A client whose session lapsed (it was paused past its TTL) says the
        views of these leases of that old session are gone: their memory,
        retired when the session lapsed, may be reused."""
        return self.memory.release_stale(caller, stale)

    # -- names ---------------------------------------------------------------
    def delete(self, name: str, caller: Caller = LOCAL) -> None:
        self.delete_many([name], caller)

    def delete_many(self, names: Sequence[str], caller: Caller = LOCAL) -> list[str]:
        """Every name of ``names`` deleted, or (one missing) none; the names."""
        if self.closing:
            raise BrokerUnavailable("the broker is shutting down")
        if len(set(names)) != len(names):
            raise InvalidRequest("a batch deletes each name once")
        missing = [n for n in names if n not in self.entries]
        if missing:
            known = self.records.known(caller.prefix)
            if len(names) == 1:
                raise TensorNotFound(f"tensor {names[0]!r} not found ({known}); nothing to delete")
            shown = ", ".join(map(repr, missing[:10])) + ", ..." * (len(missing) > 10)
            raise TensorNotFound(
                f"{len(missing)} of the {len(names)} names are not found: "
                f"{shown} ({known}); nothing was deleted"
            )
        for n in names:
            e = self.entries[n]
            self.records.drop(e)
            if e.pack is not None:  # a row of a pack: retired as one (no Version made)
                self.memory.retire_rows([(e.pack, e.index)])
                e.pack = None
            elif e._ready is not None:
                self.memory.retire(e._ready)
            # A version being written under a hold (empty()) is reclaimed now:
            # the hold keeps its memory while the writer's views live, and a
            # publish finds it gone.  One a put still copies into, with no
            # hold, stays reserved until its writer publishes (then a 404) or
            # its session ends: freed now, a new tensor could land under the copy.
            for v in list(e.writing.values()):
                if v.readers:
                    self.abandon(v)
        self._count("deletes", len(names))
        return list(names)

    def delete_prefix(self, prefix: str, caller: Caller = LOCAL) -> list[str]:
        """Every name that starts with ``prefix`` deleted (none may match): the names."""
        return self.delete_many(sorted(n for n in self.entries if n.startswith(prefix)), caller)

    def _evict(self, nbytes: int, identity: str | None) -> int:
        """Replicas that no lease holds are a cache: drop the least recently
        checked first (of those charged to ``identity``, if given) until
        ``nbytes`` came back; the bytes dropped.  A get pulls them again."""
        cached = [
            v
            for e in self.entries.values()
            if (v := e._ready) is not None  # a replica is a Version, never a pack's row
            and v.replica is not None
            and not e.writing
            and v.readers == 0
            and (identity is None or v.identity == identity)
        ]
        cached.sort(key=lambda v: v.replica.checked_at if v.replica else 0.0)
        freed = 0
        for v in cached:
            if freed >= nbytes:
                break
            freed += v.nbytes
            self.delete(v.name)
            self._count("replicas_evicted")
        return freed

    def list(self, prefix: str = "") -> list[TensorInfo]:
        return self.records.list(prefix, self.lending.row_readers())

    def stat(self) -> Stat:
        pool = self.pool
        return Stat(
            bytes_in_use=self.memory.bytes_in_use,
            bytes_reserved=pool.reserved,
            bytes_retired=pool.retired,
            retired_total=pool.retired_total,
            max_memory=pool.max_memory,
            tensors=self.records.tensors(),
            versions=self.memory.versions_live,
            leases=len(self.leases),
            sessions=len(self.sessions),
            segments=pool.segments,
            waiting=self.waits.waiting,
            devices=self.cuda.stat(),
        )

    def who(self, identity: str | None, may_use: Callable[[str], bool]) -> builtins.list[Holder]:
        """Each client session (of ``identity``; None: every one) and what its
        leases hold, of the names ``may_use`` lets the caller see."""
        out = []
        for s in self.sessions.values():
            if s.own or (identity is not None and s.owner != identity):
                continue
            held: dict[str, dict[int, list[int]]] = {}  # name -> version -> [leases, nbytes]
            for lid in s.leases:
                lease = self.leases[lid]
                p = lease.pack
                facts = (
                    [(v.name, v.number, v.nbytes) for v in lease.versions]
                    if p is None
                    else [(p.names[i], p.numbers[i], p.items[i][3]) for i in lease.rows]
                )
                for name, number, nbytes in facts:
                    if may_use(name):
                        per = held.setdefault(name, {}).setdefault(number, [0, nbytes])
                        per[0] += 1
            names = [
                HeldName(
                    name=n,
                    versions=sorted(vs),
                    leases=sum(c for c, _ in vs.values()),
                    nbytes=sum(b for _, b in vs.values()),
                )
                for n, vs in sorted(held.items())
            ]
            out.append(
                Holder(
                    session=s.id[:8],
                    pid=s.pid,
                    label=s.label,
                    identity=s.owner,
                    leases=sum(h.leases for h in names),
                    nbytes=sum(h.nbytes for h in names),
                    writing=len(s.writing),
                    exiting=s.exiting,
                    names=names,
                )
            )
        return sorted(out, key=lambda h: (h.pid or 0, h.session))

    # -- shutdown ------------------------------------------------------------
    def begin_shutdown(self) -> None:
        """Refuse new work and wake every waiting get with 503."""
        self.closing = True
        self.waits.stop_all()

    def close(self) -> None:
        self.closing = True
        self.memory.close()
        self.records.close()
        log.info("unlinked all shared memory (pid %d)", os.getpid())


__all__ = ["Broker"]
