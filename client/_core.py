"""The client core: one session with a broker, written once for both drivers.

``Core`` holds what a client is, whatever drives it: the session (opened,
reopened, forked), the release riders and cancels queued by the background
thread, request ids, the mapped segments, and the lease bookkeeping of the
tensors it makes.  Its requests are generators of steps (``_http.py``):
``call`` is the one place that adds the session and the riders to a
request, gives the riders back when no answer was read, and, when the
broker no longer knows the session (it restarted, or reaped us), opens a
fresh one and sends the request once more.  The operations (``_ops.py``,
``_batch.py``, ``_cuda_ops.py``, ``_push.py``) are built from these.

A Core also runs operations itself, blocking (``run``), on a transport
given to it: the background thread (releases, heartbeats, pruning), a
``SharedTensor.publish()``, fork and close.  ``Client`` drives operations
on that same transport; ``AsyncClient`` drives them on the event loop and
leaves this one to the background thread and worker threads.
"""

from __future__ import annotations

import functools
import gc
import os
import threading
import weakref
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

from pydantic import BaseModel, ValidationError

from .._errors import BrokerUnavailable, DepotError, InvalidRequest, TensorNotFound, UnknownSession
from .._proto import REQUEST_HEADER, SESSION_HEADER
from .._wire import ForkInfo, Handle, LinkRequest, PublishRequest, SessionInfo, SessionOpen
from ..shm import _sigint
from ._background import Background
from ._checks import check_timeout, shown
from ._extent import broken, check_extent
from ._fork import GATE, gate_is_free, register
from ._http import (
    COMMIT,
    Endpoint,
    LaneStep,
    Offload,
    Op,
    Request,
    decode,
    drive,
    exchange,
    io_timeout,
    request_id,
)
from ._known import Kept
from ._segments import Segments
from ._shmlane import ClientLane, lane_body, lane_call, on_lane, wanted
from ._tensor import SharedTensor, _Lease
from ._trust import trusted_uids

T = TypeVar("T")
M = TypeVar("M", bound=BaseModel)


class _SessionEnded(Exception):
    """A request that names leases of its session found that session gone."""


_REMAP_IN_THREAD = 1 << 20  # bytes: a publish remaps a larger empty() tensor off the event loop


class Blocking(Protocol):
    """What a Core sends its own requests with (``_transport.Transport``)."""

    timeout: float

    def roundtrip(self, req: Request) -> tuple[int, bytes]: ...
    def after_fork(self) -> None: ...
    def close(self) -> None: ...


class Extension(Protocol):
    """Per-client state of another memory kind (CUDA: ``_cuda_handles``)."""

    def prune(self, core: Core, *, foreground: bool = False) -> None: ...
    def before_close(self, core: Core) -> None: ...


class Core:
    """A client's session and state (see the module docstring).  ``open``:
    open the session now (else the first call opens it)."""

    closed = True  # until built: __del__ of a half-built one does nothing
    bg: Background | None = None
    session: SessionInfo | None = None
    gpu: Extension | None = None  # set by the CUDA code on first use

    def __init__(
        self,
        url: str,
        *,
        token: str | None,
        timeout: float,
        label: str | None,
        trust_uid: Any,
        transport: Callable[..., Blocking],
        open: bool,
        lane: bool | None = False,
    ) -> None:
        _sigint.install()  # Ctrl-C lands in waits, never in bookkeeping
        self.url = url
        self.pid = os.getpid()
        io = check_timeout(timeout, "timeout")
        if not io:
            raise InvalidRequest(f"timeout must be a positive number of seconds, not {timeout!r}")
        self.timeout = io
        self.token = token
        self.trust = trusted_uids(trust_uid)
        self.endpoint = Endpoint.parse(url, token)
        self.transport = transport(url, token=token, timeout=io, trust=self.trust)
        self.segments = Segments(self.trust)
        self.gate = GATE  # held across fork(): no lease is registered meanwhile
        self._lock = threading.Lock()  # a forked child's claim
        self._finishing = threading.Lock()  # held while the session is being ended
        self.writers: weakref.WeakSet[Any] = weakref.WeakSet()  # empty() windows not yet private
        self.sid = ""
        self.label = label
        self.closing = False
        self.round_trips = 0  # control-plane requests sent (releases included)
        self._fork_claim: str | None = None  # a forked child's session, until claimed
        # The shared-memory lane (_shmlane): asked for once per session, by the
        # first call that may go on it, on a unix socket only.
        self._lane_wanted = wanted(lane) and self.endpoint.path is not None
        self.lane: ClientLane | None = None
        self._lane_asked = ""  # the session a lane was last asked for
        self.lane_steps = False  # an AsyncClient's: its driver sends them (``LaneStep``)
        # The last get's handle of each name, while its lease may still be
        # released later (``_shmlane.again``): (session, handle).
        self.recent: dict[str, tuple[str, Handle]] = {}
        self.known: Kept = {}  # batches' columns by their names (_known)
        try:
            if open:
                self.run(self.open_session(""))
        except BaseException:
            self.transport.close()  # a refused session (401, 503) must not leak its connection
            raise
        self.closed = False
        self.bg = Background(self)
        self.bg.heartbeat = self.session.heartbeat_interval if self.session else None
        register(self)

    def run(self, op: Op[T]) -> T:
        """Run ``op`` here, blocking, on this Core's own transport."""
        return drive(op, self.transport.roundtrip)

    # -- requests ----------------------------------------------------------------------------
    def exchange(
        self,
        method: str,
        path: str,
        body: Any = None,
        headers: dict[str, str] | None = None,
        *,
        timeout: float | bool | None = False,
        resend: bool = True,
        keep: bool = False,
        opens: bool = False,
    ) -> Op[tuple[int, bytes]]:
        """One request as it is, outside ``call``'s rules: ``(status, body)``."""
        self.round_trips += 1
        return (
            yield from exchange(
                self.endpoint,
                method,
                path,
                body,
                headers,
                timeout=io_timeout(timeout, self.timeout),
                resend=resend,
                keep=keep,
                opens=opens,
            )
        )

    def open_session(self, stale: str) -> Op[None]:
        """Open a session, unless one other than ``stale`` is open already."""
        if self.sid != stale:
            return
        body = SessionOpen(
            pid=os.getpid(),
            label=self.label,
            holding=[] if self.bg is None else self.bg.holding(stale),
        )
        answer = yield from self.exchange("POST", "/v1/sessions", body, keep=True, opens=True)
        if self.sid == stale:  # concurrent callers share one answer
            self.set_session(SessionInfo.model_validate(decode(*answer)))

    def reopen(self, stale: str) -> None:
        """The background thread found ``stale`` ended (this process was paused
        past its TTL, or the broker restarted): open the next session now.

        A closing client whose views are alive opens one too: its heartbeats
        name the lapsed session while those views hold its leases, which keeps
        their memory retired past ``--lapse-grace``; it ends with the last view
        (``_maybe_finish_close``)."""
        if self.closed or (self.closing and not (self.bg is not None and self.bg.live)):
            return
        if not self._finishing.acquire(blocking=False):
            return  # close() is ending the session now; the next heartbeat looks again
        try:
            if not self.closed:
                self.run(self.open_session(stale))
        finally:
            self._finishing.release()

    @property
    def instance(self) -> str:  # the run of the broker the session is with ("" before one)
        return self.session.instance if self.session is not None else ""

    def set_session(self, info: SessionInfo) -> None:
        self.session = info
        self.sid = info.session
        if self.bg is not None:
            self.bg.heartbeat = info.heartbeat_interval

    def call(
        self,
        method: str,
        path: str,
        body: Any = None,
        *,
        timeout: float | bool | None = False,
        rid: str | None = None,
        grants: bool = False,
        raw: bool = False,
        keep: bool = False,
        background: bool = False,
        bound: bool = False,
    ) -> Op[Any]:
        """One request under this session: its decoded JSON (``raw``: its bytes).

        ``rid``: a request id, which makes it safe to resend; ``grants``: it
        takes leases, which are cancelled if its answer is never read;
        ``keep``: see ``Request``; ``background``: the background thread's
        own (no riders, no reopened session); ``bound``: its body names
        leases of this session, so it is never sent again under a fresh one
        (``_SessionEnded`` is raised once that is open)."""
        if not background:
            if self.closed or self.closing:
                raise InvalidRequest("this client is closed; create a new one")
            if self._fork_claim is not None:
                self.claim_if_forked()
        if not self.sid:
            yield from self.open_session("")
        headers, ids, rids = self.headers(rid, carry=not background)
        sid = self.sid
        resend = rid is not None or method != "POST"
        io = io_timeout(timeout, self.timeout)
        self.round_trips += 1
        try:
            got = None
            if not background and on_lane(method, path):
                if self._lane_wanted:
                    got = lane_call(self, method, path, body, headers, io)
                elif self.lane_steps and self.lane is not None:  # an AsyncClient's (_aiolane)
                    got = yield LaneStep(method, path, *lane_body(body, headers), io, keep=keep)
            if got is None:
                got = yield from exchange(
                    self.endpoint, method, path, body, headers, timeout=io, resend=resend, keep=keep
                )
            return decode(*got, raw)
        except DepotError as exc:
            if not getattr(exc, "answered", False) and self.bg is not None:
                self.bg.unanswered(sid, ids, rids, rid if grants else None)
            if not isinstance(exc, UnknownSession) or background:
                raise
        except BaseException:  # Ctrl-C or a cancel mid-call: the answer will never be read
            if self.bg is not None:
                self.bg.unanswered(sid, ids, rids, rid if grants else None)
            raise
        # The broker restarted or reaped us: open a fresh session and send it once more.
        yield from self.open_session(sid)
        if bound:
            raise _SessionEnded(sid)
        headers, _, _ = self.headers(rid, carry=False)
        self.round_trips += 1
        status, payload = yield from exchange(
            self.endpoint, method, path, body, headers, timeout=io, resend=resend, keep=keep
        )
        return decode(status, payload, raw)

    def call_now(self, method: str, path: str, body: Any = None, **kw: Any) -> Any:
        """``call``, run here (blocking)."""
        return self.run(self.call(method, path, body, **kw))

    def headers(
        self, rid: str | None, *, carry: bool
    ) -> tuple[dict[str, str], list[int], list[str]]:
        """A request's session headers, and (``carry``) the queued releases and
        cancels riding on it (``Background.riders``)."""
        headers = {SESSION_HEADER: self.sid}
        if rid is not None:
            headers[REQUEST_HEADER] = rid
        bg = self.bg
        ids, rids = bg.riders(headers) if carry and bg is not None else ([], [])
        return headers, ids, rids

    rid = staticmethod(request_id)

    # -- allocations -------------------------------------------------------------------------
    def granted(
        self,
        model: type[M],
        method: str,
        path: str,
        body: Any = None,
        *,
        timeout: float | bool | None = False,
        keep: bool = False,
    ) -> Op[M]:
        """A request that takes leases or memory (a get, an allocation): its
        answer as ``model``.  An answer that is not one (a broken or impostor
        broker) raises ``TensorBroken``, and what the request was granted is
        cancelled: the broker gives it back."""
        rid = self.rid()
        raw = yield from self.call(
            method, path, body, timeout=timeout, rid=rid, grants=True, raw=True, keep=keep
        )
        try:
            return model.model_validate_json(raw)
        except BaseException as exc:  # Ctrl-C too: nobody holds what was granted
            if self.bg is not None:
                self.bg.cancel_later(self.sid, rid)
            if not isinstance(exc, ValueError):  # pydantic's ValidationError, JSON that is not JSON
                raise
            first = exc.errors()[0] if isinstance(exc, ValidationError) and exc.errors() else exc
            raise broken(
                f"{method} {path.split('?')[0]}",
                f"its answer is not a {model.__name__} ({shown(first, 200)})",
            ) from None

    def alloc(self, body: Any, model: type[M], path: str = "/v1/alloc") -> Op[M]:
        """An allocation (``keep``: an asyncio caller cancelled meanwhile still
        gets it, and gives it back), as ``model``."""
        return (yield from self.granted(model, "POST", path, body, keep=True))

    def abort(self, name: str, version: int) -> Op[None]:
        """Give back an allocation that will not be published (best effort: if
        the broker is gone, so is the allocation)."""
        try:
            yield from self.call(
                "POST", "/v1/abort", PublishRequest(name=name, version=version), rid=self.rid()
            )
        except DepotError:
            pass

    def give_back(self, handles: list[Handle]) -> Op[None]:
        """Give back allocations, and release their writers' holds."""
        for h in handles:
            if h.lease is not None and self.bg is not None:
                self.bg.release_later(self.sid, h.lease)
        for h in handles:
            yield from self.abort(h.name, h.version)

    def link(self, name: str, t: SharedTensor, ttl: float | None) -> Op[int | None]:
        """Put ``t``, a published tensor of this client, as a new version of
        ``name`` that shares its bytes (no copy): the new version, or None
        when ``t``'s lease is not one of the current session, whose ids name
        nothing, or other tensors, now (the broker restarted, or reaped the
        session it was taken in): then the caller copies ``t``."""
        lease = t._lease_id()
        if lease is None or t._lease_session != self.sid:
            return None
        body = LinkRequest.model_construct(name=name, lease=lease, ttl=ttl, source=t.name)
        try:
            answer = yield from self.call("POST", "/v1/link", body, rid=self.rid(), bound=True)
        except _SessionEnded:
            return None  # found out just now
        return int(answer["version"])

    def publish(self, name: str, version: int) -> Op[None]:
        yield from self.call(
            "POST",
            "/v1/publish",
            PublishRequest(name=name, version=version),
            rid=self.rid(),
            keep=True,
        )

    def publish_tensor(self, t: SharedTensor) -> Op[SharedTensor]:
        """Publish an ``empty()`` tensor of this Core's (checked by the caller):
        its window turns private first, then the broker publishes (M2)."""
        yield Offload(t._seal, cheap=t.nbytes < _REMAP_IN_THREAD)  # a large one: off the loop
        try:
            yield from self.publish(t.name, t.version)
        except (BrokerUnavailable, TensorNotFound) as exc:
            raise t._broken(exc) from exc
        t.published = True
        return t

    def publish_now(self, t: SharedTensor) -> None:
        """``SharedTensor.publish()``: ``publish_tensor``, here."""
        self.run(self.publish_tensor(t))

    # -- tensors -----------------------------------------------------------------------------
    def map_cheaply(self, kind: str) -> bool:
        """Whether mapping tensors of this kind never waits: one lazy mmap per
        tensor, no page touched, no lock that another thread holds."""
        return kind == "posix" and not self.segments.lock.locked() and gate_is_free()

    def posix_tensor(self, h: Handle, *, writable: bool) -> SharedTensor:
        """The tensor of a shared-memory handle (its operation gives back what
        the broker handed out if this raises)."""
        try:
            f = self.segments.file(h.segment, writable)
            check_extent(h, f.size, h.offset, h.nbytes, h.shape, h.strides, h.dtype)
            # A reader's view is private, lent from a kept mapping; a writer's is shared.
            w = (
                f.window(h.offset, h.nbytes, writable=True)
                if writable
                else self.segments.reader(h.segment, h.offset, h.nbytes)
            )
        except OSError as exc:  # the operation gives back what the broker handed out
            raise BrokerUnavailable(f"cannot map segment {h.segment}: {exc}") from exc
        lease = None
        with self.gate:
            if h.lease is not None and self.bg is not None:
                lease = _Lease(h.lease, functools.partial(self.bg.release_later, self.sid))
                self.bg.track(self.sid, h.lease)
            if writable:
                self.writers.add(w)
        t = SharedTensor(self, h, w, lease, writable=writable)
        t._lease_session = self.sid
        return t

    def written(self, t: SharedTensor, h: Handle) -> Op[SharedTensor]:
        """Hand out ``t``, an ``empty()`` tensor of allocation ``h``; a caller
        cancelled at this point gives both back."""
        try:
            yield COMMIT
        except BaseException:
            t.release()
            yield from self.give_back([h])
            raise
        return t

    def prune(self) -> None:
        """Forget what the broker freed (the background thread, every 2 s)."""
        self.segments.prune()
        if self.gpu is not None:
            self.gpu.prune(self)

    # -- fork --------------------------------------------------------------------------------
    def _plan_fork(self) -> ForkInfo | None:
        """In the parent, just before fork() (the gate held, so no lease is
        registered until the fork is done): ask the broker for a session for
        the child holding copies of this session's leases, so the views the
        child inherits stay theirs."""
        bg = self.bg
        if self.closed or bg is None or not bg.live or os.getpid() != self.pid:
            return None
        try:
            return ForkInfo.model_validate(
                self.call_now(
                    "POST", f"/v1/sessions/{self.sid}/fork", background=True, rid=self.rid()
                )
            )
        except DepotError:
            return None  # the child's inherited views stay readable; see below

    def _after_fork_child(self, plan: ForkInfo | None) -> None:
        if self.lane is not None:  # the parent's: this process asks its own
            self.lane.forget()
            self.lane = None
        self.recent = {}
        self._lock = threading.Lock()
        self._finishing = threading.Lock()
        self.segments.after_fork()
        self.pid = os.getpid()
        self.transport.after_fork()
        for w in list(self.writers):
            # The parent's unpublished buffers: the child's copy of them is
            # private, as the rest of its memory is after fork().
            w.make_private()
        if self.closed or self.bg is None:
            return
        renamed = {}
        if plan is not None:
            renamed = {
                (self.sid, int(old)): (plan.session, new) for old, new in plan.leases.items()
            }
            self.sid = plan.session
            self._fork_claim = plan.session
        else:
            self.sid = ""  # the child opens its own session on its first call
        self.bg.after_fork(renamed)

    def claim_if_forked(self) -> None:
        """In a forked child, before its first request: claim the session made
        for it (blocking, once; an asyncio caller runs it in a thread)."""
        sid = self._fork_claim
        if sid is None:
            return
        with self._lock:
            if self._fork_claim is None:
                return
            self._fork_claim = None
            try:
                answer = self.run(
                    self.exchange(
                        "POST", f"/v1/sessions/{sid}/claim", headers={SESSION_HEADER: sid}
                    )
                )
                self.set_session(SessionInfo.model_validate(decode(*answer)))
            except DepotError:
                self.sid = ""  # gone (the broker restarted, or the claim came too late)

    @property
    def forked(self) -> bool:
        """A forked child's session waits to be claimed."""
        return self._fork_claim is not None

    # -- closing -----------------------------------------------------------------------------
    def close(self) -> None:
        """End the session (blocking).  Never raises."""
        if self.closed or self.closing:
            return
        if self.gpu is not None:
            try:
                self.gpu.before_close(self)  # readers of this client's share()s release first
            except DepotError:
                pass
        self.closing = True
        self.recent = {}
        self.segments.clear()
        # Views caught in reference cycles, this client's or garbage of the
        # process's (an error's traceback frames), would otherwise hold leases.
        # No lease held: nothing to collect (a full collection costs 0.1 s
        # with torch loaded).
        if self.bg is None or self.bg.live:
            gc.collect()
        self._maybe_finish_close()

    def _at_exit(self) -> None:
        """The process exits normally: end the session on the way out, so the
        broker counts an exit, not a crash.  With views alive (they die with
        the process) the broker is told so, and ends the session once the
        process is gone."""
        if self.closed or os.getpid() != self.pid or self._fork_claim is not None:
            return
        if self.bg is None or not self.bg.live:
            self.close()
            return
        self._end_session("?exit=1")

    def _end_session(self, query: str = "") -> None:
        """Ask the broker to end the session (``?exit=1``: once the process is
        gone); best effort: if the broker is gone, so is the session."""
        if not self.sid:
            return
        try:
            self.run(
                self.exchange(
                    "DELETE", f"/v1/sessions/{self.sid}{query}", headers={SESSION_HEADER: self.sid}
                )
            )
        except DepotError:
            pass

    def _maybe_finish_close(self) -> None:
        if not self.closing:
            return
        # close() and the background thread may both get here.  close() waits
        # until whichever came first has ended the session (``closed`` is set
        # before the session is ended), so that it never returns while the
        # session is still open; the background thread never waits (close()
        # may be joining it).
        bg_thread = self.bg is not None and threading.current_thread() is self.bg.thread
        if not self._finishing.acquire(blocking=not bg_thread):
            return
        try:
            with self._lock:
                if self.closed:
                    return
                if self.bg is not None:
                    self.bg.flush()
                if self.bg is not None and self.bg.live:
                    return  # the background thread retries as views die
                self.closed = True
            self._end_session()
            if self.bg is not None:
                self.bg.stop()
            self.transport.close()
            if self.lane is not None:
                self.lane.close()
        finally:
            self._finishing.release()

    def __del__(self) -> None:
        if not self.closed and self.bg is not None:
            self.bg._stop = True
