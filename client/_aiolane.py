"""The AsyncClient's requests on the shared-memory lane (docs/plan-lane.md,
step 6): the asyncio side of a ``ClientLane``.

A ``Client`` waits for its lane's answer bell with ``poll``, one request at
a time.  On an event loop that would block every other task, so here each
request (a ``LaneStep`` its operation yields) is written into the request
ring on the loop, with a future by its sequence number, and the answer
bell is a reader of the loop (``loop.add_reader``): it drains the bell and
takes every answer in the ring, resolving the future of each; an answer
nobody waits for any more (its caller was cancelled) is dropped.  Several
requests may be in flight on one lane, long polls too, each answered when
the broker answers it.

Where the lane cannot take a request (another thread writes into it, the
record is larger than the ring, the ring is full, or as many requests wait
for their answers as the answer ring surely holds: ``ANSWER_MOST`` each, a
batch half the ring), it goes over HTTP; so it does where the lane is
gone: while requests wait, one look every ``_LOOK`` seconds asks whether
the broker closed the lane or died (``ClientLane.gone``) and whose I/O
timeout passed, and a ring that holds what a broker never writes closes
it.  Either way the request is sent over HTTP (the lane carries only
requests that may be sent twice, ``_shmlane.on_lane``).  A cancelled
caller's request stays in the ring; its operation queues its request id
for cancelling (``Core.call``), as for any request whose answer is never
read.

The reader stays the loop's from the first request on (a late answer rings
the bell too), and ``retire`` takes it off before the lane's descriptors
may close (a lane found gone or corrupt, a new session's lane, the
client's close); a forked child drops this object without touching the
loop, whose epoll instance it shares with its parent (``forget``).
"""

from __future__ import annotations

import asyncio

from .._laneproto import MEDIA_HTTP, LaneGarbled, parse_answer
from ..shm._lanemem import CLIENT
from ..shm._ring import RingCorrupt
from ._http import LaneStep
from ._shmlane import _LOOK, ClientLane, LaneBusy, LaneGone, is_batch

# The largest answer of a request on the lane other than a batch's: a
# handle with the longest name and the most dimensions is under 1 KiB, an
# error that names it under 1.5 KiB.  A batch's answer may take half the
# answer ring (a larger one comes as a ``MEDIA_HTTP`` mark).  Requests in
# flight are at most what seven eighths of the answer ring holds of these
# (the rest for a skip at its end and the marks): an answer that finds no
# room comes over HTTP, and the broker ends the session of a client whose
# ring has no room even for that mark (it does not read its answers).
ANSWER_MOST = 4096


class _Waiting:
    """A request that waits: its answer's future and its deadline (the
    loop's clock; None: none)."""

    __slots__ = ("deadline", "fut")

    def __init__(self, fut: asyncio.Future[tuple[int, bytes]], deadline: float | None) -> None:
        self.fut = fut
        self.deadline = deadline


class AioLane:
    """The asyncio side of one ``ClientLane`` (see the module doc)."""

    def __init__(self, lane: ClientLane) -> None:
        self.lane = lane
        self.waiting: dict[int, _Waiting] = {}  # by sequence number
        # sent, answer not taken (cancelled callers' too): the answer room each holds
        self.unanswered: dict[int, int] = {}
        self.held = 0  # their sum
        size = lane.mem.answers.size
        self.room = size - size // 8
        self.batch = size // 2
        self._watched: asyncio.AbstractEventLoop | None = None  # the loop reading its bell
        self._looks: asyncio.TimerHandle | None = None  # while requests wait (_look)

    async def roundtrip(self, step: LaneStep) -> tuple[int, bytes]:
        """``step``'s ``(status, body)``; raises ``LaneBusy`` or ``LaneGone``
        (send it over HTTP) or ``TimeoutError`` (after its I/O timeout, to
        within ``_LOOK``)."""
        loop = asyncio.get_running_loop()
        seq = self._send(step, loop)
        fut: asyncio.Future[tuple[int, bytes]] = loop.create_future()
        deadline = None if step.timeout is None else loop.time() + step.timeout
        self.waiting[seq] = _Waiting(fut, deadline)
        if self._looks is None:
            self._looks = loop.call_later(_LOOK, self._look)
        try:
            return await fut
        finally:
            self.waiting.pop(seq, None)

    def _look(self) -> None:
        """Every ``_LOOK`` seconds while requests wait, one look for all of
        them: whether the lane is gone, and whose deadline passed."""
        self._looks = None
        if not self.waiting:
            return
        why = self.lane.gone()
        if why is not None:
            self._broken(why)
            return
        loop = asyncio.get_running_loop()
        now = loop.time()
        for w in self.waiting.values():
            if w.deadline is not None and now >= w.deadline and not w.fut.done():
                w.fut.set_exception(TimeoutError("timed out waiting for the broker on the lane"))
        self._looks = loop.call_later(_LOOK, self._look)

    def _send(self, step: LaneStep, loop: asyncio.AbstractEventLoop) -> int:
        """Write ``step``'s record and ring the broker (``ClientLane.send``):
        its sequence number."""
        lane = self.lane
        if not lane._lock.acquire(blocking=False):  # a thread is handing the lane over
            raise LaneBusy
        try:
            room = self.batch if is_batch(step.path) else ANSWER_MOST
            if self.held + room > self.room:
                raise LaneBusy  # its answer might not fit the answer ring
            try:
                seq = lane.send(step.method, step.path, step.headers, step.data, full=LaneBusy)
            except RingCorrupt as exc:
                self._broken(f"the lane is corrupt ({exc})")
                raise LaneGone(f"the lane is corrupt ({exc})") from None
            self._watch(loop)  # its answer is read on the loop, which runs after this returns
            self.unanswered[seq] = room
            self.held += room
            return seq
        finally:
            lane._lock.release()

    def _watch(self, loop: asyncio.AbstractEventLoop) -> None:
        """The bell, a reader of ``loop`` (kept until ``retire``: a late answer
        rings it too, and is dropped)."""
        if self._watched is not loop:
            self._unwatch()
            loop.add_reader(self.lane.mem.bells[CLIENT], self._rung)
            self._watched = loop

    def _unwatch(self) -> None:
        """The bell no longer a reader, and no look due, on the loop that had them."""
        loop, self._watched = self._watched, None
        looks, self._looks = self._looks, None
        if looks is not None:
            looks.cancel()
        if loop is not None and not loop.is_closed():
            loop.remove_reader(self.lane.mem.bells[CLIENT])

    def _rung(self) -> None:
        """The answer bell rang: every answer in the ring to its future."""
        mem = self.lane.mem
        try:
            mem.drain(CLIENT)
            while True:
                back = mem.answers.take()  # type: ignore[union-attr]
                if back is None:
                    return
                seq, status, media, body = parse_answer(back)
                self.held -= self.unanswered.pop(seq, 0)
                w = self.waiting.get(seq)
                if w is not None and not w.fut.done():
                    if media == MEDIA_HTTP:  # too large for the ring now: over HTTP
                        w.fut.set_exception(LaneBusy())
                    else:
                        w.fut.set_result((status, body))
        except (RingCorrupt, LaneGarbled) as exc:
            self._broken(f"the lane is corrupt ({exc})")

    def _broken(self, why: str) -> None:
        """The lane is gone: every waiting request goes over HTTP."""
        self.retire(why)
        self.lane._close()

    def retire(self, why: str = "the client took a new lane") -> None:
        """Stop reading the bell (before the lane's descriptors may close)
        and send every waiting request over HTTP (on the loop)."""
        self._unwatch()
        for w in self.waiting.values():
            if not w.fut.done():
                w.fut.set_exception(LaneGone(why))

    def forget(self) -> None:
        """In a forked child: drop the parent's waits without touching its loop."""
        self._watched = self._looks = None
        self.waiting = {}
