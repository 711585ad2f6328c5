"""Client: what worker processes use to put, get and share tensors."""

from __future__ import annotations

import builtins
import functools
import itertools
import os
import secrets
import threading
import weakref
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

from .._defaults import ENV_TOKEN, default_url
from .._errors import BrokerUnavailable, DepotError, InvalidRequest
from .._proto import CANCEL_HEADER, RELEASE_HEADER, REQUEST_HEADER, SESSION_HEADER, UNKNOWN_SESSION
from .._wire import INLINE_MAX, Handle, SessionInfo, Stat, TensorInfo
from ..shm._copy import copy_into, copy_many
from ..shm._posix import SegmentFile, Window, array_at, byte_view
from . import _batch, _cuda_ops
from ._background import Background
from ._checks import (
    check_floors,
    check_mapping,
    check_name,
    check_names,
    check_shape,
    check_timeout,
    check_ttl,
    check_version,
)
from ._fork import register
from ._source import Source, dtype_name
from ._tensor import SharedTensor, _Lease
from ._trust import trusted_uids

if TYPE_CHECKING:
    from typing_extensions import Self


def alloc_body(name: str, shape: Iterable[int], dtype: str, ttl: float | None, device: str = "cpu",
               hold: bool = False) -> dict[str, Any]:
    """The body of a ``/v1/alloc``; ``hold``: the writer's lease of an ``empty()``."""
    return {"name": name, "shape": [int(d) for d in shape], "dtype": dtype, "device": device,
            "ttl": ttl, "hold": hold}


def get_request(name: str, timeout: Any, newer_than: Any,
                io: float) -> tuple[str, float | bool | None]:
    """The path of a get (its arguments checked), and its I/O timeout: the
    wait plus ``io`` (None: forever; False: the transport's default)."""
    check_name(name)
    wait = check_timeout(timeout)
    path = f"/v1/tensors/{_path_name(name)}?newer_than={check_version(newer_than)}"
    if wait is None:
        return path + "&timeout=inf", None
    if wait > 0:
        return path + f"&timeout={wait!r}", wait + io
    return path, False


def _inline(name: str, src: Source, ttl: float | None) -> tuple[str, bytes] | None:
    """The path and bytes of a put small enough to carry its bytes in the
    request (one round trip), or None."""
    arr = src.array
    if arr.nbytes > INLINE_MAX:
        return None
    query = f"dtype={src.dtype}&shape={','.join(map(str, arr.shape))}"
    if ttl is not None:
        query += f"&ttl={ttl!r}"
    return f"/v1/put/{_path_name(name)}?{query}", arr.tobytes()  # C order, whatever the layout


def _new_id_prefix() -> None:
    global _ID_PREFIX, _ids
    _ID_PREFIX, _ids = secrets.token_hex(8), itertools.count(1)


_ID_PREFIX = ""
_ids = itertools.count(1)
_new_id_prefix()
os.register_at_fork(after_in_child=_new_id_prefix)


_QUOTED: dict[str, str] = {}


def _path_name(name: str) -> str:
    """A tensor name as it goes in a URL path (percent-encoded, slashes kept);
    names repeat, and quoting costs more than the rest of building a request."""
    q = _QUOTED.get(name)
    if q is None:
        q = quote(name, safe="/")
        if len(_QUOTED) < 4096:
            _QUOTED[name] = q
    return q


def _request_id() -> str:
    """A request id unique to this process (a random prefix and a counter): the
    broker keeps answers per session and id, so ids need only never repeat, and
    a counter costs no system call per request, as random bytes would."""
    return f"{_ID_PREFIX}{next(_ids):x}"


class Client:
    """A connection to a tensordepot broker.

    ``url`` is ``unix:///path.sock`` or ``http://host:port``; by default
    ``$TENSORDEPOT_URL``, then the default socket.  ``token`` (or
    ``$TENSORDEPOT_TOKEN``) is sent as a bearer token.  ``timeout`` bounds each
    request to the broker, in seconds (a ``get`` that waits adds its own
    wait).  ``label`` names the session in the broker's log and listings.
    The broker behind a unix socket, and every segment mapped, must belong to
    this process's uid, root, or ``trust_uid`` (or ``$TENSORDEPOT_TRUST_UID``):
    else ``UntrustedBroker``.  Use it as a context manager, or call
    ``close()``; closing never raises.

    Creating a Client opens a session: ``BrokerUnavailable`` if nothing
    answers at ``url`` (or what answers is not a tensordepot broker),
    ``AuthError`` if the broker refuses the credentials, ``LimitExceeded``
    if this process holds too many sessions.

    A Client may be shared by threads.  It survives ``fork()``: the child gets
    a session of its own that holds the views it inherited (README, Lifetime:
    M8).  Every method raises a ``DepotError`` subclass: ``InvalidRequest``
    (also a ``ValueError``) or ``InvalidType`` (also a ``TypeError``) for bad
    arguments, ``BrokerUnavailable`` when the broker cannot be reached."""

    _closed = True
    _bg: Background | None = None
    _session: SessionInfo | None = None
    _session_at_init = True  # False: the first call opens it (the asyncio client's core)

    def __init__(self, url: str | None = None, *, token: str | None = None, timeout: float = 30.0,
                 label: str | None = None,
                 trust_uid: int | str | Iterable[int | str] | None = None) -> None:
        from ._transport import Transport

        self.url = url or default_url()
        self._pid = os.getpid()
        io_timeout = check_timeout(timeout, "timeout")
        if not io_timeout:
            raise InvalidRequest(f"timeout must be a positive number of seconds, not {timeout!r}")
        self._trust = trusted_uids(trust_uid)
        self._transport = Transport(self.url, token=token or os.environ.get(ENV_TOKEN),
                                    timeout=io_timeout, trust=self._trust)
        # One open file per segment; windows (one mmap per tensor) are made from them.
        self._files: dict[tuple[str, bool], SegmentFile] = {}
        self._fill_maps: dict[str, Window] = {}  # whole-segment writer mappings for put
        self._fill_flats: dict[str, Any] = {}  # the same, as flat uint8 arrays (put_many)
        self._lock = threading.Lock()
        self._gate = threading.Lock()  # held across fork(): no lease is registered meanwhile
        # empty() windows not yet private
        self._writers: weakref.WeakSet[Window] = weakref.WeakSet()
        self._finishing = threading.Lock()  # held while the session is being ended
        self._sid = ""
        self._label = label
        self._closing = False
        self._fork_claim: str | None = None  # a forked child's session, until claimed
        try:
            if self._session_at_init:
                self._open_session()
        except BaseException:
            self._transport.close()  # a refused session (401, 503) must not leak its connection
            raise
        self._closed = False
        self._bg = Background(self)
        self._bg.heartbeat = self._session.heartbeat_interval if self._session else None
        register(self)

    # -- plumbing ----------------------------------------------------------
    def _open_session(self) -> None:
        body = {"pid": os.getpid(), "label": self._label}
        info = self._transport.request("POST", "/v1/sessions", body)
        self._set_session(SessionInfo.model_validate(info))

    def _set_session(self, info: SessionInfo) -> None:
        self._session = info
        self._sid = info.session
        if self._bg is not None:
            self._bg.heartbeat = info.heartbeat_interval

    def _call(self, method: str, path: str, body: Any = None, *,
              timeout: float | bool | None = False, background: bool = False,
              rid: str | None = None, grants: bool = False, decode: bool = True) -> Any:
        """One request under this session.  ``rid``: a request id that makes
        the request safe to resend; ``grants``: it takes leases, which are
        cancelled if its answer is never read; ``decode=False``: return the
        answer's bytes, not its JSON."""
        if not background:
            if self._closed or self._closing:
                raise InvalidRequest("this Client is closed; create a new one")
            self._claim_if_forked()
        if not self._sid:
            self._open_session()
        headers, ids, rids = self._headers(rid, carry=not background)
        sid = self._sid
        try:
            return self._transport.request(method, path, body, headers=headers, timeout=timeout,
                                           resend=rid is not None or method != "POST",
                                           decode=decode)
        except DepotError as exc:
            if not getattr(exc, "answered", False):
                self._unanswered(sid, ids, rids, rid, grants)
            if getattr(exc, "code", "") != UNKNOWN_SESSION or background:
                raise
        except BaseException:  # Ctrl-C mid-call: the answer will never be read
            self._unanswered(sid, ids, rids, rid, grants)
            raise
        # The broker restarted or reaped us: open a fresh session and retry once.
        self._open_session()
        headers, _, _ = self._headers(rid, carry=False)
        return self._transport.request(method, path, body, headers=headers, timeout=timeout,
                                       resend=rid is not None or method != "POST",
                                       decode=decode)

    def _headers(self, rid: str | None, *,
                 carry: bool) -> tuple[dict[str, str], list[int], list[str]]:
        """A request's session headers, and (``carry``) the queued releases and
        cancels riding on it: no round trip of their own."""
        headers = {SESSION_HEADER: self._sid}
        if rid is not None:
            headers[REQUEST_HEADER] = rid
        ids: list[int] = []
        rids: list[str] = []
        bg = self._bg
        if carry and bg is not None and (bg.pending or bg.cancels):
            ids, rids = bg.take()
            if ids:  # piggyback queued releases: no round trip of their own
                headers[RELEASE_HEADER] = ",".join(map(str, ids))
            if rids:
                headers[CANCEL_HEADER] = ",".join(rids)
        return headers, ids, rids

    def _unanswered(self, sid: str, ids: list[int], rids: list[str], rid: str | None,
                    grants: bool) -> None:
        """A request whose answer was never read: the ids that rode on it go
        out again, and whatever it was granted (``grants``) is cancelled."""
        bg = self._bg
        if bg is not None:
            bg.give_back(ids, rids)
            if grants and rid is not None:
                bg.cancel_later(sid, rid)

    def _file(self, segment: str, writable: bool) -> SegmentFile:
        key = (segment, writable)
        f = self._files.get(key)
        if f is None:
            with self._lock:
                f = self._files.get(key)
                if f is None:
                    try:
                        f = self._files[key] = SegmentFile(segment, writable=writable,
                                                           trust=self._trust)
                    except FileNotFoundError:
                        raise BrokerUnavailable(
                            f"segment {segment} is missing from /dev/shm: the broker restarted or "
                            f"runs in another IPC namespace (docker: share ipc with the broker)"
                        ) from None
                    except PermissionError:
                        raise BrokerUnavailable(
                            f"no permission to map segment {segment}: run as the broker's user or "
                            f"start it with --shm-group"
                        ) from None
        return f

    def _fill_map(self, segment: str) -> Window:
        """The whole segment, mapped shared and writable once, for put's copies.
        Writers pre-fault it in one call (MAP_POPULATE)."""
        m = self._fill_maps.get(segment)
        if m is None:
            f = self._file(segment, True)
            m = f.window(0, f.size, writable=True, populate=True)
            with self._lock:
                m = self._fill_maps.setdefault(segment, m)
        return m

    def _fill_flat(self, segment: str) -> Any:
        """The fill mapping of ``segment`` as one flat uint8 array (made once):
        slicing it is far cheaper than building an array per tensor."""
        a = self._fill_flats.get(segment)
        if a is None:
            m = self._fill_map(segment)
            a = byte_view(m, 0, m.size, writable=True)
            with self._lock:
                a = self._fill_flats.setdefault(segment, a)
        return a

    def _prune_files(self) -> None:
        """Forget segments the broker unlinked, so their memory returns to the
        kernel once no view uses them."""
        with self._lock:
            for key, f in list(self._files.items()):
                if not f.exists():
                    del self._files[key]
                    self._fill_maps.pop(key[0], None)
                    self._fill_flats.pop(key[0], None)
        _cuda_ops.prune(self)

    def _tensor(self, h: Handle, *, writable: bool) -> SharedTensor:
        if h.kind == "cuda":
            return _cuda_ops.tensor(self, h, writable=writable)
        try:
            f = self._file(h.segment, writable)
            # A reader's window is private (a stray write never reaches the
            # segment); a writer's is shared until publish.
            w = f.window(h.offset, h.nbytes, writable=writable)
        except (DepotError, OSError) as exc:
            # Give back what the broker handed out, then say why we cannot map it.
            if h.lease is not None and self._bg is not None:
                self._bg.release_later(self._sid, h.lease)
            if writable:
                self._abort(h)
            if isinstance(exc, DepotError):
                raise
            raise BrokerUnavailable(f"cannot map segment {h.segment}: {exc}") from exc
        lease = None
        with self._gate:
            if h.lease is not None and self._bg is not None:
                lease = _Lease(h.lease, functools.partial(self._bg.release_later, self._sid))
                self._bg.track(self._sid, h.lease)
            if writable:
                self._writers.add(w)
        t = SharedTensor(self, h, w, lease, writable=writable)
        t._lease_session = self._sid
        return t

    @staticmethod
    def _rid() -> str:
        return _request_id()

    # -- writing -----------------------------------------------------------
    def put(self, name: str, x: Any, *, ttl: float | None = None, device: Any = None) -> int:
        """Copy ``x`` into broker memory as the next version of ``name``; returns the version.

        ``x`` may be a numpy array, any ``__dlpack__`` object (torch, jax,
        cupy, on the CPU or a GPU), or a number or list of numbers.
        Non-contiguous input is stored contiguous.  The tensor outlives this
        process; ``ttl`` deletes it that many seconds after publishing.
        ``device`` ("cpu", "cuda", "cuda:N", "cuda:GPU-<uuid>") is where the
        copy goes; by default the input's own device.  A ``SharedTensor``
        this client got is linked, not copied: both names share the bytes.

        Raises ``InvalidType`` for a value that is not a tensor or a bad
        name type, ``InvalidRequest`` for a bad name (1 to 512 printable
        ASCII characters, no spaces), dtype or ttl, ``OutOfMemory`` when the
        broker's memory limit cannot fit it."""
        check_name(name)
        ttl = check_ttl(ttl)
        if _cuda_ops.involves_gpu(x, device):
            return _cuda_ops.put(self, name, x, device=device, ttl=ttl)
        link = self._link(name, x, ttl)
        if link is not None:
            return int(self._call("POST", "/v1/link", link, rid=self._rid())["version"])
        src = Source(x)
        try:
            arr = src.array
            inline = _inline(name, src, ttl)
            if inline is not None:
                return int(self._call("POST", inline[0], inline[1], rid=self._rid())["version"])
            h = self._alloc(name, arr.shape, src.dtype, ttl)
            self._fill(h, arr)
        finally:
            src.close()
        self._publish(name, h.version)
        return h.version

    def _link(self, name: str, x: Any, ttl: float | None) -> dict[str, Any] | None:
        """The body of a ``/v1/link`` that puts ``x`` without a copy, when it is
        a published tensor of this client, leased by this session."""
        if isinstance(x, SharedTensor) and x._client() is self and x.published:
            lease = x._lease_id()
            if lease is not None and x._lease_session == self._sid:
                # Already in broker memory, leased by this session: the new
                # version shares the bytes.  A lease of an earlier session (the
                # broker restarted) may name another tensor now: copy instead.
                return {"name": name, "lease": lease, "ttl": ttl}
        return None

    def _alloc(self, name: str, shape: Iterable[int], dtype: str, ttl: float | None,
               device: str = "cpu", hold: bool = False) -> Handle:
        body = alloc_body(name, shape, dtype, ttl, device, hold)
        return Handle.model_validate(self._call("POST", "/v1/alloc", body, rid=self._rid(),
                                                grants=True))

    def _fill(self, h: Handle, arr: Any) -> None:
        try:
            if h.nbytes:
                m = self._fill_map(h.segment)
                dst = array_at(m.address + h.offset, tuple(h.shape), None, arr.dtype, writable=True,
                               owner=m)
                copy_into(dst, arr)  # when it raises, no copy thread is still writing
        except BaseException:
            self._abort(h)
            raise

    def _fill_many(self, handles: list[Handle], arrays: list[Any]) -> None:
        """``_fill`` for a batch, with every copy thread."""
        try:
            pairs = []
            for h, arr in zip(handles, arrays, strict=True):
                if h.nbytes:
                    m = self._fill_map(h.segment)
                    pairs.append((array_at(m.address + h.offset, tuple(h.shape), None, arr.dtype,
                                           writable=True, owner=m), arr))
            copy_many(pairs)  # when it raises, no copy thread is still writing
        except BaseException:
            for h in handles:
                self._abort(h)
            raise

    def _abort(self, h: Handle) -> None:
        self._abort_version(h.name, h.version)

    def _abort_version(self, name: str, version: int) -> None:
        """Give back an allocation that will not be published (best effort: if
        the broker is gone, so is the allocation)."""
        try:
            self._call("POST", "/v1/abort", {"name": name, "version": version}, rid=self._rid())
        except DepotError:
            pass

    def _publish(self, name: str, version: int) -> None:
        self._call("POST", "/v1/publish", {"name": name, "version": version}, rid=self._rid())

    def empty(self, name: str, shape: Iterable[int], dtype: Any = "float32", *, device: str = "cpu",
              ttl: float | None = None) -> SharedTensor:
        """A writable tensor in broker memory: fill it in place, then ``publish()``.

        No copy is ever made.  ``shape`` is a sequence of ints, ``dtype`` a
        name ("float32", "bfloat16", ...) or a numpy/torch dtype, ``device``
        "cpu" or a GPU ("cuda", "cuda:N", "cuda:GPU-<uuid>").  Unpublished
        tensors are reclaimed if this process dies (or after the broker's
        --alloc-ttl).  After ``publish()`` its views stay readable, and a
        write through them no longer reaches anyone else.  Raises
        ``InvalidRequest`` for a bad name, shape or dtype and ``OutOfMemory``
        when it does not fit."""
        check_name(name)
        dims = check_shape(shape)
        h = self._alloc(name, dims, dtype_name(dtype), check_ttl(ttl),
                        _cuda_ops.wire_device(device), hold=True)
        return self._tensor(h, writable=True)

    def share(self, name: str, tensor: Any, *, ttl: float | None = None, stream: Any = None,
              wait_on_close: float = 30.0) -> int:
        """Publish a GPU tensor's own memory as the next version of ``name``, without a copy.

        The name is withdrawn when this Client's session ends, and CUDA keeps
        no promise to readers once this process frees the memory or exits:
        readers get ``TensorBroken`` then.  ``close()`` waits up to
        ``wait_on_close`` seconds for readers to release it.  ``stream``: the
        stream the tensor was written on, if not the framework's current one.
        ``put`` (a copy the broker owns) is the safer default."""
        check_name(name)
        return _cuda_ops.share(self, name, tensor, ttl=check_ttl(ttl), stream=stream,
                               wait_on_close=wait_on_close)

    def put_many(self, tensors: Mapping[str, Any], *, ttl: float | None = None,
                 device: Any = None) -> dict[str, int]:
        """Put a whole state dict: one round trip to allocate, one to publish.

        ``tensors`` maps names to what ``put`` accepts; returns each name's
        new version.  All of them are published, or none (an error leaves
        nothing behind).  GPU tensors stay on their GPU unless ``device``
        says otherwise.  Raises ``InvalidType`` if ``tensors`` is not a
        mapping, and what ``put`` raises for any of its items."""
        check_mapping(tensors)
        ttl = check_ttl(ttl)
        if any(_cuda_ops.involves_gpu(x, device) for x in tensors.values()):
            return _cuda_ops.put_many(self, tensors, device=device, ttl=ttl)
        if not tensors:
            return {}
        return _batch.put_many(self, tensors, ttl)

    # -- reading -----------------------------------------------------------
    def get(self, name: str, timeout: float | None = 0.0, *, newer_than: int = 0) -> SharedTensor:
        """Lease the newest published version of ``name`` (read-only, zero copy).

        ``timeout=0`` (the default) raises ``TensorNotFound`` at once if there is
        none; a number waits up to that many seconds; ``None`` (or ``inf``)
        waits forever.  ``newer_than=v`` waits for a version newer than ``v``.
        The lease ends when the returned ``SharedTensor`` and every view made
        from it are gone.  Raises ``TensorNotFound`` when nothing (newer) was
        published in time, ``InvalidRequest``/``InvalidType`` for a bad name,
        timeout or version."""
        path, io_timeout = get_request(name, timeout, newer_than, self._transport.timeout)
        raw = self._call("GET", path, timeout=io_timeout, rid=self._rid(), grants=True,
                         decode=False)
        return self._tensor(Handle.model_validate_json(raw), writable=False)

    def get_many(self, names: Iterable[str], timeout: float | None = 0.0, *,
                 newer_than: int | Mapping[str, int] = 0) -> dict[str, SharedTensor]:
        """Lease many tensors in one round trip, under one deadline (all of
        them, or an error and none).

        ``names`` is an iterable of names (a str is refused: pass a list);
        ``timeout`` is as for ``get``.  ``newer_than``: a version every name
        must be newer than, or a mapping from name to version (names it
        lacks: any version), e.g. the versions of the previous ``get_many``.
        Returns a dict from name to ``SharedTensor``.  Raises
        ``TensorNotFound`` naming what was missing when the deadline passed."""
        names = check_names(names)
        wait = check_timeout(timeout)
        body: dict[str, Any] = {"names": names, "timeout": wait}
        floors = check_floors(newer_than, names)
        if floors is not None:
            body["newer_than"] = floors
        io_timeout = None if wait is None else wait + self._transport.timeout
        return _batch.get_many(self, body, io_timeout)

    def _tensors(self, handles: list[Handle]) -> dict[str, SharedTensor]:
        """Read-only tensors for a batch's handles (all, or none and their
        leases released): the AsyncClient's get_many."""
        out: dict[str, SharedTensor] = {}
        try:
            for h in handles:
                out[h.name] = self._tensor(h, writable=False)
        except BaseException:
            for h in handles[len(out):]:
                if h.lease is not None and self._bg is not None:
                    self._bg.release_later(self._sid, h.lease)
            raise
        return out

    def push(self, name: str, to: str, *, token: str | None = None,
             tls_ca: str | bytes | None = None, timeout: float | None = None) -> int:
        """Send the newest version of ``name`` to the broker on another host whose
        Flight endpoint is ``to`` (``grpc://HOST:PORT``, ``grpc+tls://``); returns
        its version there.  ``token`` (default ``$TENSORDEPOT_PEER_TOKEN``) needs
        write scope there.  Needs ``pip install 'tensordepot[flight]'``."""
        from ._push import push

        return push(self, name, to, token=token, tls_ca=tls_ca, timeout=timeout)

    # -- names ---------------------------------------------------------------
    def delete(self, name: str) -> None:
        """Remove ``name`` now; readers keep their bytes until they release them.

        Raises ``TensorNotFound`` if there is no such name."""
        check_name(name)
        self._call("DELETE", f"/v1/tensors/{_path_name(name)}", rid=self._rid())

    def list(self) -> builtins.list[TensorInfo]:  # ``list`` here names this method
        """Every name with a version: one ``TensorInfo`` each, for its newest version."""
        return [TensorInfo.model_validate(i) for i in self._call("GET", "/v1/tensors")["items"]]

    def stat(self) -> Stat:
        """The broker's accounting: memory, names, versions, leases, sessions (``Stat``)."""
        return Stat.model_validate(self._call("GET", "/v1/stat"))

    @property
    def round_trips(self) -> int:
        """Control-plane requests this client has sent (releases included)."""
        return self._transport.round_trips

    # -- fork --------------------------------------------------------------------
    _fork_plan: Any = None

    def _before_fork(self) -> None:
        """In the parent, just before fork(): ask the broker for a session for
        the child holding copies of this session's leases, so the views the
        child inherits stay theirs.  No lease is registered until the fork is done."""
        self._gate.acquire()
        self._fork_plan = None
        bg = self._bg
        if self._closed or bg is None or not bg.live or os.getpid() != self._pid:
            return
        try:
            self._fork_plan = self._call("POST", f"/v1/sessions/{self._sid}/fork", background=True,
                                         rid=self._rid())
        except DepotError:
            self._fork_plan = None  # the child's inherited views stay readable; see _after_fork

    def _after_fork_parent(self) -> None:
        self._fork_plan = None
        self._gate.release()

    def _after_fork_child(self) -> None:
        self._gate = threading.Lock()
        self._lock = threading.Lock()
        self._finishing = threading.Lock()
        plan, self._fork_plan = self._fork_plan, None
        self._pid = os.getpid()
        self._transport.after_fork()
        for w in list(self._writers):
            # The parent's unpublished buffers: the child's copy of them is
            # private, as the rest of its memory is after fork().
            w.make_private()
        if self._closed or self._bg is None:
            return
        renamed = {}
        if plan is not None:
            renamed = {(self._sid, int(old)): (plan["session"], new)
                       for old, new in plan["leases"].items()}
            self._sid = plan["session"]
            self._fork_claim = plan["session"]
        else:
            self._sid = ""  # the child opens its own session on its first call
        self._bg.after_fork(renamed)

    def _claim_if_forked(self) -> None:
        sid = self._fork_claim
        if sid is None:
            return
        with self._lock:
            if self._fork_claim is None:
                return
            self._fork_claim = None
            try:
                info = self._transport.request("POST", f"/v1/sessions/{sid}/claim",
                                               headers={SESSION_HEADER: sid})
                self._set_session(SessionInfo.model_validate(info))
            except DepotError:
                self._sid = ""  # gone (the broker restarted, or the claim came too late)

    # -- closing -------------------------------------------------------------
    def close(self) -> None:
        """End the session.  Never raises.

        Leases of views that are still alive (numpy arrays, torch tensors)
        stay held until those views are freed or this process exits, so
        closing never pulls memory out from under a live tensor."""
        if self._closed or self._closing:
            return
        try:
            _cuda_ops.before_close(self)  # readers of this client's share()s release first
        except DepotError:
            pass
        self._closing = True
        with self._lock:
            self._files.clear()
            self._fill_maps.clear()
            self._fill_flats.clear()
        import gc

        gc.collect()  # views caught in reference cycles would otherwise hold leases
        self._maybe_finish_close()

    def _maybe_finish_close(self) -> None:
        if not self._closing:
            return
        # close() and the background thread may both get here.  close() waits
        # until whichever came first has ended the session (``_closed`` is set
        # before the session is ended), so that it never returns while the
        # session is still open; the background thread never waits (close()
        # may be joining it).
        bg_thread = self._bg is not None and threading.current_thread() is self._bg.thread
        if not self._finishing.acquire(blocking=not bg_thread):
            return
        try:
            with self._lock:
                if self._closed:
                    return
                if self._bg is not None:
                    self._bg.flush()
                if self._bg is not None and self._bg.live:
                    return  # the background thread retries as views die
                self._closed = True
            if self._sid:
                try:
                    self._transport.request("DELETE", f"/v1/sessions/{self._sid}",
                                            headers={SESSION_HEADER: self._sid})
                except DepotError:
                    pass
            if self._bg is not None:
                self._bg.stop()
            self._transport.close()
        finally:
            self._finishing.release()

    def __enter__(self) -> Self:
        """``with Client() as c:`` closes it on leaving the block."""
        return self

    def __exit__(self, *exc: object) -> None:
        """Close (never raises)."""
        self.close()

    def __del__(self) -> None:
        if not self._closed and self._bg is not None:
            self._bg._stop = True

    def __repr__(self) -> str:
        return f"Client({self.url!r}, session={self._sid[:8]})"
