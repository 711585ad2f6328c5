"""Records: names, their versions, and the leases that hold versions.

The data types every other part of the broker speaks of (``Version``,
``Entry``, ``Lease``, ``Replica``), and ``Records``, the table of names.
A name holds versions: ``writing`` ones, owned by the session that
allocated them, and at most one ``ready`` one, the newest published.

This module keeps one of the broker's invariants (``_broker`` lists them
all): **versions of a name only grow**, across delete, abort, reclaim and
expiry.  ``Records.entry`` starts a new incarnation of a name above every
number a dropped name ever had, and ``Records.drop`` raises that floor, so
the broker remembers one number instead of every dropped name.

It imports no other module of the broker: everything else builds on it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol

from ..._errors import InvalidRequest, TensorNotFound, WaitTimedOut
from ..._wire import TensorInfo
from ...shm import UnsupportedDType, dtype_from_name

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    from ...shm._pool import Block

MAX_NBYTES = 1 << 62
CPU = ("cpu", "cpu:0")  # how a request names host memory

Checked = tuple[tuple[int, ...], str, int, int]  # (shape, dtype name, item size, bytes)


@dataclass(eq=False)
class Replica:
    """Where a version pulled from a peer came from (set by service/_hosts/_peers.py)."""

    peer: str  # the peer's Flight URL it was copied from
    origin: str  # Flight URL of the broker that published it
    instance: str  # that broker's id for its run: version numbers restart with a broker
    version: int  # its version there
    checked_at: float  # when a peer last confirmed it is the newest (broker clock)


class PeerHook(Protocol):
    """Pull-through from brokers on other hosts (service/_hosts/_peers.py)."""

    poll_interval: float  # how often a waiting get asks the peers again

    async def before_get(self, name: str, newer_than: int, can_wait: bool, caller: Any) -> None:
        """A get missed, or hit a replica: publish a newer replica of ``name``
        if a peer has one, or raise.  ``caller``: who asked (a
        ``_sessions.Caller``, which imports this module); a pull is charged
        to them."""

    def explain(self, name: str) -> str:
        """What the peers said about ``name``, for a not-found message."""


@dataclass(eq=False, slots=True)
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
    pinned: bool = False  # charged to a reader whose lease keeps it (Quotas.repin)
    deadline: float | None = None  # unpublished past this: reclaimed (--alloc-ttl)
    request: str | None = None  # the request id that allocated it, so the client can cancel it
    replica: Replica | None = None  # pulled from a peer
    reader: int = 0  # the id of the last get's lease of it (writers' holds excluded)
    got: int = 0  # live leases of gets (writers' holds excluded)
    wire: tuple[bytes, bytes] | None = None  # its published handle's JSON around the lease (lane)
    nbytes: int = 0  # its bytes, from ``at`` in its block
    at: int = 0  # where its bytes start in its block: a batch's pack holds many versions

    @property
    def offset(self) -> int:
        """Where its bytes start in its segment."""
        return self.block.offset + self.at


@dataclass(eq=False, slots=True)
class Entry:
    name: str
    ready: Version | None = None
    writing: dict[int, Version] = field(default_factory=dict)
    next_version: int = 1
    expires_at: float | None = None
    readers: int = 0  # live leases on any version of this incarnation (writers' holds excluded)


@dataclass(eq=False, slots=True)
class Lease:
    id: int
    session: str
    # What it holds: one version, or several of one pack that a get_many
    # found together (``Leases.take_many``): one lease keeps the pack.
    versions: tuple[Version, ...]
    request: str | None = None  # the request id that took it, so the client can cancel it
    hold: bool = False  # the writer's own (alloc with hold, or its copy in a forked child)
    doubt: bool = False  # its block was distrusted while it lived: trusted again when it ends


def check_item(dtype: str, dims: list[int]) -> Checked:
    """(shape, dtype name, item size, bytes) of an allocation; raises InvalidRequest."""
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
            f"shape {list(shape)} of {dt.name} is {nbytes} bytes, which overflows; check the shape"
        )
    return shape, dt.name, dt.itemsize, nbytes


class Records:
    """Every name the broker knows, each with its versions."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock = clock
        self.entries: dict[str, Entry] = {}
        # Versions of every name start above every number any dropped name
        # ever had, so versions only grow without remembering dropped names.
        self._version_floor = 0

    # -- versions only grow ---------------------------------------------------
    def entry(self, name: str) -> Entry:
        """The name's incarnation, a new one numbered above every dropped name."""
        e = self.entries.get(name)
        if e is None:
            e = self.entries[name] = Entry(name, next_version=self._version_floor + 1)
        return e

    def drop(self, e: Entry) -> None:
        """Forget a name; the floor keeps its numbers from coming back."""
        if self.entries.get(e.name) is e:
            del self.entries[e.name]
            self._version_floor = max(self._version_floor, e.next_version - 1)

    # -- reading -------------------------------------------------------------
    def ready(self, name: str, newer_than: int) -> Version | None:
        e = self.entries.get(name)
        if e is None or e.ready is None or e.ready.number <= newer_than:
            return None
        return e.ready

    def info(self, e: Entry, v: Version) -> TensorInfo:
        expires = None if e.expires_at is None else max(0.0, e.expires_at - self.clock())
        r = v.replica
        return TensorInfo(
            name=e.name,
            version=v.number,
            shape=list(v.shape),
            dtype=v.dtype,
            nbytes=v.nbytes,
            device=v.block.device,
            state=v.state,
            readers=e.readers,
            expires_in=expires,
            origin=r.origin if r else None,
            origin_version=r.version if r else None,
        )

    def list(self, prefix: str = "") -> list[TensorInfo]:
        out = []
        for name in sorted(n for n in self.entries if n.startswith(prefix)):
            e = self.entries[name]
            v = (
                e.ready
                if e.ready is not None
                else max(e.writing.values(), key=lambda x: x.number, default=None)
            )
            # pulls in flight
            if v is not None and not (v.state == "writing" and v.replica is not None):
                out.append(self.info(e, v))
        return out

    def tensors(self) -> int:
        return sum(1 for e in self.entries.values() if e.ready is not None)

    # -- what a miss says ------------------------------------------------------
    def known(self, prefix: str | None = None) -> str:
        """The published names, those starting with ``prefix`` only: a message
        names nothing its caller may not use."""
        names = sorted(
            n
            for n, e in self.entries.items()
            if e.ready is not None and (prefix is None or n.startswith(prefix))
        )
        if not names:
            return (
                "no tensors are published"
                if prefix is None
                else f"no tensors starting with {prefix!r} are published"
            )
        shown = ", ".join(names[:10]) + (f", ... ({len(names)} in all)" if len(names) > 10 else "")
        return f"known: {shown}"

    def not_found(
        self, name: str, hook: PeerHook | None, newer_than: int = 0, prefix: str | None = None
    ) -> TensorNotFound:
        e = self.entries.get(name)
        if newer_than and e is not None and e.ready is not None:
            return TensorNotFound(
                f"no version of {name!r} newer than v{newer_than} exists yet (the newest is "
                f"v{e.ready.number}); pass timeout= to wait for one"
            )
        peers = "" if hook is None else hook.explain(name)
        return TensorNotFound(
            f"tensor {name!r} not found ({self.known(prefix)}){peers}; did the producer publish "
            f"it? pass timeout= to wait for it"
        )

    def batch_missed(
        self,
        names: Sequence[str],
        floors: Sequence[int],
        timeout: float | None,
        waited: bool,
        hook: PeerHook | None,
        prefix: str | None = None,
        any_of: bool = False,
    ) -> TensorNotFound:
        """What a batch get that misses says: every name of it without the
        version it asks for (``waited``: after its wait; ``any_of``: none of them
        had one, for ``wait="any"``)."""
        miss = [(n, f) for n, f in zip(names, floors, strict=True) if self.ready(n, f) is None]
        if len(miss) == 1 and not any_of:
            n, f = miss[0]
            return (
                self.timed_out(n, f, timeout, hook, prefix)
                if waited
                else self.not_found(n, hook, f, prefix)
            )
        parts = []
        for n, f in miss[:20]:
            e = self.entries.get(n)
            parts.append(
                f"{n!r} (not published)"
                if e is None or e.ready is None
                else f"{n!r} (v{e.ready.number}, not newer than v{f})"
            )
        shown = ", ".join(parts) + (f", ... ({len(miss)} in all)" if len(miss) > 20 else "")
        within = f" within {timeout:g} s" if waited and timeout is not None else ""
        what = (
            f"none of the {len(names)} tensors got a newer version{within}"
            if any_of
            else f"{len(miss)} of the {len(names)} tensors "
            f"{'were not published' + within if waited else 'are not ready'}"
        )
        if waited:
            return WaitTimedOut(f"{what}: {shown} ({self.known(prefix)})")
        return TensorNotFound(
            f"{what}: {shown} ({self.known(prefix)}); pass timeout= to wait for them"
        )

    def timed_out(
        self,
        name: str,
        newer_than: int,
        timeout: float | None,
        hook: PeerHook | None,
        prefix: str | None = None,
    ) -> WaitTimedOut:
        e = self.entries.get(name)
        within = f"within {timeout:g} s" if timeout is not None else "in time"
        if newer_than and e is not None and e.ready is not None:
            return WaitTimedOut(
                f"no version of {name!r} newer than v{newer_than} was published {within} "
                f"(the newest is v{e.ready.number})"
            )
        peers = "" if hook is None else hook.explain(name)
        return WaitTimedOut(
            f"tensor {name!r} was not published {within} ({self.known(prefix)}){peers}"
        )
