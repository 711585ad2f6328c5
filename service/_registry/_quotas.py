"""Limits and quotas: what one session, or one identity, may hold.

``Limits`` is every bound the broker's state keeps (sessions, unpublished
allocations, memory per session and per identity).  ``Quotas`` counts the
bytes of every live version against the session and the identity that made
it (by ``put``, ``empty``, a batch, a Flight ``DoPut``, or ``link``: an
alias is charged to whoever links it, as a copy would be, so no bytes are
ever held uncharged), refuses past either limit with 507, and gives the
bytes back when the version's memory is freed.  Nothing is evicted to make
room.

The API, for every door that places versions::

    with quotas.charge(session, nbytes, name) as charge:  # checks and takes, at once
        ...                                               # awaits may follow: the bytes are held
        charge.attach(versions)                           # the versions carry them from now on
    # leaving the block gives back whatever no version carries (a failure, a cancel)

and ``Quotas.uncharge(version)`` when its memory is freed (``Memory``).
Checking and taking is one step, before any await, so concurrent requests
can never together pass a limit that each alone fits.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..._errors import OutOfMemory

if TYPE_CHECKING:
    from ._records import Version
    from ._sessions import Session, Sessions


@dataclass(frozen=True)
class Limits:
    """What keeps the broker's state bounded by live work (README, Limits)."""

    session_ttl: float = 15.0  # heartbeat sessions end after this long unheard
    claim_window: float = 10.0  # a forked child's session must be claimed within this
    alloc_ttl: float = 600.0  # unpublished allocations expire after this (0: never)
    lapse_grace: float = 60.0  # a lapsed session's memory comes back after this (0: never)
    max_sessions: int = 16384
    max_sessions_per_peer: int = 256
    max_leases_per_session: int = 65536
    max_memory_per_session: int = 0  # 0: no limit beyond --max-memory
    max_memory_per_identity: int = 0


class Quotas:
    """Bytes charged to each session and identity."""

    def __init__(self, limits: Limits, sessions: Sessions, count: Callable[[str], None]) -> None:
        self.limits = limits
        self.sessions = sessions
        self._count = count
        self._identity_bytes: dict[str, int] = {}
        self._identity_pinned: dict[str, int] = {}  # of those, pins (repin)
        # Drops an identity's replicas that no lease holds (a cache) for room:
        # (bytes wanted, identity) -> bytes dropped.  Set by the broker.
        self.evict: Callable[[int, str | None], int] | None = None

    def charge(self, s: Session, nbytes: int, name: str) -> Charge:
        """Take ``nbytes`` from ``s``'s and its identity's quotas now, or refuse
        (OutOfMemory) and take nothing.  Use the answer as a context manager:
        what no version carries when it ends is given back."""
        lim = self.limits
        if lim.max_memory_per_session and s.bytes + nbytes > lim.max_memory_per_session:
            self._count("quota_refusals")
            raise OutOfMemory(
                f"cannot place {name!r} ({nbytes} bytes): this session already holds {s.bytes} "
                f"bytes and --max-memory-per-session is {lim.max_memory_per_session}; delete "
                f"tensors or publish what you are writing"
            )
        held = self._identity_bytes.get(s.owner, 0)
        if (
            lim.max_memory_per_identity
            and held + nbytes > lim.max_memory_per_identity
            and self.evict is not None
            and self.evict(held + nbytes - lim.max_memory_per_identity, s.owner)
        ):
            held = self._identity_bytes.get(s.owner, 0)  # its cached replicas made room
        if lim.max_memory_per_identity and held + nbytes > lim.max_memory_per_identity:
            self._count("quota_refusals")
            raise OutOfMemory(
                f"cannot place {name!r} ({nbytes} bytes): {s.owner} already holds {held} bytes "
                f"and --max-memory-per-token is {lim.max_memory_per_identity}; delete tensors"
            )
        s.bytes += nbytes
        self._identity_bytes[s.owner] = held + nbytes
        return Charge(self, s.id, s.owner, nbytes)

    def check_reader(self, s: Session, name: str) -> None:
        """A reader may take a new lease while the versions it pins (read,
        then superseded or deleted: ``repin``) leave room in its quotas;
        once they fill one, its gets are refused (OutOfMemory) until it lets
        some go.  Its own puts never count here: a writer at its quota still
        reads."""
        lim = self.limits
        if lim.max_memory_per_session and s.pinned >= lim.max_memory_per_session:
            held, limit, flag = s.pinned, lim.max_memory_per_session, "--max-memory-per-session"
        elif (
            lim.max_memory_per_identity
            and self._identity_pinned.get(s.owner, 0) >= lim.max_memory_per_identity
        ):
            held, limit = self._identity_pinned[s.owner], lim.max_memory_per_identity
            flag = "--max-memory-per-token"
        else:
            return
        self._count("quota_refusals")
        raise OutOfMemory(
            f"cannot get {name!r}: versions you read that have since been replaced or deleted "
            f"hold {held} bytes, and {flag} is {limit}; release the tensors you no longer "
            f"read (drop their views, or t.release())"
        )

    def _give(self, sid: str, identity: str, nbytes: int) -> None:
        """Bytes no longer held: off the session (if it still lives) and the identity."""
        if not nbytes:
            return
        s = self.sessions.get(sid)
        if s is not None:
            s.bytes -= nbytes
        _less(self._identity_bytes, identity, nbytes)

    def repin(self, v: Version, holder: Session) -> None:
        """``v`` is no longer its name's, and a reader's lease (``holder``'s)
        keeps it alive: its bytes now count against the reader, so that a
        reader cannot lock a producer out of its quota."""
        if v.charged and v.creator != holder.id:
            n = v.charged  # already held: moved, never refused (check_reader refuses gets)
            self.uncharge(v)
            holder.bytes += n
            holder.pinned += n
            self._identity_bytes[holder.owner] = self._identity_bytes.get(holder.owner, 0) + n
            self._identity_pinned[holder.owner] = self._identity_pinned.get(holder.owner, 0) + n
            v.charged, v.creator, v.identity, v.pinned = n, holder.id, holder.owner, True

    def uncharge(self, v: Version) -> None:
        """``v``'s memory was freed: the bytes it carries no longer count."""
        self.uncharge_many([v])

    def uncharge_many(self, versions: list[Version]) -> None:
        """``uncharge`` of each (a pack's versions are freed together): their
        bytes given back once per session and identity."""
        given: dict[tuple[str, str], int] = {}
        creator, identity, n = "", "", 0  # the holder of a run of versions: a pack's one
        for v in versions:
            if v.charged and v.identity is not None:
                if v.pinned:
                    s = self.sessions.get(v.creator or "")
                    if s is not None:
                        s.pinned -= v.charged
                    _less(self._identity_pinned, v.identity, v.charged)
                if v.identity != identity or (v.creator or "") != creator:
                    if n:
                        given[creator, identity] = given.get((creator, identity), 0) + n
                    creator, identity, n = v.creator or "", v.identity, 0
                n += v.charged
            v.charged, v.pinned = 0, False
        if n:
            given[creator, identity] = given.get((creator, identity), 0) + n
        for (sid, holder), nbytes in given.items():
            self._give(sid, holder, nbytes)


def _less(table: dict[str, int], identity: str, nbytes: int) -> None:
    """``nbytes`` off ``identity``'s count in ``table``, forgotten at zero."""
    left = table.get(identity, 0) - nbytes
    if left > 0:
        table[identity] = left
    else:
        table.pop(identity, None)


class Charge:
    """Bytes taken from a session's and an identity's quotas (``Quotas.charge``)
    that no version carries yet."""

    def __init__(self, quotas: Quotas, session: str, identity: str, nbytes: int) -> None:
        self._quotas = quotas
        self.session = session
        self.identity = identity
        self.left = nbytes

    def attach(self, versions: list[Version]) -> None:
        """Each of ``versions`` carries its bytes of this charge until its
        memory is freed."""
        need = sum(v.nbytes for v in versions)
        assert need <= self.left, f"{len(versions)} versions need {need} bytes of {self.left}"
        self.left -= need
        session, identity = self.session, self.identity
        for v in versions:
            v.charged, v.creator, v.identity = v.nbytes, session, identity

    def give_back(self) -> None:
        """Return what no version carries (idempotent)."""
        n, self.left = self.left, 0
        self._quotas._give(self.session, self.identity, n)

    def __enter__(self) -> Charge:
        return self

    def __exit__(self, *exc: object) -> None:
        self.give_back()
