"""AsyncClient: the Client's API for asyncio programs (inference servers).

It drives the same operations as ``Client`` (``_ops.py``, ``_batch.py``,
``_push.py``, written once as steps: ``_http.py``) on the running event
loop: requests on non-blocking sockets (``_aio.py``), offloaded work in
worker threads.  The state is the same ``Core`` as a Client's: segment
files and mappings, leases and their release by the background thread,
heartbeats, fork safety (README, Lifetime: M8), the trust checks on
segments.  SharedTensors are the same objects as the Client's, with the
same lease lifetime.  The Core's own (blocking) transport is used only off
the event loop: by the background thread, and in worker threads.

What never runs on the event loop: the copy of a put (in the copy threads),
mapping a whole segment for it (pre-faulted), the remap of a large
``empty()`` tensor at publish, GPU work and pushes (each run whole in a
worker thread), and waiting on a lock that another thread holds (mapping a
tensor moves to a worker thread while the Core's locks are taken).

Cancellation (README, Lifetime: M4): a call may be cancelled at any await
and leaves nothing behind.  The caller raises at once; the rest of its
operation finishes in a task of its own (``_finish``):

* A request whose answer is never read closes its connection (the broker
  stops waiting when a client hangs up), and a get's request id is queued
  for cancelling (``Background.cancel_later``), so a lease granted in the
  race is released.
* A step that makes something (an allocation, a publish, a session:
  ``Request.keep``) or offloaded work (a copy thread is never stopped
  halfway) runs to its end; then the operation stops at its next step and
  gives back what it made (``aclose()`` waits for that first).  A publish,
  once sent, therefore completes.
"""

from __future__ import annotations

import asyncio
import builtins
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeVar, overload

from .._defaults import ENV_TOKEN, default_url
from .._errors import InvalidRequest
from .._wire import Holder, Stat, TensorInfo
from . import _batch, _files, _into, _ops, _pickle, _push, _state
from ._aio import AsyncTransport
from ._aiolane import AioLane
from ._core import Core
from ._http import LaneStep, Offload, Op, Request, Step, T
from ._shmlane import LaneBusy, LaneGone, lane_failed, take_lane, wanted
from ._tensor import SharedTensor
from ._tensormap import TensorMap
from ._transport import Transport

if TYPE_CHECKING:
    from typing_extensions import Self

_T = TypeVar("_T")  # the buffer get(out=) fills and returns


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

    ``lane``: on a unix socket, the AsyncClient takes the session's
    shared-memory lane, as a Client does: its gets, small puts and stats
    go there (several at once, each answered on the event loop), and its
    board of newest versions answers a get of a tensor whose newest
    version it got last, with no view of it left, with no request.  Other
    calls, and any the lane cannot take now, go over HTTP.  ``False`` (or
    ``$TENSORDEPOT_LANE=0``) takes none.

    ::

        async with AsyncClient() as c:
            await c.put("w", array)
            t = await c.get("w", timeout=5.0)
            out = await c.empty("y", (1024,), "float32")
            np.from_dlpack(out)[:] = 1
            await c.publish(out)
    """

    _closed = True  # until built: __del__ of a half-built one does nothing
    _core: Core
    _transport: AsyncTransport

    def __init__(
        self,
        url: str | None = None,
        *,
        token: str | None = None,
        timeout: float = 30.0,
        label: str | None = None,
        trust_uid: int | str | Iterable[int | str] | None = None,
        lane: bool | None = None,
    ) -> None:
        token = token or os.environ.get(ENV_TOKEN)
        core = Core(
            url or default_url(),
            token=token,
            timeout=timeout,
            label=label,
            trust_uid=trust_uid,
            transport=Transport,
            open=False,
        )
        self._core = core
        self.url = core.url
        self._lane = wanted(lane) and core.endpoint.path is not None  # its board and requests
        core.lane_steps = self._lane
        self._aio: AioLane | None = None  # the lane's requests on the loop (_on_lane)
        self._transport = AsyncTransport(
            core.url, token=token, timeout=core.timeout, trust=core.trust
        )
        self._pid = os.getpid()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._opening: asyncio.Future[Any] | None = None  # the request that opens a session
        # Work a cancelled call left running (copies, give-backs, publishes):
        # aclose() waits for it before the session ends.
        self._pending: set[asyncio.Future[Any]] = set()
        self._closed = False

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        """As ``Client.__reduce__``: its configuration; unpickled, a fresh AsyncClient."""
        return _pickle.reduce_client(self._core, "async")

    # -- the driver ------------------------------------------------------------------------------
    async def _ready(self) -> None:
        """Before an operation: this process's own connections and loop, and
        a forked child's session claimed."""
        core = self._core
        if self._closed or core.closing or core.closed:
            raise InvalidRequest("this AsyncClient is closed; create a new one")
        loop = asyncio.get_running_loop()
        if self._pid != os.getpid():
            self._after_fork()
        if loop is not self._loop:  # tasks and futures belong to one loop
            self._loop, self._opening = loop, None
        if core.forked:  # a forked child: claim the session made for it
            await asyncio.shield(self._kept(Offload(core.claim_if_forked)))

    async def _board(self) -> None:
        """Take the session's lane, for its board (``_shmlane.again``) and
        its requests (``_on_lane``), once per session, in a worker thread
        (the handover blocks); meanwhile, and if it is refused, requests go
        over HTTP.  The lane of an earlier session is closed first, here on
        the loop, its reader taken off before its descriptors close."""
        core = self._core
        if not self._lane or not core.sid or core._lane_asked == core.sid or core.closing:
            return
        await self._ready()  # a forked child's session claimed first: the lane is its owner's
        core._lane_asked = core.sid
        self._drop_lane()
        await asyncio.shield(self._kept(Offload(take_lane, core)))

    def _drop_lane(self) -> None:
        """Close the lane (on the loop): its waiting requests go over HTTP."""
        aio, self._aio = self._aio, None
        if aio is not None:
            aio.retire()
        old, self._core.lane = self._core.lane, None
        if old is not None:
            old.close()

    async def _on_lane(self, step: LaneStep) -> tuple[int, bytes] | None:
        """``step`` on the session's lane: its ``(status, body)``, or None
        (no lane, or it cannot carry it now: send it over HTTP)."""
        core = self._core
        lane = core.lane
        if lane is None or not lane.usable():
            return None
        aio = self._aio
        if aio is None or aio.lane is not lane:
            if aio is not None:
                aio.retire()
            aio = self._aio = AioLane(lane)
        try:
            return await aio.roundtrip(step)
        except (LaneBusy, LaneGone, TimeoutError) as exc:
            if isinstance(exc, LaneGone) and self._aio is aio:
                aio.retire()  # its reader off: the lane's descriptors may close
                self._aio = None
            lane_failed(core, lane, exc, step.method, step.path, step.timeout)
            return None

    async def _drive(self, op: Op[T]) -> T:
        """Run ``op`` on the event loop.  Cancelled, the caller raises at once
        and the operation finishes in a task of its own (``_finish``)."""
        await self._ready()
        try:
            step = next(op)
            while True:
                kept = None
                result: Any
                try:
                    if type(step) is Request and not step.keep:
                        result = await self._transport.roundtrip(step)
                    elif type(step) is LaneStep and not step.keep:
                        result = await self._on_lane(step)
                    elif type(step) is Offload and step.cheap:
                        result = step.fn(*step.args)
                    else:
                        kept = self._kept(step)
                        result = await asyncio.shield(kept)
                except asyncio.CancelledError:
                    self._keep(asyncio.ensure_future(self._finish(op, kept)))
                    raise
                except BaseException as exc:
                    step = op.throw(exc)
                    continue
                step = op.send(result)
        except StopIteration as stop:
            return stop.value  # type: ignore[no-any-return]

    def _kept(self, step: Step) -> asyncio.Future[Any]:
        """``step`` in a future that runs to its end whatever happens to its
        caller: a request in a task (concurrent session opens share one), an
        offload in a worker thread."""
        loop = asyncio.get_running_loop()
        if type(step) is Offload:
            return self._keep(loop.run_in_executor(None, step.fn, *step.args))
        if type(step) is LaneStep:
            return self._keep(asyncio.ensure_future(self._on_lane(step)))
        assert type(step) is Request
        if step.opens and self._opening is not None and not self._opening.done():
            return self._opening
        fut = self._keep(asyncio.ensure_future(self._transport.roundtrip(step)))
        if step.opens:
            self._opening = fut
        return fut

    async def _finish(self, op: Op[Any], kept: asyncio.Future[Any] | None) -> None:
        """The rest of an operation whose caller was cancelled: ``kept``, the
        step in flight, completes; then the operation stops at its next step
        (a ``CancelledError`` there) and runs its clean-up to its end."""
        try:
            if kept is not None:
                try:
                    result = await kept
                except BaseException as exc:
                    op.throw(exc)
                else:
                    op.send(result)
            step = op.throw(asyncio.CancelledError())
            while True:
                try:
                    result = await self._kept(step)
                except BaseException as exc:
                    step = op.throw(exc)
                else:
                    step = op.send(result)
        except (Exception, asyncio.CancelledError):  # its end, or its clean-up failing
            pass

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

    def _after_fork(self) -> None:
        """In a forked child: the parent's connections, pending work and loop
        are the parent's (its threads did not come along); the Core has
        switched to the child's session already."""
        self._transport.after_fork()
        if self._aio is not None:  # the parent's: its loop is never touched here
            self._aio.forget()
            self._aio = None
        self._pending = set()
        self._opening = None
        self._loop = None
        self._pid = os.getpid()

    # -- writing ---------------------------------------------------------------------------------
    async def put(
        self, name: str, x: Any, *, ttl: float | None = None, device: Any = None, dtype: Any = None
    ) -> int:
        """Copy ``x`` into broker memory as the next version of ``name``; returns the version.

        As ``Client.put``: numpy arrays, ``__dlpack__`` objects (torch, jax,
        cupy), Python numbers and lists with ``dtype``; ``ttl``; ``device``.
        The copy runs in the copy threads,
        off the event loop.  Cancelled, the put publishes nothing (unless its
        publish was sent already) and gives its allocation back once the copy
        has stopped.  A GPU put runs whole in a worker thread, and completes."""
        await self._board()
        return await self._drive(_ops.put(self._core, name, x, ttl, device, dtype))

    async def put_many(
        self, tensors: Mapping[str, Any], *, ttl: float | None = None, device: Any = None
    ) -> dict[str, int]:
        """Put a whole state dict, as ``Client.put_many``: one round trip to
        allocate, one to publish, the copies in the copy threads.  All or
        nothing: cancelled, it gives every allocation back."""
        return await self._drive(_batch.put_many(self._core, tensors, ttl, device))

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
        return await self._drive(_ops.empty(self._core, name, shape, dtype, device, ttl))

    async def publish(self, t: SharedTensor) -> SharedTensor:
        """Make ``t``, a tensor from this client's ``empty()``, visible to readers
        (once), and return it: ``t.publish()`` without blocking the event loop.

        Once sent, a publish completes even if this call is cancelled.  Raises
        ``TensorBroken`` if its allocation is gone (the broker died, or the
        name was deleted meanwhile)."""
        return await self._drive(_ops.publish(self._core, t))

    async def share(
        self,
        name: str,
        tensor: Any,
        *,
        ttl: float | None = None,
        stream: Any = None,
        wait_on_close: float = 30.0,
    ) -> int:
        """Publish a GPU tensor's own memory as the next version of ``name``,
        without a copy, as ``Client.share`` (the same lifetime: the name is
        withdrawn when this client's session ends).  It runs whole in a
        worker thread, and completes."""
        return await self._drive(_ops.share(self._core, name, tensor, ttl, stream, wait_on_close))

    async def put_state_dict(
        self, prefix: str, state_dict: Any, *, ttl: float | None = None
    ) -> int:
        """As ``Client.put_state_dict``: a nested state dict under ``prefix``."""
        return await self._drive(_state.put_state_dict(self._core, prefix, state_dict, ttl))

    async def get_state_dict(self, prefix: str, timeout: float | None = 0.0) -> Any:
        """As ``Client.get_state_dict``: the state dict under ``prefix``, rebuilt."""
        return await self._drive(_state.get_state_dict(self._core, prefix, timeout))

    # -- reading ---------------------------------------------------------------------------------
    @overload
    async def get(
        self,
        name: str,
        timeout: float | None = 0.0,
        *,
        newer_than: int | None = 0,
        version: int | None = None,
        out: None = None,
    ) -> SharedTensor: ...
    @overload
    async def get(
        self,
        name: str,
        timeout: float | None = 0.0,
        *,
        newer_than: int | None = 0,
        version: int | None = None,
        out: _T,
    ) -> _T: ...
    async def get(
        self,
        name: str,
        timeout: float | None = 0.0,
        *,
        newer_than: int | None = 0,
        version: int | None = None,
        out: Any = None,
    ) -> Any:
        """Lease the newest published version of ``name`` (read-only, zero copy),
        as ``Client.get``: ``timeout=0`` (the default) raises ``TensorNotFound``
        at once, a number waits up to that many seconds, ``None`` waits
        forever; ``newer_than=v`` waits for a version newer than ``v``;
        ``version=v`` leases exactly ``v`` while it lives; ``out=buffer``
        copies into ``buffer`` (off the event loop) and returns it.

        Cancelled while it waits, it hangs up, and a lease granted in the race
        is released."""
        if out is not None:
            return await self._drive(
                _into.get_into(self._core, name, timeout, newer_than, version, out)
            )
        await self._board()
        return await self._drive(_ops.get(self._core, name, timeout, newer_than, version))

    async def get_many(
        self,
        names: Iterable[str],
        timeout: float | None = 0.0,
        *,
        newer_than: int | Mapping[str, int] = 0,
        wait: str = "all",
        out: Mapping[str, Any] | None = None,
    ) -> TensorMap:
        """Lease many tensors in one round trip, under one deadline (all of them,
        or an error and none), as ``Client.get_many``; ``newer_than``,
        ``wait`` and ``out`` too."""
        if out is not None:
            return await self._drive(
                _into.get_many_into(self._core, names, timeout, newer_than, wait, out)
            )
        await self._board()
        return await self._drive(_batch.get_many(self._core, names, timeout, newer_than, wait))

    async def push(
        self,
        name: str,
        to: str,
        *,
        token: str | None = None,
        tls_ca: str | bytes | None = None,
        timeout: float | None = None,
    ) -> int:
        """Send the newest version of ``name`` to the broker on another host whose
        Flight endpoint is ``to``, as ``Client.push``; returns its version
        there.  It runs whole in a worker thread, and completes."""
        return await self._drive(_push.push(self._core, name, to, token, tls_ca, timeout))

    # -- files -----------------------------------------------------------------------------------
    async def load_file(
        self,
        path: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
        prefix: str = "",
        *,
        ttl: float | None = None,
        progress: Callable[[int, int], None] | None = None,
    ) -> dict[str, int]:
        """As ``Client.load_file``; the copy runs off the event loop."""
        return await self._drive(_files.load_file(self._core, path, prefix, ttl, progress))

    async def save_file(
        self,
        prefix: str,
        path: str | os.PathLike[str],
        *,
        progress: Callable[[int, int], None] | None = None,
        max_shard_size: int | str | None = None,
    ) -> int:
        """As ``Client.save_file``; the files are written off the event loop."""
        return await self._drive(
            _files.save_file(self._core, prefix, path, progress, max_shard_size)
        )

    # -- names -----------------------------------------------------------------------------------
    async def delete(
        self, name: str | None = None, *, prefix: str | None = None
    ) -> builtins.list[str]:
        """Remove ``name``, or every name that starts with ``prefix``, as
        ``Client.delete``; returns the names deleted."""
        return await self._drive(_ops.delete(self._core, name, prefix))

    async def delete_many(self, names: Iterable[str]) -> builtins.list[str]:
        """Remove every one of ``names``, or none, as ``Client.delete_many``."""
        return await self._drive(_ops.delete_many(self._core, names))

    async def list(self, prefix: str = "") -> builtins.list[TensorInfo]:
        """Every name with a version (those that start with ``prefix``), as ``Client.list``."""
        return await self._drive(_ops.names(self._core, prefix))

    async def stat(self) -> Stat:
        """The broker's accounting (``Stat``)."""
        await self._board()
        return await self._drive(_ops.stat(self._core))

    async def who(self) -> builtins.list[Holder]:
        """Which process holds what, as ``Client.who``."""
        return await self._drive(_ops.who(self._core))

    @property
    def round_trips(self) -> int:
        """Control-plane requests this client has sent (releases included)."""
        return self._core.round_trips

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
        self._drop_lane()
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, self._core.close)  # sends; joins a thread

    async def __aenter__(self) -> Self:
        await self._drive(self._core.open_session(""))
        await self._board()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def __del__(self) -> None:
        if not self._closed:
            self._transport.close()  # our idle sockets, without a ResourceWarning each
            if self._core.bg is not None:
                self._core.bg._stop = True

    def __repr__(self) -> str:
        return f"AsyncClient({self.url!r}, session={self._core.sid[:8]})"


_pickle.MAKERS["async"] = AsyncClient
