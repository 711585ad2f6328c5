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
from itertools import repeat
from operator import gt
from typing import TYPE_CHECKING, Any, Literal, Protocol

from ..._errors import InvalidRequest, TensorNotFound, WaitTimedOut
from ..._wire import TensorInfo
from ...shm import UnsupportedDType, dtype_from_name
from ...shm._board import Board

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable, Sequence

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


class Entry:
    """A name's incarnation.  Its newest ready tensor is a ``Version``, or a
    row of a put_many's ``Pack`` (``pack``, ``index``): a pack's names point
    at it without a ``Version`` each, and ``ready`` makes one the first time
    something needs it (a single get, a delete, a listing)."""

    __slots__ = (
        "_ready",
        "expires_at",
        "index",
        "name",
        "next_version",
        "pack",
        "readers",
        "slot",
        "writing",
    )

    def __init__(self, name: str, next_version: int = 1) -> None:
        self.name = name
        self._ready: Version | None = None
        self.pack: Pack | None = None  # the newest ready tensor is a row of it, not a Version
        self.index = 0  # its row in ``pack``
        self.writing: dict[int, Version] = {}
        self.next_version = next_version
        self.expires_at: float | None = None
        # Live leases on any Version of this incarnation (writers' holds
        # excluded); its pack rows' are counted when a list asks (Leases.row_readers).
        self.readers = 0
        self.slot = -1  # its slot on the board of newest versions (shm._board), if it has one

    @property
    def ready(self) -> Version | None:
        """The newest ready version (made from its pack's row if it is one)."""
        v = self._ready
        if v is None and self.pack is not None:
            v = self.pack.books.make(self.pack, self.index, True)
        return v

    @ready.setter
    def ready(self, v: Version) -> None:
        assert self.pack is None, "a pack's row is retired before its name moves on"
        self._ready = v

    def facts(self) -> Version | None:
        """The newest ready version, to read what it is: a pack's row as a
        ``Version`` no book counts (``Pack.describe``), none made."""
        p = self.pack
        return self._ready if p is None else p.describe(self.index)

    @property
    def published(self) -> bool:
        """Whether a ready version exists, without making one."""
        return self._ready is not None or self.pack is not None

    @property
    def number(self) -> int:
        """The newest ready version's number (0: none), without making one."""
        p = self.pack
        if p is not None:
            return p.numbers[self.index]
        v = self._ready
        return 0 if v is None else v.number


class Books(Protocol):
    """What a pack asks of the broker's memory (``_memory.Memory``)."""

    def make(self, pack: Pack, index: int, current: bool) -> Version:
        """The ``Version`` of a row: its name's (``current``), or one a lease
        of the pack keeps after its name moved on."""

    def free_if_unreachable(self, *versions: Version) -> None:
        """Free what nothing reaches (``Memory.free_if_unreachable``)."""


@dataclass(eq=False, slots=True)
class Pack:
    """A put_many's small host tensors in one block, back to back, published
    together: one record for them all (docs/plan-packs.md).  Each name's
    entry points at its row; a row gets a ``Version`` of its own only when
    something needs one (``Books.make``).  The pack holds one reference of
    its block (``held``) while a name points at a row of it (``live``) or a
    get_many's lease holds it (``readers``); a row no name points at any
    more, while leases hold the pack, is ``kept`` until they end.  Charged
    to its creator as one allocation until its block is freed.  ``names``,
    ``items`` and ``ats`` come from the request's plan and are shared by
    every pack of the same request: never changed, and named by ``key``
    (``_packs.plan``: no two row lists of a broker's run share one)."""

    block: Block
    names: list[str]
    numbers: list[int]
    items: list[Checked]  # per row: (shape, dtype name, item size, bytes)
    ats: list[int]  # per row: where its bytes start in the block
    layouts: tuple[list[tuple[tuple[int, ...], str, int]], list[int]]  # _packs.layouts
    entries: list[Entry]  # per row: the incarnation of the name it was written under
    ttl: float | None
    books: Books
    nbytes: int  # its rows' bytes
    live: int = 0
    readers: int = 0
    kept: list[int] = field(default_factory=list)
    kept_at: dict[str, int] | None = None  # name -> row of ``kept``, once looked up (Memory.kept)
    held: bool = True
    charged: int = 0  # what Quotas count (as for a Version)
    creator: str | None = None
    identity: str | None = None
    pinned: bool = False
    key: int = 0  # its names, items, ats and layouts (shared by the packs of one plan)
    slots: list[int] | None = None  # its entries' board slots, once an answer named them

    def describe(self, i: int) -> Version:
        """Row ``i`` as a ``Version`` no book counts: its facts, to read."""
        shape, dtype, itemsize, n = self.items[i]
        return Version(
            self.names[i],
            self.numbers[i],
            self.block,
            shape,
            dtype,
            itemsize,
            "ready",
            None,
            current=False,
            ttl=self.ttl,
            nbytes=n,
            at=self.ats[i],
        )


# A ready tensor as a get finds it: a ``Version``, or a pack's row.
Row = tuple[Pack, int]
Found = Version | Row


def name_of(f: Found) -> str:
    return f[0].names[f[1]] if isinstance(f, tuple) else f.name


def number_of(f: Found) -> int:
    return f[0].numbers[f[1]] if isinstance(f, tuple) else f.number


def nbytes_of(f: Found) -> int:
    return f[0].items[f[1]][3] if isinstance(f, tuple) else f.nbytes


class Whole(list):  # type: ignore[type-arg]  # list[Row]
    """Every row of one pack, in order, as the ``Found`` of each: a list
    that says so (``pack``), so that what takes a batch whole (its leases,
    its names and numbers, its bytes) need not look at each row."""

    __slots__ = ("pack",)

    pack: Pack


def whole(p: Pack) -> Whole:
    rows = Whole(zip(repeat(p), range(len(p.names))))
    rows.pack = p
    return rows


# The same, for a batch, in one loop each (a call per tensor is most of their cost).
def names_of(found: Iterable[Found]) -> list[str]:
    if type(found) is Whole:
        return list(found.pack.names)
    return [f[0].names[f[1]] if isinstance(f, tuple) else f.name for f in found]


def numbers_of(found: Iterable[Found]) -> list[int]:
    if type(found) is Whole:
        return list(found.pack.numbers)
    return [f[0].numbers[f[1]] if isinstance(f, tuple) else f.number for f in found]


def nbytes_in(found: Iterable[Found]) -> int:
    if type(found) is Whole:
        return found.pack.nbytes
    return sum([f[0].items[f[1]][3] if isinstance(f, tuple) else f.nbytes for f in found])


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
    # Or rows of a pack (``Pack``) that a get_many found together (``versions`` empty).
    pack: Pack | None = None
    rows: tuple[int, ...] = ()


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


def whole_pack(e: Entry | None, names: Sequence[str]) -> Pack | None:
    """The pack whose rows ``names`` are, all of them in order, when ``e``
    (the first name's) points at its first row; else None.  Every row of a
    pack is live (a name points at it) only while each of its entries
    points at it (``Pack.live`` counts a row down when its name moves on,
    is deleted, or is made a Version of it)."""
    if e is None or e.index:
        return None
    p = e.pack
    if p is None or p.live != len(p.names) or len(names) != len(p.names) or names != p.names:
        return None
    return p


class Records:
    """Every name the broker knows, each with its versions."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock = clock
        self.entries: dict[str, Entry] = {}
        # Versions of every name start above every number any dropped name
        # ever had, so versions only grow without remembering dropped names
        # (and a board's slot given to a new name never shows an old number).
        self._version_floor = 0
        self._board: Board | None = None

    # -- the board of newest versions (shm._board) ----------------------------
    def board(self) -> Board:
        """The board every name's newest number is shown on, made (and every
        name given a slot) the first time a lane asks for it."""
        b = self._board
        if b is None:
            b = self._board = Board()
            for e in self.entries.values():
                e.slot = b.slot()
                b.show(e.slot, e.number)
        return b

    def words(self) -> memoryview | None:
        """The board's slots as a writable memoryview of u64 (None: no board):
        whoever changes a name's newest writes ``words[e.slot] = number``
        (a name with a slot: ``e.slot >= 0``) before the answer of the
        request that changed it."""
        return None if self._board is None else self._board.words

    def close(self) -> None:
        if self._board is not None:
            self._board.close()

    # -- versions only grow ---------------------------------------------------
    def entry(self, name: str) -> Entry:
        """The name's incarnation, a new one numbered above every dropped name."""
        e = self.entries.get(name)
        if e is None:
            e = self.entries[name] = Entry(name, next_version=self._version_floor + 1)
            if self._board is not None:
                e.slot = self._board.slot()
        return e

    def drop(self, e: Entry) -> None:
        """Forget a name; the floor keeps its numbers from coming back."""
        if self.entries.get(e.name) is e:
            del self.entries[e.name]
            self._version_floor = max(self._version_floor, e.next_version - 1)
            if e.slot >= 0:
                self._board.free(e.slot)  # type: ignore[union-attr]
                e.slot = -1

    # -- reading -------------------------------------------------------------
    def ready(self, name: str, newer_than: int) -> Version | None:
        e = self.entries.get(name)
        if e is None or e.number <= newer_than:
            return None
        return e.ready

    def found(self, name: str, newer_than: int) -> Found | None:
        """``ready``, but a pack's row as it is (no ``Version`` made): what a
        get_many leases."""
        got = self.found_all((name,), (newer_than,))
        return None if got is None else got[0]

    def found_all(self, names: Sequence[str], floors: Sequence[int]) -> list[Found] | None:
        """``found`` of each name, or None if one has nothing newer than its floor."""
        get = self.entries.get
        if names:
            p = whole_pack(get(names[0]), names)
            if p is not None:  # the usual batch: every row of one pack, in order
                return whole(p) if all(map(gt, p.numbers, floors)) else None
        out: list[Found] = []
        for name, floor in zip(names, floors, strict=True):
            e = get(name)
            if e is None:
                return None
            p = e.pack
            if p is not None:
                i = e.index
                if p.numbers[i] <= floor:
                    return None
                out.append((p, i))
            else:
                v = e._ready
                if v is None or v.number <= floor:
                    return None
                out.append(v)
        return out

    def info(self, e: Entry, v: Version, row_readers: int = 0) -> TensorInfo:
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
            readers=e.readers + row_readers,
            expires_in=expires,
            origin=r.origin if r else None,
            origin_version=r.version if r else None,
        )

    def list(
        self, prefix: str = "", row_readers: dict[Entry, int] | None = None
    ) -> list[TensorInfo]:
        """Every name that starts with ``prefix``, with its readers: its
        Versions' leases (``Entry.readers``) and its pack rows' (``row_readers``)."""
        rows = row_readers or {}
        out = []
        for name in sorted(n for n in self.entries if n.startswith(prefix)):
            e = self.entries[name]
            v = e.facts()
            if v is None:
                v = max(e.writing.values(), key=lambda x: x.number, default=None)
            # pulls in flight
            if v is not None and not (v.state == "writing" and v.replica is not None):
                out.append(self.info(e, v, rows.get(e, 0)))
        return out

    def tensors(self) -> int:
        return sum(1 for e in self.entries.values() if e.published)

    # -- what a miss says ------------------------------------------------------
    def known(self, prefix: str | None = None) -> str:
        """The published names, those starting with ``prefix`` only: a message
        names nothing its caller may not use."""
        names = sorted(
            n
            for n, e in self.entries.items()
            if e.published and (prefix is None or n.startswith(prefix))
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
        if newer_than and e is not None and e.published:
            return TensorNotFound(
                f"no version of {name!r} newer than v{newer_than} exists yet (the newest is "
                f"v{e.number}); pass timeout= to wait for one"
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
                if e is None or not e.published
                else f"{n!r} (v{e.number}, not newer than v{f})"
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
        if newer_than and e is not None and e.published:
            return WaitTimedOut(
                f"no version of {name!r} newer than v{newer_than} was published {within} "
                f"(the newest is v{e.number})"
            )
        peers = "" if hook is None else hook.explain(name)
        return WaitTimedOut(
            f"tensor {name!r} was not published {within} ({self.known(prefix)}){peers}"
        )
