"""The client's side of the shared-memory lane (docs/plan-lane.md): the
requests of ``LANE_ROUTES`` go as records into a ring of a memfd the broker
handed over, and their answers come back in the other ring, each side
woken by an eventfd, with no HTTP and no socket in between.

Handover (``handover``): once its session is open, a blocking ``Client``
on a unix socket asks ``POST /v1/lane`` on a connection of its own and
reads the answer's first bytes with ``socket.recv_fds``: the memfd and
the two bells come with them (``SCM_RIGHTS``), and ``LaneMemory.adopt``
checks them before anything is mapped.  Any refusal (TCP, ``--no-lane``,
an older broker, a connection that could not pass them) leaves the client
on HTTP, as it is with ``lane=False`` or ``TENSORDEPOT_LANE=0``.

A call (``ClientLane.roundtrip``) is one request at a time per client
(a thread that finds the lane busy, a long poll on it, sends its request
over HTTP), answered by its sequence number: an answer to an earlier
call that gave up waiting is dropped.  A Ctrl-C cuts the wait as it cuts
a socket's (``LaneMemory.wait`` is ``interruptible``); the request id the
record carries cancels what it was granted, as over HTTP.  While it waits, the client looks every
``_LOOK`` seconds whether the broker closed the lane (its session ended)
or died; either raises ``LaneGone`` before the request was answered, and
the caller sends it over HTTP (the lane carries only requests that may be
sent twice).  A forked child never uses its parent's lane.
"""

from __future__ import annotations

import operator
import os
import threading
import time
from typing import Any, Protocol

from .._errors import BrokerUnavailable, DepotError
from .._laneproto import MEDIA_HTTP, LaneGarbled, parse_answer, request_parts
from .._proto import SESSION_HEADER
from .._wire import Handle, HandleColumns
from ..shm._board import BoardRefused, BoardView
from ..shm._lanemem import BROKER, CLIENT, LaneMemory, LaneRefused
from ..shm._ring import RingCorrupt
from ._http import Endpoint, body_of, encode
from ._known import Known

_BATCHES = ("/v1/many/put", "/v1/many/get", "/v1/many/alloc", "/v1/many/publish")
_STEPS = ("/v1/alloc", "/v1/publish")


def on_lane(method: str, path: str) -> bool:
    """Whether a request goes on the lane (the broker's ``LANE_OPS``): stat,
    gets of a name (``/v1/tensors/...``, with their query), puts with their
    bytes inline (``/v1/put/...``), a large put's alloc and publish, and the
    batches' put, get, alloc and publish, those that fit its ring.  An
    answer too large for the answer ring comes over HTTP (``MEDIA_HTTP``)."""
    if method == "GET":
        return path == "/v1/stat" or path.startswith("/v1/tensors/")
    return method == "POST" and (path.startswith("/v1/put/") or path in _STEPS or is_batch(path))


def is_batch(path: str) -> bool:
    """Whether ``path`` (with its query) is a batch's route, whose answer may
    be as large as half the answer ring (``_aiolane`` counts it so)."""
    return path.partition("?")[0] in _BATCHES


ENV = "TENSORDEPOT_LANE"  # "0": no lane, as Client(lane=False)
_LOOK = 0.1  # seconds between looks at the lane's and the broker's state while waiting


class LaneGone(Exception):
    """The lane cannot carry this request (closed, its broker dead, full):
    send it over HTTP."""


class LaneBusy(Exception):
    """The lane cannot take this request now (another thread's request is on
    it, or this one is larger than its ring): send it over HTTP."""


class Owner(Protocol):
    """The client core a lane serves (``_core.Core``)."""

    endpoint: Endpoint
    sid: str
    timeout: float
    transport: Any
    lane: ClientLane | None
    _lane_asked: str
    _lane_wanted: bool
    recent: dict[str, tuple[str, Handle]]
    closing: bool
    _fork_claim: str | None
    bg: Any


# -- a get answered again: the board of newest versions (shm._board) -----------------------

_RECENT = 1024  # names whose last get ``again`` remembers (all forgotten when full)


def remember(core: Owner, h: Handle) -> None:
    """A get asked the broker and was answered ``h``: kept for ``again``."""
    if h.slot is not None and h.lease is not None and h.kind == "posix":
        recent = core.recent
        if len(recent) >= _RECENT and h.name not in recent:
            recent.clear()
        recent[h.name] = (core.sid, h)


def again(core: Owner, name: str, newer_than: int) -> Handle | None:
    """The handle a get of the newest version of ``name`` (newer than
    ``newer_than``) would be answered now, if this process still holds its
    lease with no view left (``_taken_back``).  None: ask the broker."""
    got = core.recent.get(name)
    lane = core.lane
    if got is None or lane is None or lane.board is None:
        return None
    sid, h = got
    if h.version <= newer_than or h.lease is None or h.slot is None:  # (remember keeps none)
        return None
    taken = _taken_back(core, lane, lane.board, sid, h.lease, [h.slot], [h.version])
    if taken is False:
        core.recent.pop(name, None)
    return h if taken else None


def again_many(core: Owner, entry: Known, floors: list[int] | None) -> HandleColumns | None:
    """``again`` for a get_many of the batch of ``entry`` (its names, in
    their order): the columns of the last answer of it, if this process
    still holds that answer's lease of its one pack with no view left
    (``_taken_back``) and every tensor is newer than its floor.  None: ask
    the broker."""
    last = entry.last
    lane = lane_of(core) if last is not None else None
    if last is None or lane is None or lane.board is None:
        return None
    sid, cols = last
    if floors is not None and any(map(operator.ge, floors, cols.versions)):
        return None
    lease = cols.packs[0][3]
    taken = _taken_back(core, lane, lane.board, sid, lease, cols.slots, cols.versions)  # type: ignore[arg-type]
    if taken is False:
        entry.last = None
    return cols if taken else None


def _taken_back(
    core: Owner,
    lane: ClientLane,
    board: BoardView,
    sid: str,
    lease: int,
    slots: list[int],
    versions: list[int],
) -> bool | None:
    """Whether lease ``lease`` of session ``sid``, held by views of this
    process that are all gone (its release queued, never handed to a
    request), is held again: the session is still this client's, open, and
    not a forked child's before its claim; the board shows each of
    ``slots`` at its one of ``versions`` (False: it does not, a name moved
    on); the lane's broker is alive and has not closed it; and the release
    is taken back.  None: it is not, for another reason."""
    if sid != core.sid or core.closing or core._fork_claim is not None or core.bg is None:
        return None
    try:
        if board.newest_many(slots) != versions:
            return False
        if lane.gone() is not None:  # a broker killed writes its board no more
            return None
    except ValueError:  # the lane closed meanwhile (its board with it)
        return None
    # False: a view still holds it, or its release was handed to a request.
    return core.bg.take_back(sid, lease) or None


def lane_call(
    core: Owner, method: str, path: str, body: Any, headers: dict[str, str], io: float | None
) -> tuple[int, bytes] | None:
    """A request's ``(status, body)`` on ``core``'s lane, asked for first if
    this session has not asked yet; None: send it over HTTP."""
    lane = lane_of(core)
    if lane is None:
        return None
    headers, data = lane_body(body, headers)
    try:
        return lane.roundtrip(method, path, headers, data, io)
    except (LaneBusy, LaneGone, TimeoutError) as exc:
        lane_failed(core, lane, exc, method, path, io)
        return None


def lane_body(body: Any, headers: dict[str, str]) -> tuple[dict[str, str], bytes]:
    """A request's headers (with its content type) and body bytes, for a lane record."""
    if body is None:
        return headers, b""
    data, ctype = body_of(body)
    return {**headers, "content-type": ctype}, data


def lane_failed(
    core: Owner, lane: ClientLane, exc: BaseException, method: str, path: str, io: float | None
) -> None:
    """After a lane call that raised ``exc``: for a timeout, raise
    ``BrokerUnavailable``; else the caller sends it over HTTP (the lane is
    busy, or gone: then ``core`` forgets it)."""
    if isinstance(exc, TimeoutError):
        raise BrokerUnavailable(
            f"the broker did not answer {method} {path} on its lane within {io} s"
        ) from None
    if isinstance(exc, LaneGone) and core.lane is lane:
        core.lane = None


def lane_of(core: Owner) -> ClientLane | None:
    """``core``'s lane, asked for first (blocking: the handover) if it wants
    one and this session has not asked yet; None: none."""
    lane = core.lane
    if lane is not None and not lane.usable():
        core.lane = lane = None
    if lane is None and core._lane_wanted and core._lane_asked != core.sid:
        core._lane_asked = core.sid
        take_lane(core)
        lane = core.lane
    return lane


def take_lane(core: Owner) -> None:
    """The session's lane as ``core.lane`` (blocking: the handover), the
    lane of an earlier session closed; None if the broker refused it."""
    old, core.lane = core.lane, None
    if old is not None:
        old.close()
    core.lane = _ask(core)


def _ask(core: Owner) -> ClientLane | None:
    """The session's lane (``POST /v1/lane``, its descriptors with the
    answer), or None: the broker refused it, or could not pass it."""
    head, data = encode(core.endpoint, "POST", "/v1/lane", None, {SESSION_HEADER: core.sid})
    try:
        status, _, fds, pid = core.transport.handover(head, data, core.timeout)
    except (OSError, DepotError):
        return None
    return adopt(fds, pid) if status == 200 else None


def wanted(lane: bool | None) -> bool:
    """Whether a client asks for a lane: ``lane`` if given, else the environment."""
    if lane is not None:
        return bool(lane)
    return os.environ.get(ENV, "1").strip().lower() not in ("0", "false", "no", "off")


def adopt(fds: list[int], broker_pid: int | None) -> ClientLane | None:
    """The lane of descriptors a handover passed (``LaneMemory.adopt``), and
    the board of newest versions after them (``shm._board``) if one came;
    None (each closed) if they are not one."""
    board = None
    if len(fds) == 4:
        try:
            board = BoardView(fds.pop())
        except BoardRefused:
            pass  # a lane without a board: every get asks the broker
    try:
        return ClientLane(LaneMemory.adopt(fds), broker_pid, board)
    except LaneRefused:
        if board is not None:
            board.close()
        return None


class ClientLane:
    """A lane this process adopted."""

    def __init__(self, mem: LaneMemory, broker_pid: int | None, board: BoardView | None) -> None:
        self.mem = mem
        self.board = board
        self.pid = os.getpid()
        self.broker_pid = broker_pid
        self._lock = threading.Lock()
        self._seq = 0
        self.closed = False

    def usable(self) -> bool:
        return not self.closed and self.pid == os.getpid()

    def roundtrip(
        self, method: str, target: str, headers: dict[str, str], body: bytes, timeout: float | None
    ) -> tuple[int, bytes]:
        """One request's ``(status, body)``; raises ``LaneGone`` (send it over
        HTTP) or ``TimeoutError``."""
        if not self._lock.acquire(blocking=False):  # one request at a time: a long poll
            raise LaneBusy  # holds the lane, and the other threads keep HTTP meanwhile
        try:
            mem = self.mem
            try:
                seq = self.send(method, target, headers, body, full=LaneGone)
                deadline = None if timeout is None else time.monotonic() + timeout
                while True:
                    back = mem.answers.take()  # type: ignore[union-attr]
                    if back is not None:
                        got, status, media, answer = parse_answer(back)
                        if got == seq:
                            if media == MEDIA_HTTP:  # too large for the ring now
                                raise LaneBusy
                            return status, answer
                        continue  # the answer to a call that gave up waiting
                    left = None if deadline is None else deadline - time.monotonic()
                    if left is not None and left <= 0:
                        raise TimeoutError("timed out waiting for the broker on the lane")
                    if not mem.wait(CLIENT, _LOOK if left is None else min(left, _LOOK)):
                        self._look()
            except (RingCorrupt, LaneGarbled) as exc:
                self._close()
                raise LaneGone(f"the lane is corrupt ({exc})") from None
        finally:
            self._lock.release()

    def send(
        self,
        method: str,
        target: str,
        headers: dict[str, str],
        body: bytes,
        *,
        full: type[Exception],
    ) -> int:
        """Write one request's record and ring the broker, the lock held:
        its sequence number.  Raises ``LaneGone`` (closed), ``LaneBusy``
        (larger than the ring: it goes over HTTP), ``full`` when the ring
        has no room now, and ``RingCorrupt`` (the caller closes the lane)."""
        if not self.usable():
            raise LaneGone("the lane is closed")
        items = [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in headers.items()]
        mem = self.mem
        rec = request_parts(self._seq + 1, method, target, items, body)
        if len(rec[0]) + len(body) > mem.requests.most():  # type: ignore[union-attr]
            raise LaneBusy  # too large for the ring: this one goes over HTTP
        if not mem.requests.put(rec):  # type: ignore[union-attr]
            raise full("the lane's request ring is full")
        self._seq += 1
        mem.ring(BROKER)
        return self._seq

    def _look(self) -> None:
        """Raise ``LaneGone`` if the broker closed the lane or is gone."""
        why = self.gone()
        if why is not None:
            self._close()
            raise LaneGone(why)

    def gone(self) -> str | None:
        """Why the broker no longer serves this lane (it closed it, or it is
        gone), or None."""
        if self.closed or self.mem.gone():
            return "the broker closed the lane (its session ended)"
        if self.broker_pid is not None:
            try:
                os.kill(self.broker_pid, 0)
            except ProcessLookupError:
                return "the broker is gone"
            except PermissionError:
                pass  # alive, another user's
        return None

    def close(self) -> None:
        """Give the lane's memory and bells back (idempotent); in a forked
        child, only this process's copies of them."""
        with self._lock:
            self._close()

    def _close(self) -> None:
        self.closed = True
        self.mem.close()
        if self.board is not None:
            self.board.close()

    def forget(self) -> None:
        """In a forked child: close this process's copies of the parent's
        lane, without the lock (a parent's thread may have held it at fork)."""
        self._close()
