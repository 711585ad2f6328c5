"""Sessions: who a client is, whether it is still alive, and what it may touch.

A session belongs to the identity that opened it (the SO_PEERCRED uid on a
unix socket, the token on TCP): only that identity may use, heartbeat,
fork, claim or close it.  On a unix socket it is also bound to the process
that opened it (the pid SO_PEERCRED reports), or to the forked child that
claimed it: a request under it from any other process is refused (403),
whatever its uid, since another process's release or close would free
memory that the owner's live views still map (``foreign`` says why).
Liveness is checked in one of two ways:

* **tracked**: the broker itself knows the pid (SO_PEERCRED) and its start
  time, and the session ends when that process is gone.  Nothing the client
  says about its pid is trusted;
* **heartbeat**: the session ends when the client has not been heard from for
  ``session_ttl`` seconds.  Such a session is *unverifiable*: the process may
  be paused, not dead, and may still map what it was given.  Its memory is
  therefore retired, never reused (README, Lifetime: M1);
* **the broker's own** (``own``): work the broker itself drives, a Flight
  stream or a pull.  It never lapses: the broker ends it when that work ends.

Everything here runs on the event loop thread.
"""

from __future__ import annotations

import builtins
import secrets
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..._errors import (
    BrokerUnavailable,
    Cancelled,
    Conflict,
    Forbidden,
    InvalidRequest,
    LimitExceeded,
    UnknownSession,
)
from ..._proto import REQUEST_CACHE, proc_stat

if TYPE_CHECKING:
    import asyncio

    from ._records import Version


@dataclass(frozen=True)
class Caller:
    """Who sent a request: a stable identity, the pid the kernel vouches for,
    and the prefix of the names it may use (its token's; None: every name),
    so that what the broker tells it names nothing else."""

    identity: str
    peer_pid: int | None = None  # SO_PEERCRED on a unix socket; never a claimed pid
    prefix: str | None = None

    @property
    def peer(self) -> str:
        """What the per-peer session limit counts: the process, else the identity."""
        return f"pid:{self.peer_pid}" if self.peer_pid else self.identity


LOCAL = Caller("broker")  # the broker's own sessions (tests, internal work)


@dataclass(eq=False)
class Session:
    id: str
    owner: str  # Caller.identity of whoever opened it
    peer: str
    pid: int | None
    start_time: int | None
    tracked: bool
    label: str | None
    last_seen: float
    ttl: float  # heartbeat sessions end after this long unheard
    claimed: bool = True  # False for a forked child's session until the child claims it
    own: bool = False  # the broker's own work: ended by the broker, never lapses
    exiting: bool = False  # its process said it is exiting, views alive: ends once it is gone
    bound: int | None = None  # the only pid that may use it (SO_PEERCRED; None: any, e.g. TCP)
    forker: int | None = None  # an unclaimed fork's: the pid whose child alone may claim it
    leases: set[int] = field(default_factory=set)
    writing: set[Version] = field(default_factory=set)
    bytes: int = 0  # bytes of versions it allocated that are still alive (quota)
    pinned: int = 0  # of those, bytes of versions it only reads, whose names moved on
    # Idempotency: answers to recent request ids, and gets still waiting.
    # (the field ``bytes`` above shadows the builtin inside this class body)
    answers: OrderedDict[str, tuple[int, builtins.bytes]] = field(default_factory=OrderedDict)
    running: dict[str, asyncio.Future[None]] = field(default_factory=dict)
    by_request: dict[str, set[int]] = field(default_factory=dict)  # request id -> leases
    waits: dict[str, asyncio.Future[None]] = field(default_factory=dict)  # request id -> cancel
    # Request ids the client cancelled (the last REQUEST_CACHE): one that
    # arrives after its cancel (it came by another door, or waited in a
    # lane's ring) is refused, never run.
    cancelled: OrderedDict[str, None] = field(default_factory=OrderedDict)

    def remember(self, rid: str, status: int, body: builtins.bytes) -> None:
        self.answers[rid] = (status, body)
        while len(self.answers) > REQUEST_CACHE:
            self.answers.popitem(last=False)

    def cancel(self, rid: str) -> None:
        self.cancelled[rid] = None
        while len(self.cancelled) > REQUEST_CACHE:
            self.cancelled.popitem(last=False)


def _parent_of(pid: int, proc: str) -> int | None:
    """The parent pid of ``pid`` (field 4 of ``/proc/<pid>/stat``), or None if gone."""
    try:
        with open(f"{proc}/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return None
    try:
        return int(data[data.rfind(b")") + 2 :].split()[1])
    except (IndexError, ValueError):
        return None


class Sessions:
    """The table of sessions, with the limits that keep it bounded."""

    def __init__(
        self,
        *,
        session_ttl: float,
        claim_window: float,
        max_sessions: int,
        max_per_peer: int,
        clock: Callable[[], float],
        proc: str = "/proc",
    ) -> None:
        self.session_ttl = session_ttl
        self.claim_window = claim_window
        self.max_sessions = max_sessions
        self.max_per_peer = max_per_peer
        self.clock = clock
        self.proc = proc
        self.table: dict[str, Session] = {}
        self._per_peer: dict[str, int] = {}
        self.closing = False  # the broker is shutting down: no session starts new work

    def __len__(self) -> int:
        return len(self.table)

    def __iter__(self) -> Iterator[str]:
        return iter(list(self.table))

    def __contains__(self, sid: object) -> bool:
        return sid in self.table

    def __getitem__(self, sid: str) -> Session:
        return self.table[sid]

    def values(self) -> list[Session]:
        return list(self.table.values())

    def get(self, sid: str) -> Session | None:
        return self.table.get(sid)

    def open(
        self, caller: Caller, *, label: str | None, claimed: bool = True, own: bool = False
    ) -> Session:
        if len(self.table) >= self.max_sessions:
            raise LimitExceeded(
                f"the broker holds {len(self.table)} sessions, its limit (--max-sessions); "
                f"close clients you no longer use"
            )
        if (
            caller.identity != LOCAL.identity
            and self._per_peer.get(caller.peer, 0) >= self.max_per_peer
        ):
            raise LimitExceeded(
                f"{caller.peer} already holds {self.max_per_peer} sessions "
                "(--max-sessions-per-peer); share one Client per process instead of opening one "
                "per call"
            )
        pid, start, tracked = None, None, False
        if claimed and caller.peer_pid:
            # SO_PEERCRED is the kernel's word for who is on the other end of
            # the unix socket; a pid a client merely claims is never trusted.
            ident = proc_stat(caller.peer_pid, self.proc)
            if ident is not None:
                pid, start, tracked = caller.peer_pid, ident[0], True
        ttl = self.session_ttl if claimed else self.claim_window
        s = Session(
            secrets.token_hex(16),
            caller.identity,
            caller.peer,
            pid,
            start,
            tracked,
            label,
            self.clock(),
            ttl,
            claimed=claimed,
            own=own,
        )
        if claimed:
            s.bound = caller.peer_pid or None
        else:
            s.forker = caller.peer_pid or None
        self.table[s.id] = s
        self._per_peer[caller.peer] = self._per_peer.get(caller.peer, 0) + 1
        return s

    def claim(self, s: Session, caller: Caller) -> None:
        """A forked child takes over the session its parent made for it."""
        if s.claimed:
            raise Conflict(f"session {s.id[:8]}... was claimed already")
        if s.forker and (not caller.peer_pid or _parent_of(caller.peer_pid, self.proc) != s.forker):
            raise Forbidden(
                f"session {s.id[:8]}... was made for a child of pid {s.forker}, and pid "
                f"{caller.peer_pid or '(unknown)'} is not one; a process opens its own session "
                f"(POST /v1/sessions)"
            )
        self._per_peer[s.peer] -= 1
        s.claimed, s.peer, s.ttl = True, caller.peer, self.session_ttl
        self._per_peer[s.peer] = self._per_peer.get(s.peer, 0) + 1
        s.bound, s.forker = caller.peer_pid or None, None
        if caller.peer_pid:
            ident = proc_stat(caller.peer_pid, self.proc)
            if ident is not None:
                s.pid, s.start_time, s.tracked = caller.peer_pid, ident[0], True

    def use(self, sid: str | None, caller: Caller) -> Session:
        """The session ``sid`` if ``caller`` owns it; refreshes its heartbeat."""
        if not sid:
            raise InvalidRequest(
                "this call needs a session: send the x-tensordepot-session header "
                "(POST /v1/sessions opens one; the Python Client does this for you)"
            )
        s = self.table.get(sid)
        if s is None:
            raise UnknownSession(
                f"session {sid[:8]}... is unknown: it ended (process exit, missed heartbeats) "
                f"or the broker restarted; open a new one"
            )
        why = self.foreign(s, caller)
        if why is not None:
            raise Forbidden(why)
        s.last_seen = self.clock()
        return s

    def owned_by(self, sid: str | None, caller: Caller) -> Session | None:
        """Session ``sid`` if it exists and ``caller`` may act under it; else None."""
        s = self.table.get(sid) if sid else None
        return s if s is not None and self.foreign(s, caller) is None else None

    @staticmethod
    def foreign(s: Session, caller: Caller) -> str | None:
        """Why ``caller`` may not act under ``s`` (None: it may): the one
        ownership rule, for every route, rider and replayed answer."""
        if s.owner != caller.identity:
            return (
                f"session {s.id[:8]}... belongs to another client; use the session your "
                f"own POST /v1/sessions returned"
            )
        if s.bound and caller.peer_pid != s.bound:
            return (
                f"session {s.id[:8]}... belongs to pid {s.bound}, not to "
                f"{f'pid {caller.peer_pid}' if caller.peer_pid else 'this connection'}: "
                f"each process opens its own session (the Python Client does; a forked "
                f"child claims the one its parent made for it)"
            )
        return None

    def admit(self, sid: str | None, caller: Caller) -> Session:
        """``use``, for new work: refused while the broker shuts down."""
        if self.closing:
            raise BrokerUnavailable("the broker is shutting down; retry against the new broker")
        return self.use(sid, caller)

    def resumed(self, s: Session, sid: str | None, caller: Caller, request: str | None) -> None:
        """After a request that takes memory or leases awaited (an
        allocation's new segments, a get's wait for a publish or the peers):
        raises if its session ended meanwhile, or the broker is shutting
        down, or the client cancelled ``request`` meanwhile (the cancel found
        nothing to give back yet, so nothing may be granted after it: nobody
        would read the answer, write into the allocation or release the
        lease before the session ends)."""
        if self.closing or self.get(s.id) is not s:
            self.admit(sid, caller)  # raises the reason
        if request is not None and request in s.cancelled:
            raise Cancelled("the client cancelled this request while the broker waited for it")

    def remove(self, s: Session) -> None:
        if self.table.pop(s.id, None) is None:
            return
        left = self._per_peer[s.peer] - 1
        if left:
            self._per_peer[s.peer] = left
        else:
            del self._per_peer[s.peer]

    def dead(self) -> list[tuple[Session, bool]]:
        """Sessions to end now, each with whether the broker *knows* its process
        is gone (True) or only stopped hearing from it (False)."""
        now = self.clock()
        out: list[tuple[Session, bool]] = []
        alive: dict[int, Any] = {}  # one /proc read per pid, however many sessions it has
        for s in self.table.values():
            if s.tracked and s.pid:
                if s.pid not in alive:
                    alive[s.pid] = proc_stat(s.pid, self.proc)
                ident = alive[s.pid]
                if ident is None or ident[0] != s.start_time or ident[1] in ("Z", "X"):
                    out.append((s, True))
            elif not s.own and now - s.last_seen > s.ttl:
                out.append((s, False))
        return out
