"""Waits: gets parked until a version is published (the long poll).

A get that finds nothing newer than it asked for parks here.  Each parked
get has one future, and whatever should end its wait or make it look again
resolves it: a publish of the name (``wake``), its timer (the deadline, or
the interval at which peers are asked again), a cancel (``release`` of its
request id, or its session's end), the client hanging up, or shutdown
(``stop_all``).  No task runs per wait; a parked get costs one future, one
timer and its place in two sets, and that state goes with the last waiter.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Awaitable, Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ._records import Found
    from ._sessions import Session


class ClientGone(Exception):
    """The client hung up (or cancelled the request) while it waited: nobody
    will read the answer, so no lease is granted."""


class _Waker:
    """One parked get's future, and whether it should give up."""

    __slots__ = ("future", "stopped")

    def __init__(self) -> None:
        self.future: asyncio.Future[None] | None = None
        self.stopped = False  # cancelled, hung up, or shutting down: give up

    def wake(self, *_: object) -> None:
        f = self.future
        if f is not None and not f.done():
            f.set_result(None)

    def stop(self, *_: object) -> None:
        self.stopped = True
        self.wake()


class Waits:
    """Every parked get, by the name it waits for."""

    def __init__(self) -> None:
        self._by_name: dict[str, set[_Waker]] = {}  # the gets asleep on each name
        self._parked: set[_Waker] = set()  # every parked get, for shutdown

    @property
    def waiting(self) -> int:
        """Gets parked now."""
        return len(self._parked)

    def __contains__(self, name: object) -> bool:
        """Whether a get is asleep on ``name``."""
        return name in self._by_name

    def asleep(self) -> bool:
        """Whether a get is asleep on any name."""
        return bool(self._by_name)

    def wake(self, name: str) -> None:
        """A version of ``name`` was published: every get asleep on it looks again."""
        wakers = self._by_name.pop(name, None)
        if wakers is not None:
            for waker in wakers:
                waker.wake()

    def wake_many(self, names: Iterable[str]) -> None:
        """``wake`` of each of ``names`` that a get is asleep on."""
        for name in self._by_name.keys() & names:
            self.wake(name)

    def stop_all(self) -> None:
        """Shutdown: every parked get gives up."""
        for waker in list(self._parked):
            waker.stop()

    async def wait(
        self,
        s: Session,
        names: list[str],
        look: Callable[[], Awaitable[Found | None]],
        deadline: float | None,
        *,
        poll: float | None,
        stopped: bool,
        request: str | None,
        gone: Callable[[], Awaitable[Any]] | None,
    ) -> Found | None:
        """Sleep until woken (a publish of one of ``names``), then ``look()``,
        until it finds a version (which this returns) or ``deadline`` (loop
        time) passes (None).  ``poll``:
        look at least this often (the peers may have one).  Raises ClientGone
        if the request is cancelled (``request``: its id), the client hangs up
        (``gone()`` resolves), or ``stopped`` (the broker is shutting down)."""
        loop = asyncio.get_running_loop()
        with self._parked_get(s, request, gone) as waker:
            waker.stopped = waker.stopped or stopped
            while not waker.stopped:
                remaining = None if deadline is None else deadline - loop.time()
                if poll is not None:
                    remaining = min(poll, math.inf if remaining is None else remaining)
                await self._nap(waker, names, remaining)
                if waker.stopped:
                    break
                v = await look()
                if v is not None:
                    return v
                if deadline is not None and loop.time() >= deadline:
                    return None
        raise ClientGone(names[0])

    @contextmanager
    def _parked_get(
        self, s: Session, request: str | None, gone: Callable[[], Awaitable[Any]] | None
    ) -> Iterator[_Waker]:
        """A waker that a cancel of ``request`` or a hang-up stops, parked
        while the block runs."""
        waker = _Waker()
        cancel: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        cancel.add_done_callback(waker.stop)  # release(requests=[id]), session end
        if request is not None:
            s.waits[request] = cancel
        watch, own = None, False
        if gone is not None:  # only now: a wait that never starts needs no hang-up watch
            hung_up = gone()
            watch = asyncio.ensure_future(hung_up)
            own = watch is not hung_up  # a task made here for a coroutine: ours to cancel
            watch.add_done_callback(waker.stop)
        self._parked.add(waker)
        try:
            yield waker
        finally:
            self._parked.discard(waker)
            if watch is not None:
                watch.remove_done_callback(waker.stop)
                if own:
                    watch.cancel()
            if request is not None and s.waits.get(request) is cancel:
                del s.waits[request]

    async def _nap(self, waker: _Waker, names: list[str], seconds: float | None) -> None:
        """Sleep until a publish of one of ``names``, a stop, or ``seconds`` (None: no timer)."""
        loop = asyncio.get_running_loop()
        beds = []
        for name in names:
            asleep = self._by_name.get(name)
            if asleep is None:
                asleep = self._by_name[name] = set()
            asleep.add(waker)
            beds.append((name, asleep))
        waker.future = loop.create_future()
        timer = None if seconds is None else loop.call_later(max(seconds, 0.0), waker.wake)
        try:
            await waker.future
        finally:
            waker.future = None
            if timer is not None:
                timer.cancel()
            for name, asleep in beds:
                asleep.discard(waker)  # a publish popped the set already, or this one leaves it
                if not asleep and self._by_name.get(name) is asleep:
                    del self._by_name[name]  # nobody waits: the state goes with the last waiter
