"""The shared-memory lane's door (docs/plan-lane.md): a session's requests
read from a memfd's ring when its client rings the bell, answered into the
other ring, through the same gate as the HTTP doors.

Handover.  ``POST /v1/lane`` (``routers/sessions.py``), on the unix
socket's fast lane only, makes the lane (``ShmLanes.open``): a memfd with
two rings and two eventfds (``shm._lanemem``).  The fast lane passes the
three descriptors with the answer (``Passing``, ``SCM_RIGHTS``); only
then is the lane started (its bell becomes a reader of the event loop).

Requests.  Each record (``_laneproto``) is what an HTTP request would
carry: the gate admits it (route, principal, scope, prefix) and dispatches
it (riders, body, handler, idempotent replay) with the scope of the
connection that asked for the lane (its peer's credentials, its token), as
if it had come on that connection; its session header is always the
lane's own session.  Routes that ``LANE_OPS`` does not name are answered
400 and keep HTTP.

Untrusted input.  The client may write anything into its rings at any
time: a record is copied out before it is read, every field is bounded by
the record (``_laneproto``), at most ``TAKE_MOST`` records are read per
ring of the bell (more wait for the loop's next turn), nothing waits on
the client, and a ring or a record that a well-behaved client never writes
ends that session (as a lapse: its process may still map what it held)
and closes its lane, with one line in the log.

Lifetime.  A lane ends with its session: the sweep (``ShmLanes.sweep``,
from the broker's reaper, and at each bell) closes the lanes whose session
is gone, which removes the reader and closes the broker's descriptors.
A session that asks again gets a new lane; the old one is closed.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable
from typing import Any

from ..._errors import Conflict, InvalidRequest
from ..._laneproto import (
    MEDIA_HTTP,
    MEDIA_JSON,
    MEDIA_OTHER,
    LaneGarbled,
    answer_record,
    parse_request,
)
from ..._proto import SESSION_HEADER
from ...shm._lanemem import BROKER, CLIENT, LaneMemory
from ...shm._ring import RingCorrupt
from ._gate import Gate
from ._handler import JSON, Answer

log = logging.getLogger("tensordepot.broker")

REQUESTS = 4 << 20  # the request ring's bytes
ANSWERS = 256 << 10  # the answer ring's
TAKE_MOST = 32  # records read per ring of the bell: the rest on the loop's next turn
# The routes the lane serves (docs/plan-lane.md); the client's ``on_lane`` picks the same.
LANE_OPS = frozenset(
    {
        "stat",
        "get_tensor",
        "put_tensor",
        "alloc_tensor",
        "publish_tensor",
        "put_many",
        "get_many",
        "alloc_many",
        "publish_many",
    }
)
_SESSION = SESSION_HEADER.encode()
_LENGTH = b"content-length"


class ShmLanes:
    """Every session's lane on one app, and the switch (``enabled``)."""

    def __init__(self, gate: Gate, enabled: bool) -> None:
        self.gate = gate
        self.enabled = enabled
        self.lanes: dict[str, ShmLane] = {}

    def open(self, sid: str, scope: Any) -> ShmLane:
        """A new lane for the session ``sid`` (owned by the caller: the route
        checks), not started: ``Passing`` starts it once its descriptors are
        passed, or closes it."""
        if not self.enabled:
            raise Conflict(
                "this broker runs with --no-lane ($TENSORDEPOT_NO_LANE): requests go over HTTP"
            )
        return ShmLane(self, sid, LaneMemory.create(REQUESTS, ANSWERS), _lane_scope(scope))

    def start(self, lane: ShmLane) -> None:
        old = self.lanes.pop(lane.sid, None)
        if old is not None:
            old.close()
        self.lanes[lane.sid] = lane
        asyncio.get_running_loop().add_reader(lane.mem.bells[BROKER], lane.rung)

    def ended(self, sid: str) -> None:
        """Close ``sid``'s lane if its session is gone (marked gone for its
        client before the answer that ended it: a client then never takes a
        get's lease back, ``shm._board``, from a session that ended)."""
        lane = self.lanes.get(sid)
        if lane is not None and self.gate.broker.sessions.get(sid) is None:
            lane.close()

    def sweep(self) -> None:
        """Close the lanes whose session is gone."""
        sessions = self.gate.broker.sessions
        for lane in [lane for sid, lane in self.lanes.items() if sessions.get(sid) is None]:
            lane.close()

    def close(self) -> None:
        """Close every lane (the broker stops)."""
        for lane in list(self.lanes.values()):
            lane.close()


def _lane_scope(scope: Any) -> dict[str, Any]:
    """What the gate reads of the connection that asked for the lane: its
    peer's credentials and its token, under a connection of its own."""
    state = {k: v for k, v in (scope.get("state") or {}).items() if k != "principal"}
    state["connection"] = {}
    token = [(k, v) for k, v in scope.get("headers", ()) if k == b"authorization"]
    return {"type": "http", "headers": token[:1], "state": state}


class ShmLane:
    """One session's lane, as the broker serves it."""

    def __init__(self, lanes: ShmLanes, sid: str, mem: LaneMemory, scope: dict[str, Any]) -> None:
        self.lanes, self.sid, self.mem, self.scope = lanes, sid, mem, scope
        self.closed = False
        self._again: asyncio.Handle | None = None
        self.tasks: set[asyncio.Task[None]] = set()  # answers that wait

    def passing(self) -> Passing:
        """This lane, to hand over with an answer (``_handler.Handover``)."""
        return Passing(self)

    def rung(self) -> None:
        """The client rang (or the loop's next turn after ``TAKE_MOST``
        records): read and answer what its ring holds."""
        self._again = None
        if self.closed:
            return
        mem = self.mem
        mem.drain(BROKER)
        if self.lanes.gate.broker.sessions.get(self.sid) is None:
            self.close()
            return
        answered = False
        books = self.lanes.gate.broker.memory
        for _ in range(TAKE_MOST):
            try:
                rec = mem.requests.take()  # type: ignore[union-attr]
                if rec is None:
                    break
                answered |= self._run(rec)
            except (RingCorrupt, LaneGarbled) as exc:
                self.garbled(str(exc))
                return
            finally:
                if books.unsettled:  # a publish's retirements: its client hears first
                    if answered and not self.closed:
                        mem.ring(CLIENT)
                        answered = False
                    books.retire_pending()
            if self.closed:  # its answer could not be written (garbled)
                return
        else:  # more may wait: on the loop's next turn, after other work
            self._again = asyncio.get_running_loop().call_soon(self.rung)
        if answered:
            mem.ring(CLIENT)

    def _run(self, rec: bytes) -> bool:
        """Run one request record; whether its answer was written now."""
        seq, method, path, query, headers, view = parse_request(rec)
        headers[_SESSION] = self.sid.encode()  # a lane speaks for its own session only
        headers[_LENGTH] = b"%d" % len(view)  # as an HTTP door has it: the body's own
        gate = self.lanes.gate
        started = time.perf_counter()
        route = None
        try:
            adm = gate.admit(method, path, self.scope)
            route = adm.route
            if route.op not in LANE_OPS:
                raise InvalidRequest(
                    f"{method} {adm.route.template} is not served on the lane; send it over HTTP"
                )
            # A framed body's tensor bytes are copied once more, into their
            # pack, and never parsed: a view of them will do.
            body = view if route.framed else bytes(view)
            reply = gate.dispatch(adm, method, path, self.scope, headers, query, body, None)  # type: ignore[arg-type]
        except BaseException as exc:
            reply = gate.failure(exc, method, path)
        media = route.media if route is not None else JSON
        if isinstance(reply, tuple):
            self._answer(seq, reply, media, method, route, started)
            return True
        task = asyncio.get_running_loop().create_task(
            self._later(seq, reply, media, method, route, started)
        )
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return False

    async def _later(
        self, seq: int, pending: Awaitable[Answer], media: str, method: str, route: Any, t0: float
    ) -> None:
        try:
            result = await pending
        except asyncio.CancelledError:
            if self.closed:
                return  # the lane closed under it (its session ended): nobody reads an answer
            raise
        except BaseException as exc:
            result = self.lanes.gate.failure(exc, method, "")
        if self.closed:
            return
        try:
            self._answer(seq, result, media, method, route, t0)
        except RingCorrupt as exc:
            self.garbled(str(exc))
        if not self.closed:
            self.mem.ring(CLIENT)

    def _answer(
        self, seq: int, answer: Answer, media: str, method: str, route: Any, started: float
    ) -> None:
        status, body = answer
        kind = MEDIA_JSON if media == JSON or status >= 300 else MEDIA_OTHER
        writer = self.mem.answers
        self.lanes.gate.observe(method, route, status, started)
        rec = answer_record(seq, status, kind, body)
        fits = len(rec[0]) + len(body) <= writer.most()  # type: ignore[union-attr]
        if fits and writer.put(rec):  # type: ignore[union-attr]
            return
        # No room for it: the client asks again over HTTP, and its request
        # id gives it this very answer (_laneproto, MEDIA_HTTP).
        if not writer.put(answer_record(seq, status, MEDIA_HTTP, b"")):  # type: ignore[union-attr]
            self.garbled("its answer ring is full: the client does not read its answers")

    def garbled(self, why: str) -> None:
        """End the session whose lane holds what no well-behaved client writes."""
        log.warning("session %s wrote garbage into its lane (%s): the session ends", self.sid, why)
        broker = self.lanes.gate.broker
        s = broker.sessions.get(self.sid)
        self.close()
        if s is not None:
            broker.end_session(s, verified=False)

    def close(self) -> None:
        """Stop reading the lane and close the broker's descriptors (idempotent)."""
        if self.closed:
            return
        self.closed = True
        if self._again is not None:
            self._again.cancel()
        for task in list(self.tasks):
            task.cancel()
        if self.lanes.lanes.get(self.sid) is self:
            del self.lanes.lanes[self.sid]
            asyncio.get_running_loop().remove_reader(self.mem.bells[BROKER])
        self.mem.close()


class Passing:
    """A lane to hand over with an answer (the fast lane passes its
    descriptors, then starts it; a door that cannot pass them closes it)."""

    def __init__(self, lane: ShmLane) -> None:
        self.lane = lane

    def fds(self) -> list[int]:
        """The lane's memfd and bells, then the board of newest versions (``shm._board``)."""
        return [*self.lane.mem.fds(), self.lane.lanes.gate.broker.records.board().fd]

    def passed(self) -> None:
        self.lane.lanes.start(self.lane)

    def failed(self) -> None:
        self.lane.close()
