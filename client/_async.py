"""AsyncClient: the Client's API for asyncio programs (inference servers).

Two halves:

* **The control plane is native asyncio.**  Requests go out on non-blocking
  sockets driven by the running event loop (``loop.add_reader`` and
  ``add_writer``), with the same request bytes, HTTP parser (httptools),
  resend rules and error mapping as the threaded client (``_transport.py``
  holds the pieces both use).  A small pool keeps idle connections, so
  concurrent calls each get one and never queue behind a long poll.  An idle
  connection is a plain socket that the loop does not watch: a forked child
  drops the ones it inherited by closing its copies of their fds, never
  touching the parent's event loop (asyncio's epoll instance is shared
  across fork).
* **The state is a Client** (``_Core``) that opens its session on the first
  call instead of in its constructor: segment files and mappings, leases and
  their release by the background thread, heartbeats, fork safety (README,
  Lifetime: M8), the trust checks on segments.  SharedTensors are the same
  objects as the Client's, with the same lease lifetime.  The Core's own
  (blocking) transport is used only off the event loop: by the background
  thread, and in worker threads.

What never runs on the event loop: the copy of a put (in the copy threads,
through ``run_in_executor``), mapping a whole segment for it
(``MAP_POPULATE``), the remap of a large ``empty()`` tensor at publish, GPU
work, and waiting on a lock that another thread holds (mapping a tensor
moves to a worker thread while the Core's locks are taken).

Cancellation (README, Lifetime: M4): a call may be cancelled at any await
and leaves nothing behind.

* A request whose answer is never read closes its connection (the broker
  stops waiting when a client hangs up), and a get's request id is queued
  for cancelling (``Background.cancel_later``), so a lease granted in the
  race is released.
* An allocation (put, put_many, empty) is requested in a task that a cancel
  does not stop: whatever it gets is given back.
* A copy thread is never stopped halfway: a cancelled put gives its
  allocation back once no copy thread writes into it (``_Handoff``), and
  ``aclose()`` waits for such work before the session ends.
* A publish, once sent, completes in the background.
"""

from __future__ import annotations

import asyncio
import builtins
import functools
import os
import secrets
import socket
from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any, TypeVar
from urllib.parse import quote

from .._defaults import ENV_TOKEN
from .._errors import BrokerUnavailable, DepotError, InvalidRequest, TensorNotFound
from .._proto import UNKNOWN_SESSION
from .._wire import Handle, SessionInfo, Stat, TensorInfo
from . import _cuda_ops
from ._checks import (
    check_floors,
    check_mapping,
    check_name,
    check_names,
    check_shape,
    check_timeout,
    check_ttl,
)
from ._client import Client, _inline, alloc_body, get_request
from ._source import Source, dtype_name
from ._tensor import SharedTensor
from ._transport import (
    FAILURES,
    Answer,
    Endpoint,
    decode_answer,
    encode,
    fail,
    io_timeout,
    may_resend,
)
from ._trust import check_broker_socket

if TYPE_CHECKING:
    from typing_extensions import Self

T = TypeVar("T")
_MAX_IDLE = 64  # idle connections kept; more are closed when they come back
_RECV = 262144
_REMAP_IN_THREAD = 1 << 20  # bytes: a publish remaps a larger empty() tensor off the loop


def _rid() -> str:
    return secrets.token_hex(12)


# -- the control plane ---------------------------------------------------------------------------


def _expire(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_exception(TimeoutError())


def _wake(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


async def _ready(sock: socket.socket, *, write: bool, deadline: float | None) -> None:
    """Wait until ``sock`` can be read (or written), or raise TimeoutError at
    ``deadline`` (the loop's clock).  The loop watches the fd only meanwhile."""
    loop = asyncio.get_running_loop()
    fut: asyncio.Future[None] = loop.create_future()
    fd = sock.fileno()
    if write:
        loop.add_writer(fd, _wake, fut)
    else:
        loop.add_reader(fd, _wake, fut)
    timer = None if deadline is None else loop.call_at(deadline, _expire, fut)
    try:
        await fut
    finally:
        # At once, before anyone may close the socket and reuse its fd number.
        if write:
            loop.remove_writer(fd)
        else:
            loop.remove_reader(fd)
        if timer is not None:
            timer.cancel()


async def _send(sock: socket.socket, data: bytes, deadline: float | None) -> None:
    view = memoryview(data)
    while view:
        try:
            view = view[sock.send(view) :]
        except BlockingIOError:
            await _ready(sock, write=True, deadline=deadline)


async def _recv(sock: socket.socket, deadline: float | None) -> bytes:
    while True:
        try:
            return sock.recv(_RECV)
        except BlockingIOError:
            await _ready(sock, write=False, deadline=deadline)


async def _within(deadline: float | None, aw: Awaitable[T]) -> T:
    """``aw``, or TimeoutError at ``deadline`` (for connecting only: it costs a task)."""
    if deadline is None:
        return await aw
    try:
        return await asyncio.wait_for(aw, max(0.0, deadline - asyncio.get_running_loop().time()))
    except asyncio.TimeoutError:  # not the builtin TimeoutError before Python 3.11
        raise TimeoutError() from None


class _Conn:
    """One persistent HTTP/1.1 connection, used by one request at a time."""

    sock: socket.socket | None = None
    verified = False  # the peer said it is a tensordepot broker

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None


class AsyncTransport:
    """HTTP/1.1 to the broker on the running event loop.  The rules (resending,
    the one error boundary) are ``Transport``'s."""

    def __init__(
        self, url: str, *, token: str | None, timeout: float, trust: frozenset[int]
    ) -> None:
        self._endpoint = Endpoint.parse(url, token)
        self.url = url
        self.timeout = timeout
        self._trust = trust
        self._idle: list[_Conn] = []
        self._pid = os.getpid()
        self._closed = False
        self.round_trips = 0

    async def _connect(self, deadline: float | None) -> socket.socket:
        loop = asyncio.get_running_loop()
        ep = self._endpoint
        if ep.path is not None:
            targets: list[tuple[int, Any]] = [(socket.AF_UNIX, ep.path)]
        else:
            infos = await _within(
                deadline, loop.getaddrinfo(ep.host, ep.port, type=socket.SOCK_STREAM)
            )
            targets = [(family, addr) for family, _, _, _, addr in infos]
        error = OSError(f"{ep.host} has no address")
        for family, addr in targets:
            sock = socket.socket(family, socket.SOCK_STREAM)
            try:
                sock.setblocking(False)
                await _within(deadline, loop.sock_connect(sock, addr))
                if family == socket.AF_UNIX:
                    check_broker_socket(
                        sock, addr, self._trust
                    )  # who listens there?  (UntrustedBroker)
                else:
                    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                return sock
            except OSError as exc:
                sock.close()
                error = exc
            except BaseException:
                sock.close()
                raise
        raise error

    async def _roundtrip(
        self, conn: _Conn, head: bytes, body: bytes, timeout: float | None
    ) -> tuple[int, bytes]:
        deadline = None if timeout is None else asyncio.get_running_loop().time() + timeout
        if conn.sock is None:
            conn.sock = await self._connect(deadline)
        sock = conn.sock
        await _send(sock, head + body if len(body) < 65536 else head, deadline)
        if len(body) >= 65536:
            await _send(sock, body, deadline)
        answer = Answer()
        while not answer.done:
            answer.feed(await _recv(sock, deadline))
        status, payload, keep_alive = answer.finish(conn.verified)
        conn.verified = True
        if not keep_alive:
            conn.close()
        return status, payload

    def _borrow(self) -> _Conn:
        if self._pid != os.getpid():
            self.after_fork()
        return self._idle.pop() if self._idle else _Conn()

    def _give_back(self, conn: _Conn) -> None:
        if (
            conn.sock is not None
            and not self._closed
            and self._pid == os.getpid()
            and len(self._idle) < _MAX_IDLE
        ):
            self._idle.append(conn)
        else:
            conn.close()

    def after_fork(self) -> None:
        """In a forked child: close our copies of the parent's idle connections
        (that sends nothing: the parent still holds them), and start afresh."""
        for conn in self._idle:
            conn.close()
        self._idle = []
        self._pid = os.getpid()

    async def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        *,
        headers: dict[str, str] | None = None,
        timeout: float | bool | None = False,
        resend: bool = True,
    ) -> Any:
        """Send one request; return the decoded JSON (None for 204).  Raises
        DepotError.  Cancelled, it closes its connection."""
        head, data = encode(self._endpoint, method, path, body, headers)
        t = io_timeout(timeout, self.timeout)
        where = f"{method} {path.split('?')[0]}"
        conn = self._borrow()
        self.round_trips += 1
        try:
            for attempt in (0, 1):
                reused = conn.sock is not None
                try:
                    status, payload = await self._roundtrip(conn, head, data, t)
                    break
                except FAILURES as exc:
                    conn.close()
                    if may_resend(exc, attempt, resend=resend, reused=reused, method=method):
                        continue
                    fail(exc, self.url, where, t)
        except BaseException:
            conn.close()  # cancelled too: the broker sees the hang-up and stops waiting
            raise
        self._give_back(conn)
        return decode_answer(status, payload)

    def close(self) -> None:
        """Close the idle connections; those in use close when they come back."""
        self._closed = True
        idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()


# -- the state ----------------------------------------------------------------------------------


class _Core(Client):
    """An AsyncClient's state: a Client whose session the AsyncClient opens on
    its first call.  Its own transport serves the background thread and
    worker threads, never the event loop."""

    _session_at_init = False


class _Handoff:
    """Who finishes a job whose caller may be cancelled while a worker thread
    runs it: the worker when it is done, or the caller when it gives up;
    whoever comes second cleans up.  ``list.pop`` is atomic, so exactly one of
    them takes the single item, without a lock."""

    __slots__ = ("_item", "result")

    def __init__(self) -> None:
        self._item = [None]
        self.result: list[Any] = []

    def take(self) -> bool:
        try:
            self._item.pop()
        except IndexError:
            return False
        return True


class AsyncClient:
    """A connection to a tensordepot broker for asyncio code: ``Client``'s API
    with ``await``.

    ``url``, ``token``, ``timeout``, ``label`` and ``trust_uid`` are those of
    ``Client``, checked the same way; the constructor does no I/O, and the
    session opens on ``async with`` or the first call.  Calls raise the same
    ``DepotError`` tree, return the same ``SharedTensor`` objects (their
    views keep their leases; releases go in the background) and may run
    concurrently: each takes a pooled connection of its own.  Use one
    AsyncClient from one event loop at a time.

    Every call may be cancelled (``asyncio.wait_for``, ``task.cancel()``, a
    client of your server hanging up) and leaves no lease, allocation or copy
    behind.  Copies run in worker threads; the event loop only waits for them.
    Publish an ``empty()`` tensor with ``await client.publish(t)``.

    In a child forked from this process, the AsyncClient works in the
    child's own event loop, with a session of its own (as a Client does).

    ::

        async with AsyncClient() as c:
            await c.put("w", array)
            t = await c.get("w", timeout=5.0)
            out = await c.empty("y", (1024,), "float32")
            np.from_dlpack(out)[:] = 1
            await c.publish(out)
    """

    _closed = True  # until built: __del__ of a half-built one does nothing
    _core: _Core
    _transport: AsyncTransport

    def __init__(
        self,
        url: str | None = None,
        *,
        token: str | None = None,
        timeout: float = 30.0,
        label: str | None = None,
        trust_uid: int | str | Iterable[int | str] | None = None,
    ) -> None:
        core = _Core(url, token=token, timeout=timeout, label=label, trust_uid=trust_uid)
        self._core = core
        self.url = core.url
        self._label = label
        self._transport = AsyncTransport(
            core.url,
            token=token or os.environ.get(ENV_TOKEN),
            timeout=core._transport.timeout,
            trust=core._trust,
        )
        self._pid = os.getpid()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._opening: asyncio.Future[None] | None = None  # the request that opens a session
        # Work a cancelled call left running (copies, give-backs, publishes):
        # aclose() waits for it before the session ends.
        self._pending: set[asyncio.Future[Any]] = set()
        self._closed = False

    # -- plumbing --------------------------------------------------------------------------------
    async def _session(self) -> _Core:
        """The Core, with a session of this process."""
        core = self._core
        if self._closed or core._closing or core._closed:
            raise InvalidRequest("this AsyncClient is closed; create a new one")
        loop = asyncio.get_running_loop()
        if self._pid != os.getpid():
            self._after_fork()
        if loop is not self._loop:  # tasks and futures belong to one loop
            self._loop, self._opening = loop, None
        if core._fork_claim is not None:  # a forked child: claim the session made for it
            await self._in_thread(core._claim_if_forked)
        if not core._sid:
            await self._open_session("")
        return core

    def _after_fork(self) -> None:
        """In a forked child: the parent's connections, pending work and loop
        are the parent's (its threads did not come along); the Core has
        switched to the child's session already."""
        self._transport.after_fork()
        self._pending = set()
        self._opening = None
        self._loop = None
        self._pid = os.getpid()

    async def _open_session(self, stale: str) -> None:
        """Open a session unless one other than ``stale`` is open already.
        Concurrent calls share one request, which a cancel does not stop (a
        session the broker opened is never lost)."""
        core, transport = self._core, self._transport
        opening = self._opening
        if opening is None or opening.done():
            if core._sid != stale:
                return

            async def open_one() -> None:
                body = {"pid": os.getpid(), "label": self._label}
                info = await transport.request("POST", "/v1/sessions", body)
                core._set_session(SessionInfo.model_validate(info))

            opening = self._opening = self._keep(asyncio.ensure_future(open_one()))
        await asyncio.shield(opening)

    async def _call(
        self,
        method: str,
        path: str,
        body: Any = None,
        *,
        timeout: float | bool | None = False,
        rid: str | None = None,
        grants: bool = False,
    ) -> Any:
        """One request under this session, as ``Client._call``: ``rid`` makes it
        safe to resend; ``grants``: it takes leases, which are cancelled if its
        answer is never read (the call is cancelled, or the connection fails)."""
        core = await self._session()
        headers, ids, rids = core._headers(rid, carry=True)
        sid = core._sid
        resend = rid is not None or method != "POST"
        try:
            return await self._transport.request(
                method, path, body, headers=headers, timeout=timeout, resend=resend
            )
        except DepotError as exc:
            if not getattr(exc, "answered", False):
                core._unanswered(sid, ids, rids, rid, grants)
            if getattr(exc, "code", "") != UNKNOWN_SESSION:
                raise
        except BaseException:  # cancelled: the answer will never be read
            core._unanswered(sid, ids, rids, rid, grants)
            raise
        # The broker restarted or reaped us: open a fresh session and retry once.
        await self._open_session(sid)
        headers, _, _ = core._headers(rid, carry=False)
        return await self._transport.request(
            method, path, body, headers=headers, timeout=timeout, resend=resend
        )

    def _keep(self, fut: asyncio.Future[T]) -> asyncio.Future[T]:
        """Hold ``fut``, work that may outlive a cancelled call, until it is done;
        ``aclose()`` waits for it.  A failure nobody awaits is dropped."""
        self._pending.add(fut)
        fut.add_done_callback(self._settled)
        return fut

    def _settled(self, fut: asyncio.Future[Any]) -> None:
        self._pending.discard(fut)
        if not fut.cancelled():
            fut.exception()  # retrieved: no "exception was never retrieved" in the log

    async def _in_thread(
        self, fn: Callable[..., T], *args: Any, undo: Callable[[T], None] | None = None
    ) -> T:
        """``fn(*args)`` in a worker thread; the event loop never waits on it.

        Cancelled meanwhile, the call raises at once, but ``fn`` still runs to
        its end (it may write into memory that must not be given back before
        it stops); then ``undo(result)`` runs in a worker thread to give back
        what it made.  If ``fn`` raises, it has cleaned up after itself."""
        loop = asyncio.get_running_loop()
        handoff = _Handoff()

        def job() -> T:
            result = fn(*args)
            handoff.result.append(result)
            if not handoff.take() and undo is not None:  # the caller gave up meanwhile
                undo(result)
            return result

        fut = self._keep(loop.run_in_executor(None, job))
        try:
            return await asyncio.shield(fut)
        except asyncio.CancelledError:
            if not handoff.take() and handoff.result and undo is not None:
                # The job was done as we gave up: give its result back from here.
                self._keep(loop.run_in_executor(None, undo, handoff.result[0]))
            raise

    def _give_back_later(self, handles: list[Handle]) -> None:
        """Give back allocations that will not be published, from a worker
        thread (called where nothing may be awaited: a cancelled call, a
        callback), and release their writers' holds.  Callers make sure that no
        copy still writes into them."""
        core = self._core
        for h in handles:
            if h.lease is not None and core._bg is not None:
                core._bg.release_later(core._sid, h.lease)

        def abort_all() -> None:
            for h in handles:
                core._abort(h)

        try:
            self._keep(asyncio.get_running_loop().run_in_executor(None, abort_all))
        except RuntimeError:  # the loop is closing: the session's end reclaims them
            pass

    async def _alloc(self, path: str, body: dict[str, Any], *, hold: bool = False) -> list[Handle]:
        """Allocate, in a request that a cancel does not stop: cancelled, the
        caller raises at once and whatever the broker handed out is given back."""

        async def alloc() -> list[Handle]:
            resp = await self._call("POST", path, body, rid=_rid(), grants=hold)
            return [Handle.model_validate(h) for h in resp.get("items", [resp])]

        task = self._keep(asyncio.ensure_future(alloc()))
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:

            def give_back(t: asyncio.Future[list[Handle]]) -> None:
                if not t.cancelled() and t.exception() is None:
                    self._give_back_later(t.result())

            task.add_done_callback(give_back)
            raise

    async def _fill(
        self,
        fill: Callable[[list[Handle], list[Any]], None],
        handles: list[Handle],
        sources: list[Source],
    ) -> None:
        """Copy the sources into their allocations in the copy threads; they are
        given back if the copy fails, or if this call is cancelled (once the
        copy threads have stopped writing).  Takes over closing the sources."""
        core = self._core

        def copy() -> None:
            try:
                fill(handles, [s.array for s in sources])  # gives them back if it raises
            finally:
                for s in sources:  # what DLPack lent us, once nothing reads it any more
                    s.close()

        def give_back(_: None) -> None:  # the copy is done: nothing writes into them any more
            for h in handles:
                core._abort(h)

        await self._in_thread(copy, undo=give_back)

    async def _publish(self, handles: list[Handle]) -> None:
        """Publish filled allocations; whatever stops that gives them back."""
        try:
            if len(handles) == 1:
                body = {"name": handles[0].name, "version": handles[0].version}
                await self._call("POST", "/v1/publish", body, rid=_rid())
            else:
                items = [{"name": h.name, "version": h.version} for h in handles]
                await self._call("POST", "/v1/batch/publish", {"items": items}, rid=_rid())
        except BaseException:
            # Cancelled, or failed: if the broker published them, the give-back
            # finds nothing to abort; if not, they are not left unpublished.
            self._give_back_later(handles)
            raise

    async def _mapped(
        self, handles: list[Handle], make: Callable[[], T], undo: Callable[[T], None]
    ) -> T:
        """``make()`` the tensors of ``handles``: on the loop when that cannot
        wait (a segment file opened once, one lazy mmap per tensor: no page is
        touched), else in a worker thread: GPU handles (CUDA IPC), or a Core
        lock held by another thread (a fork, a prune)."""
        core = self._core
        if all(h.kind == "posix" for h in handles) and not (
            core._lock.locked() or core._gate.locked()
        ):
            return make()
        return await self._in_thread(make, undo=undo)

    async def _tensor(self, h: Handle, *, writable: bool) -> SharedTensor:
        core = self._core

        def undo(t: SharedTensor) -> None:
            t.release()  # its lease goes with its last view
            if writable:
                core._abort(h)

        return await self._mapped([h], functools.partial(core._tensor, h, writable=writable), undo)

    # -- writing ---------------------------------------------------------------------------------
    async def put(self, name: str, x: Any, *, ttl: float | None = None, device: Any = None) -> int:
        """Copy ``x`` into broker memory as the next version of ``name``; returns the version.

        As ``Client.put``: numpy arrays, ``__dlpack__`` objects (torch, jax,
        cupy), numbers; ``ttl``; ``device``.  The copy runs in the copy threads,
        off the event loop.  Cancelled, the put publishes nothing (unless its
        publish was sent already) and gives its allocation back once the copy
        has stopped.  A GPU put runs whole in a worker thread, and completes."""
        check_name(name)
        ttl = check_ttl(ttl)
        core = await self._session()
        if _cuda_ops.involves_gpu(x, device):
            return await self._in_thread(
                functools.partial(core.put, ttl=ttl, device=device), name, x
            )
        link = core._link(name, x, ttl)
        if link is not None:
            return int((await self._call("POST", "/v1/link", link, rid=_rid()))["version"])
        src = Source(x)
        try:
            inline = _inline(name, src, ttl)
            if inline is not None:
                return int((await self._call("POST", inline[0], inline[1], rid=_rid()))["version"])
            handles = await self._alloc(
                "/v1/alloc", alloc_body(name, src.array.shape, src.dtype, ttl)
            )
        except BaseException:
            src.close()
            raise
        await self._fill(lambda hs, arrays: core._fill(hs[0], arrays[0]), handles, [src])
        await self._publish(handles)
        return handles[0].version

    async def put_many(
        self, tensors: Mapping[str, Any], *, ttl: float | None = None, device: Any = None
    ) -> dict[str, int]:
        """Put a whole state dict, as ``Client.put_many``: one round trip to
        allocate, one to publish, the copies in the copy threads.  All or
        nothing: cancelled, it gives every allocation back."""
        check_mapping(tensors)
        ttl = check_ttl(ttl)
        core = await self._session()
        if any(_cuda_ops.involves_gpu(x, device) for x in tensors.values()):
            return await self._in_thread(
                functools.partial(core.put_many, ttl=ttl, device=device), tensors
            )
        sources: dict[str, Source] = {}
        try:
            for name, x in tensors.items():
                sources[name] = Source(x, f"tensors[{name!r}]")
            items = [alloc_body(n, s.array.shape, s.dtype, ttl) for n, s in sources.items()]
            handles = await self._alloc("/v1/batch/alloc", {"items": items})
        except BaseException:
            for s in sources.values():
                s.close()
            raise
        await self._fill(core._fill_many, handles, [sources[h.name] for h in handles])
        await self._publish(handles)
        return {h.name: h.version for h in handles}

    async def empty(
        self,
        name: str,
        shape: Iterable[int],
        dtype: Any = "float32",
        *,
        device: str = "cpu",
        ttl: float | None = None,
    ) -> SharedTensor:
        """A writable tensor in broker memory, as ``Client.empty``: fill it in
        place, then ``await client.publish(t)``.  No copy is ever made."""
        check_name(name)
        dims = check_shape(shape)
        body = alloc_body(
            name, dims, dtype_name(dtype), check_ttl(ttl), _cuda_ops.wire_device(device), hold=True
        )
        (h,) = await self._alloc("/v1/alloc", body, hold=True)
        return await self._tensor(h, writable=True)  # if mapping fails, it gives h back

    async def publish(self, t: SharedTensor) -> SharedTensor:
        """Make ``t``, a tensor from this client's ``empty()``, visible to readers
        (once), and return it: ``t.publish()`` without blocking the event loop.

        Once sent, a publish completes even if this call is cancelled.  Raises
        ``TensorBroken`` if its allocation is gone (the broker died, or the
        name was deleted meanwhile)."""
        if t._publishing() is not self._core:
            raise InvalidRequest(
                f"tensor {t.name!r} came from another client; publish it with that one"
            )
        if t.device != "cpu":  # a GPU tensor first waits for its writes on the host
            await self._in_thread(t.publish)
            return t

        async def publish() -> None:
            try:
                await self._call(
                    "POST", "/v1/publish", {"name": t.name, "version": t.version}, rid=_rid()
                )
            except (BrokerUnavailable, TensorNotFound) as exc:
                raise t._broken(exc) from exc
            if t.nbytes >= _REMAP_IN_THREAD:
                await self._in_thread(t._published)
            else:
                t._published()

        await asyncio.shield(self._keep(asyncio.ensure_future(publish())))
        return t

    # -- reading ---------------------------------------------------------------------------------
    async def get(
        self, name: str, timeout: float | None = 0.0, *, newer_than: int = 0
    ) -> SharedTensor:
        """Lease the newest published version of ``name`` (read-only, zero copy),
        as ``Client.get``: ``timeout=0`` (the default) raises ``TensorNotFound``
        at once, a number waits up to that many seconds, ``None`` waits
        forever; ``newer_than=v`` waits for a version newer than ``v``.

        Cancelled while it waits, it hangs up, and a lease granted in the race
        is released."""
        path, io = get_request(name, timeout, newer_than, self._transport.timeout)
        h = Handle.model_validate(
            await self._call("GET", path, timeout=io, rid=_rid(), grants=True)
        )
        return await self._tensor(h, writable=False)

    async def get_many(
        self,
        names: Iterable[str],
        timeout: float | None = 0.0,
        *,
        newer_than: int | Mapping[str, int] = 0,
    ) -> dict[str, SharedTensor]:
        """Lease many tensors in one round trip, under one deadline (all of them,
        or an error and none), as ``Client.get_many``; ``newer_than`` too."""
        names = check_names(names)
        wait = check_timeout(timeout)
        body: dict[str, Any] = {"names": names, "timeout": wait}
        floors = check_floors(newer_than, names)
        if floors is not None:
            body["newer_than"] = floors
        io = None if wait is None else wait + self._transport.timeout
        resp = await self._call(
            "POST",
            "/v1/batch/get",
            body,
            timeout=io,
            rid=_rid(),
            grants=True,
        )
        handles = [Handle.model_validate(h) for h in resp["items"]]

        def undo(got: dict[str, SharedTensor]) -> None:
            for t in got.values():
                t.release()

        return await self._mapped(handles, functools.partial(self._core._tensors, handles), undo)

    # -- names -----------------------------------------------------------------------------------
    async def delete(self, name: str) -> None:
        """Remove ``name`` now; readers keep their bytes until they release them."""
        check_name(name)
        await self._call("DELETE", f"/v1/tensors/{quote(name, safe='/')}", rid=_rid())

    async def list(self) -> builtins.list[TensorInfo]:
        """Every name with a version, newest first per name (``TensorInfo``)."""
        return [
            TensorInfo.model_validate(i) for i in (await self._call("GET", "/v1/tensors"))["items"]
        ]

    async def stat(self) -> Stat:
        """The broker's accounting (``Stat``)."""
        return Stat.model_validate(await self._call("GET", "/v1/stat"))

    @property
    def round_trips(self) -> int:
        """Control-plane requests this client has sent (releases included)."""
        return self._transport.round_trips + self._core.round_trips

    # -- closing ---------------------------------------------------------------------------------
    async def aclose(self) -> None:
        """End the session.  Never raises (a cancel still propagates).

        Waits first for work that cancelled calls left running (copies into
        allocations, and their give-backs).  As with ``Client.close``, leases
        of views that are still alive stay held until those views are freed."""
        if self._closed:
            return
        self._closed = True
        if self._pid != os.getpid():
            self._after_fork()
        while self._pending:
            await asyncio.gather(*list(self._pending), return_exceptions=True)
        self._transport.close()
        await asyncio.get_running_loop().run_in_executor(
            None, self._core.close
        )  # sends; joins a thread

    async def __aenter__(self) -> Self:
        await self._session()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def __del__(self) -> None:
        if not self._closed:
            self._transport.close()  # our idle sockets, without a ResourceWarning each
            if self._core._bg is not None:
                self._core._bg._stop = True

    def __repr__(self) -> str:
        return f"AsyncClient({self.url!r}, session={self._core._sid[:8]})"
