"""Limits and quotas: what one session, or one identity, may hold.

``Limits`` is every bound the broker's state keeps (sessions, unpublished
allocations, memory per session and per identity); ``Quotas`` charges a
version's bytes to the session and the identity that created it, refuses an
allocation past either limit with 507, and gives the bytes back when the
version's memory is freed.  Nothing is evicted to make room.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .._errors import OutOfMemory

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
    max_memory_per_session: int = 0  # 0: no limit beyond --max-memory
    max_memory_per_identity: int = 0


class Quotas:
    """Bytes charged to each session and identity."""

    def __init__(self, limits: Limits, sessions: Sessions,
                 count: Callable[[str], None]) -> None:
        self.limits = limits
        self.sessions = sessions
        self._count = count
        self._identity_bytes: dict[str, int] = {}

    def charge(self, s: Session, nbytes: int, name: str) -> None:
        """Refuse ``nbytes`` more for ``s`` past a limit (OutOfMemory); charges nothing yet."""
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

    def record(self, s: Session, v: Version) -> None:
        """``v`` was placed: its bytes count against ``s`` and its owner."""
        v.charged, v.creator, v.identity = v.nbytes, s.id, s.owner
        s.bytes += v.charged
        self._identity_bytes[s.owner] = self._identity_bytes.get(s.owner, 0) + v.charged

    def repin(self, v: Version, holder: Session) -> None:
        """``v`` is no longer its name's, and a reader's lease (``holder``'s)
        keeps it alive: its bytes now count against the reader, so that a
        reader cannot lock a producer out of its quota."""
        if v.charged and v.creator != holder.id:
            self.uncharge(v)
            self.record(holder, v)

    def uncharge(self, v: Version) -> None:
        """``v``'s memory was freed: its bytes no longer count."""
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
