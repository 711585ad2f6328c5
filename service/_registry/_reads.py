"""Reads: gets, one name or a batch, at once or after a wait (the long poll).

A get leases the newest ready version newer than the version it names
(``newer_than``); a batch leases one per name under one deadline.  What a
batch waits for is its ``wait``: ``"all"`` (every name has the version it
asks for) or ``"any"`` (one name has, and then every name's newest ready
version is leased).  A miss names every name of the batch that misses
(``Records.batch_missed``).  ``Broker`` answers with these methods.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, Literal

from ..._errors import InvalidRequest, TensorNotFound
from ._records import nbytes_in
from ._sessions import Caller
from ._waits import ClientGone

if TYPE_CHECKING:
    from ._leases import Leases
    from ._records import Found, PeerHook, Records, Row, Version
    from ._sessions import Session, Sessions
    from ._waits import Waits

Wait = Literal["all", "any"]
Got = list[tuple["Found", int]]  # the versions (or rows of packs) leased, with their lease ids


class Reads:
    """The reading side of the registry."""

    def __init__(
        self,
        *,
        sessions: Sessions,
        records: Records,
        lending: Leases,
        waits: Waits,
        count: Callable[..., None],
        kept: Callable[[str, int], Version | Row | None],
    ) -> None:
        self.kept = kept  # Memory.kept
        self.sessions = sessions
        self.records = records
        self.lending = lending
        self.waits = waits
        self._count = count
        self.peers: PeerHook | None = None  # set when --peer is given

    def try_get(
        self,
        sid: str | None,
        caller: Caller,
        name: str,
        newer_than: int = 0,
        *,
        request: str | None = None,
    ) -> tuple[Version, int] | None:
        """``get`` when a version is ready now and no peer needs asking, without
        awaiting: the version and its lease; None when ``get`` would wait,
        ask the peers, or answer not found."""
        s = self.sessions.admit(sid, caller)
        v = self.records.ready(name, newer_than)
        if v is None or self.peers is not None:
            return None
        return v, self.lending.take(s, v, request)

    def get_version(
        self, sid: str | None, caller: Caller, name: str, number: int, *, request: str | None = None
    ) -> tuple[Version, int]:
        """Lease version ``number`` of ``name`` exactly, while it lives: the
        newest, or an older one that a lease still keeps (a sender's, for
        the receiver of a pickle).  Never waits, never asks a peer."""
        s = self.sessions.admit(sid, caller)
        e = self.records.entries.get(name)
        v = (
            e.ready
            if e is not None and e.published and e.number == number
            else self.kept(name, number)
        )
        pack = None
        if isinstance(v, tuple):  # a row of a pack that a lease keeps
            pack = v[0]
            v = pack.books.make(pack, v[1], False)
        if v is None or v.block is None or v.state != "ready":
            now = "" if e is None or not e.published else f"; the broker has v{e.number} now"
            raise TensorNotFound(
                f"tensor {name!r} v{number} is not kept: no lease holds it "
                f"and a newer version replaced it, or it was deleted, or it "
                f"was never published{now}"
            )
        try:
            return v, self.lending.take(s, v, request)
        except BaseException:
            if pack is not None:  # nothing holds the Version just made of the row
                pack.books.free_if_unreachable(v)
            raise

    def try_get_many(
        self,
        sid: str | None,
        caller: Caller,
        names: list[str],
        newer_than: int | list[int] = 0,
        *,
        request: str | None = None,
        wait: Wait = "all",
    ) -> Got | None:
        """``get_many`` when what it asks for is ready now and no peer needs
        asking, without awaiting; None (and no lease) when it would wait."""
        s = self.sessions.admit(sid, caller)
        if self.peers is not None:
            return None
        if isinstance(newer_than, list) and len(newer_than) != len(names):
            return None  # get_many says what is wrong
        ready = self.records.found
        floors = newer_than if isinstance(newer_than, list) else [newer_than] * len(names)
        if wait == "any":
            if not any(ready(n, f) is not None for n, f in zip(names, floors, strict=True)):
                return None
            floors = [0] * len(names)  # then every name's newest
        found = self.records.found_all(names, floors)
        if found is None:
            return None
        return self._leased(s, found, request)

    def _leased(self, s: Session, found: list[Found], request: str | None) -> Got:
        """Leases of ``found``, all found at once, counted."""
        lids = self.lending.take_many(s, found, request)
        return self._counted(list(zip(found, lids, strict=True)), found)

    def _counted(self, got: Got, found: list[Found] | None = None) -> Got:
        """A batch's leases, counted in the metrics at once (those of a batch
        that failed too: their releases are counted); ``found``: what they
        hold, if the caller has it as one list (a ``Whole`` one is counted
        without a look at each row)."""
        self._count("gets", len(got))
        self._count("bytes_got", nbytes_in([f for f, _ in got] if found is None else found))
        return got

    async def get(
        self,
        sid: str | None,
        caller: Caller,
        name: str,
        timeout: float | None,
        newer_than: int = 0,
        *,
        request: str | None = None,
        gone: Callable[[], Awaitable[Any]] | None = None,
    ) -> tuple[Version, int]:
        """Lease the newest ready version of ``name``, waiting up to ``timeout``
        seconds (None: forever).  ``gone()`` resolves if the client hangs up."""
        got = await self._get_all(
            sid, caller, [name], timeout, [newer_than], request, gone, self.records.ready
        )
        return got[0]  # type: ignore[return-value]  # a Version: records.ready finds one

    async def get_many(
        self,
        sid: str | None,
        caller: Caller,
        names: list[str],
        timeout: float | None,
        *,
        newer_than: int | list[int] = 0,
        request: str | None = None,
        gone: Callable[[], Awaitable[Any]] | None = None,
        wait: Wait = "all",
    ) -> Got:
        """Under one deadline, all of them or an error and none.  ``newer_than``:
        one version floor for every name, or one per name; ``wait``: see the
        module's doc."""
        if isinstance(newer_than, list) and len(newer_than) != len(names):
            raise InvalidRequest(
                f"newer_than has {len(newer_than)} versions for {len(names)} "
                f"names; give one per name, in the same order"
            )
        floors = newer_than if isinstance(newer_than, list) else [newer_than] * len(names)
        if wait == "any":
            return await self._get_any(sid, caller, names, timeout, floors, request, gone)
        return await self._get_all(
            sid, caller, names, timeout, floors, request, gone, self.records.found
        )

    def _asks_peers(self, found: Found | None) -> bool:
        """Whether a get that found ``found`` here asks the peers first: a
        miss, or a replica that may be stale (a peer may publish a newer one
        here; a row of a pack never is one).  The long poll asks on a miss
        only (``_wait``)."""
        return self.peers is not None and (
            found is None or (type(found) is not tuple and found.replica is not None)  # type: ignore[union-attr]
        )

    async def _ask_peers(
        self, name: str, newer_than: int, timeout: float | None, caller: Caller
    ) -> None:
        assert self.peers is not None
        await self.peers.before_get(name, newer_than, timeout is None or timeout > 0, caller)

    async def _get_all(
        self,
        sid: str | None,
        caller: Caller,
        names: list[str],
        timeout: float | None,
        floors: list[int],
        request: str | None,
        gone: Callable[[], Awaitable[Any]] | None,
        find: Callable[[str, int], Found | None],
    ) -> Got:
        """``find``: ``Records.found`` (rows of packs as they are), or
        ``Records.ready`` (a ``Version`` each, for a single get)."""
        s = self.sessions.admit(sid, caller)
        got: Got = []
        found: list[Found] = []  # ready, not yet leased: leased together before any wait

        def lease_found() -> None:
            got.extend(zip(found, self.lending.take_many(s, found, request), strict=True))
            found.clear()

        deadline = None if timeout is None else asyncio.get_running_loop().time() + timeout
        # At the start and after each wait, the names left are looked up in one
        # pass (Records.found_all), which stops at the first that misses: the
        # usual batch wakes to find all of them (no peers, rows as they are).
        bulk = rows = self.peers is None and find == self.records.found
        i, n = 0, len(names)
        try:
            while i < n:
                if bulk:
                    bulk = False
                    rest = self.records.found_all(names[i:], floors[i:])
                    if rest is not None:
                        if not found and not got:  # every one at once (a Whole, maybe)
                            return self._leased(s, rest, request)
                        found.extend(rest)
                        break
                name, newer_than = names[i], floors[i]
                i += 1
                v = find(name, newer_than)
                if self._asks_peers(v):
                    lease_found()
                    await self._ask_peers(name, newer_than, timeout, caller)
                    self.sessions.resumed(s, sid, caller, request)
                    v = find(name, newer_than)
                if v is None:
                    if timeout == 0:
                        raise self.records.batch_missed(
                            names, floors, timeout, False, self.peers, caller.prefix
                        )
                    lease_found()
                    try:
                        v = await self._wait(
                            s, caller, [name], [newer_than], deadline, timeout, request, gone, find
                        )
                    except TensorNotFound:  # timed out: say every name still missing
                        raise self.records.batch_missed(
                            names, floors, timeout, True, self.peers, caller.prefix
                        ) from None
                    # Raises if shutting down, it ended, or the request was cancelled.
                    self.sessions.resumed(s, sid, caller, request)
                    bulk = rows
                found.append(v)
            lease_found()
        except BaseException:
            self._counted(got)  # taken, so counted, then given back
            self.lending.release_ids(s, [lid for _, lid in got])
            raise
        return self._counted(got)

    async def _get_any(
        self,
        sid: str | None,
        caller: Caller,
        names: list[str],
        timeout: float | None,
        floors: list[int],
        request: str | None,
        gone: Callable[[], Awaitable[Any]] | None,
    ) -> Got:
        s = self.sessions.admit(sid, caller)
        ready = self.records.found
        deadline = None if timeout is None else asyncio.get_running_loop().time() + timeout
        if self.peers is not None:  # what a peer may have newer, as _get_all asks per name
            for name, newer_than in zip(names, floors, strict=True):
                if self._asks_peers(ready(name, newer_than)):
                    await self._ask_peers(name, newer_than, timeout, caller)
            self.sessions.resumed(s, sid, caller, request)
        if not any(ready(n, f) is not None for n, f in zip(names, floors, strict=True)):
            if timeout == 0:
                raise self.records.batch_missed(
                    names, floors, timeout, False, self.peers, caller.prefix, any_of=True
                )
            try:
                await self._wait(s, caller, names, floors, deadline, timeout, request, gone, ready)
            except TensorNotFound:
                raise self.records.batch_missed(
                    names, floors, timeout, True, self.peers, caller.prefix, any_of=True
                ) from None
            self.sessions.resumed(s, sid, caller, request)
        found = [ready(n, 0) for n in names]
        if any(v is None for v in found):
            raise self.records.batch_missed(
                names, [0] * len(names), timeout, False, self.peers, caller.prefix
            )
        got: Got = []
        try:
            for v in found:
                assert v is not None
                got.append((v, self.lending.take(s, v, request, count=False)))
        except BaseException:
            self._counted(got)  # taken, so counted, then given back
            self.lending.release_ids(s, [lid for _, lid in got])
            raise
        return self._counted(got)

    async def _wait(
        self,
        s: Session,
        caller: Caller,
        names: list[str],
        floors: list[int],
        deadline: float | None,
        timeout: float | None,
        request: str | None,
        gone: Callable[[], Awaitable[Any]] | None,
        find: Callable[[str, int], Found | None],
    ) -> Found:
        """The long poll: park until a version of one of ``names`` newer than its
        floor is published (here, or at a peer), or ``deadline``; the version
        (as ``find`` finds it: see ``_get_all``)."""
        pairs = list(zip(names, floors, strict=True))
        if deadline is not None and deadline <= asyncio.get_running_loop().time():
            raise self.records.timed_out(names[0], floors[0], timeout, self.peers, caller.prefix)
        self._count("waits")  # gets that had to wait for a publish
        peers = self.peers

        async def look() -> Found | None:
            for name, newer_than in pairs:
                v = find(name, newer_than)
                if v is None and peers is not None:
                    await peers.before_get(name, newer_than, True, caller)
                    self.sessions.admit(s.id, Caller(s.owner, s.bound))
                    v = find(name, newer_than)
                if v is not None:
                    return v
            return None

        try:
            v = await self.waits.wait(
                s,
                names,
                look,
                deadline,
                stopped=self.sessions.closing,
                poll=None if peers is None else peers.poll_interval,
                request=request,
                gone=gone,
            )
        except ClientGone:
            self.sessions.admit(s.id, Caller(s.owner, s.bound))  # says why: closing, or it ended
            raise
        if v is None:
            raise self.records.timed_out(names[0], floors[0], timeout, self.peers, caller.prefix)
        return v
