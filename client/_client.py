"""Client: what worker processes use to put, get and share tensors."""

from __future__ import annotations

import collections
import functools
import logging
import math
import os
import select
import threading
import time
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

from .._defaults import ENV_TOKEN, default_url
from .._errors import BrokerUnavailable, DepotError, InvalidRequest
from .._wire import INLINE_MAX, Handle, SessionInfo, Stat, TensorInfo
from ..shm import PosixMapping, UnsupportedDType, dtype_from_name, dtype_from_numpy, import_dlpack
from ..shm._copy import copy_into, copy_many
from ..shm._posix import array_at
from . import _cuda_ops
from ._tensor import SharedTensor, _Lease
from ._transport import Transport

if TYPE_CHECKING:
    from typing_extensions import Self

log = logging.getLogger("tensordepot.client")
_SESSION_HEADER = "x-tensordepot-session"
_RELEASE_HEADER = "x-tensordepot-release"
_UNKNOWN_SESSION = "unknown_session"
_COALESCE = 0.01  # seconds a queued release may wait for company (or a request to ride)


def _start_time(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
        return int(data[data.rfind(b")") + 2:].split()[19])
    except (OSError, ValueError, IndexError):
        return None


class _Source:
    """A put's input as a numpy array of the right item size, plus its dtype."""

    def __init__(self, x: Any) -> None:
        import numpy as np

        self._imported = None
        if isinstance(x, SharedTensor):  # another client's, or an empty() one: copy its raw bytes
            self.array, self.dtype = _raw(x), x.dtype
        elif isinstance(x, np.ndarray):
            self.array, self.dtype = x, dtype_from_numpy(x.dtype).name
        elif hasattr(x, "__dlpack__"):
            x = _exportable(x)
            self._imported = import_dlpack(x)
            self.array, self.dtype = self._imported.array, self._imported.dtype.name
        else:
            arr = np.asarray(x)
            self.array, self.dtype = arr, dtype_from_numpy(arr.dtype).name

    def close(self) -> None:
        if self._imported is not None:
            self._imported.close()
            self._imported = None


def _raw(t: SharedTensor) -> Any:
    owner = t._alive()
    return array_at(t._address, t.shape, tuple(s * t._dt.itemsize for s in t.strides), t._dt.storage,
                    writable=False, owner=owner)


def _exportable(x: Any) -> Any:
    """torch refuses to export tensors that need grad or carry lazy conj/neg bits."""
    if type(x).__module__.startswith("torch"):
        if getattr(x, "requires_grad", False):
            x = x.detach()
        if hasattr(x, "resolve_conj"):
            x = x.resolve_conj().resolve_neg()
    return x


class _Background:
    """One daemon thread per Client: sends queued lease releases, heartbeats
    untracked sessions, and forgets mappings of segments the broker unlinked.

    Finalizers only append to a deque and write one byte to a pipe: they may
    run in any thread, at any time (even inside this thread's own code), so
    they must not take locks."""

    def __init__(self, client: Client) -> None:
        # Leases as (session, lease id): ids restart with each broker, so an id
        # alone may name another session's lease after a restart.
        self.pending: collections.deque[tuple[str, int]] = collections.deque()
        self.live: set[tuple[str, int]] = set()  # leases some view still holds
        self._r, self._w = os.pipe()
        os.set_blocking(self._w, False)
        self._client = client
        self._stop = False
        self._armed = False
        self.heartbeat: float | None = None
        self.idle = threading.Event()
        self.thread = threading.Thread(target=self._run, name="tensordepot-client", daemon=True)
        self.thread.start()

    def track(self, sid: str, lease_id: int) -> None:
        self.live.add((sid, lease_id))

    def release_later(self, sid: str, lease_id: int) -> None:
        self.live.discard((sid, lease_id))
        self.pending.append((sid, lease_id))
        if not self._armed:
            self._armed = True
            try:
                os.write(self._w, b"x")
            except OSError:
                pass  # the pipe is full (a wake-up is pending anyway) or closed

    def take(self, limit: int = 4096) -> list[int]:
        """Pending lease ids of the current session, for a request to carry (or
        for ``flush``).  Leases taken in an earlier session ended with it (the
        broker restarted, or reaped it), and their ids may now name leases of
        the current session: they are dropped, never sent."""
        sid = self._client._sid
        ids: list[int] = []
        while self.pending and len(ids) < limit:
            try:
                owner, lease_id = self.pending.popleft()
            except IndexError:
                break
            if owner == sid:
                ids.append(lease_id)
        return ids

    def flush(self) -> None:
        ids = self.take(1 << 20)
        if ids:
            try:
                self._client._call("POST", "/v1/release", {"leases": ids}, background=True)
            except DepotError as exc:  # the broker is gone: its leases are gone with it
                log.debug("release of %d lease(s) failed: %s", len(ids), exc)

    def _run(self) -> None:
        last_beat = last_prune = time.monotonic()
        while not self._stop:
            wait = 1.0 if self.heartbeat is None else min(1.0, self.heartbeat)
            readable, _, _ = select.select([self._r], [], [], wait)
            if readable:
                try:
                    os.read(self._r, 4096)
                except OSError:
                    break
                # Coalesce: releases queued in the next few milliseconds go in
                # one request, and a foreground request may carry them first.
                # Still armed meanwhile, so they do not wake us again.
                time.sleep(_COALESCE)
                self._armed = False
            self.flush()
            now = time.monotonic()
            if self.heartbeat is not None and now - last_beat >= self.heartbeat:
                last_beat = now
                try:
                    self._client._call("POST", f"/v1/sessions/{self._client._sid}/heartbeat",
                                       background=True)
                except DepotError:
                    pass
            if now - last_prune >= 2.0:
                last_prune = now
                self._client._prune_mappings()
            self._client._maybe_finish_close()

    def stop(self) -> None:
        self._stop = True
        try:
            os.write(self._w, b"x")
        except OSError:
            pass
        if threading.current_thread() is not self.thread:
            self.thread.join(timeout=5)
        for fd in (self._r, self._w):
            try:
                os.close(fd)
            except OSError:
                pass


class Client:
    """A connection to a tensordepot broker.

    ``url`` is ``unix:///path.sock`` or ``http://host:port``; by default
    ``$TENSORDEPOT_URL``, then the default socket.  ``token`` (or
    ``$TENSORDEPOT_TOKEN``) is sent on TCP.  Use it as a context manager, or
    call ``close()``; closing never raises.  Create clients after ``fork()``:
    a Client belongs to the process that made it.
    """

    _closed = True
    _bg: _Background | None = None

    def __init__(self, url: str | None = None, *, token: str | None = None, timeout: float = 30.0,
                 label: str | None = None) -> None:
        self.url = url or default_url()
        self._pid = os.getpid()
        self._transport = Transport(self.url, token=token or os.environ.get(ENV_TOKEN), timeout=timeout)
        self._maps: dict[tuple[str, bool], PosixMapping] = {}
        self._maps_lock = threading.Lock()
        self._sid = ""
        self._label = label
        self._closing = False
        self._close_lock = threading.Lock()
        try:
            self._open_session()
        except BaseException:
            self._transport.close()  # a refused session (401, 503) must not leak its connection
            raise
        self._closed = False
        self._bg = _Background(self)
        self._bg.heartbeat = self._session.heartbeat_interval

    # -- plumbing ----------------------------------------------------------
    def _open_session(self) -> None:
        body = {"pid": self._pid, "start_time": _start_time(self._pid), "label": self._label}
        self._session = SessionInfo.model_validate(self._transport.request("POST", "/v1/sessions", body))
        self._sid = self._session.session
        if self._bg is not None:
            self._bg.heartbeat = self._session.heartbeat_interval

    def _call(self, method: str, path: str, body: Any = None, *, timeout: float | None | bool = False,
              background: bool = False) -> Any:
        if not background:
            if self._closed or self._closing:
                raise InvalidRequest("this Client is closed; create a new one")
            if os.getpid() != self._pid:
                raise InvalidRequest(
                    f"this Client was created in process {self._pid}; create a new Client after fork()"
                )
        headers = {_SESSION_HEADER: self._sid}
        if not background and self._bg is not None and self._bg.pending:
            ids = self._bg.take()
            if ids:  # piggyback queued releases: no round trip of their own
                headers[_RELEASE_HEADER] = ",".join(map(str, ids))
        try:
            return self._transport.request(method, path, body, headers=headers, timeout=timeout)
        except DepotError as exc:
            if getattr(exc, "code", "") != _UNKNOWN_SESSION or background:
                raise
        # The broker restarted or reaped us: open a fresh session and retry once.
        self._open_session()
        headers = {_SESSION_HEADER: self._sid}
        return self._transport.request(method, path, body, headers=headers, timeout=timeout)

    def _mapping(self, segment: str, writable: bool) -> PosixMapping:
        key = (segment, writable)
        m = self._maps.get(key)
        if m is None:
            with self._maps_lock:
                m = self._maps.get(key)
                if m is None:
                    try:
                        # Writers pre-fault the whole mapping in one call; readers map
                        # lazily so a get costs the same for 1 KiB as for 1 GiB.
                        m = PosixMapping(segment, writable=writable, populate=writable)
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
                    self._maps[key] = m
        return m

    def _prune_mappings(self) -> None:
        """Forget cached mappings of segments the broker unlinked, so their
        memory returns to the kernel once no view uses them."""
        with self._maps_lock:
            for key, m in list(self._maps.items()):
                if not m.exists():
                    del self._maps[key]
        _cuda_ops.prune(self)

    def _tensor(self, h: Handle, *, writable: bool) -> SharedTensor:
        if h.kind == "cuda":
            return _cuda_ops.tensor(self, h, writable=writable)
        try:
            m = self._mapping(h.segment, writable)
        except DepotError:
            # Give back what the broker handed out, then say why we cannot map it.
            if h.lease is not None and self._bg is not None:
                self._bg.release_later(self._sid, h.lease)
            elif writable:
                self._abort(h)
            raise
        lease = None
        if h.lease is not None and self._bg is not None:
            lease = _Lease(h.lease, functools.partial(self._bg.release_later, self._sid))
            self._bg.track(self._sid, h.lease)
        return SharedTensor(self, h, m, lease, writable=writable)

    # -- writing -----------------------------------------------------------
    def put(self, name: str, x: Any, *, ttl: float | None = None, device: Any = None) -> int:
        """Copy ``x`` into broker memory as the next version of ``name``; returns the version.

        ``x`` may be a numpy array, any ``__dlpack__`` object (torch, jax,
        cupy, on the CPU or a GPU), or anything numpy can turn into an array.
        Non-contiguous input is stored contiguous.  The tensor outlives this
        process; ``ttl`` deletes it that many seconds after publishing.
        ``device`` ("cpu", "cuda", "cuda:N", "cuda:GPU-<uuid>") is where the
        copy goes; by default the input's own device."""
        if _cuda_ops.involves_gpu(x, device):
            return _cuda_ops.put(self, name, x, device=device, ttl=ttl)
        if isinstance(x, SharedTensor) and x._lease_id() is not None and x._client() is self:
            # Already in broker memory: the new version shares the bytes.
            body = {"name": name, "lease": x._lease_id(), "ttl": ttl}
            return int(self._call("POST", "/v1/link", body)["version"])
        src = _Source(x)
        try:
            arr = src.array
            if arr.nbytes <= INLINE_MAX:
                import numpy as np

                query = f"dtype={src.dtype}&shape={','.join(map(str, arr.shape))}"
                if ttl is not None:
                    query += f"&ttl={float(ttl)!r}"
                data = np.ascontiguousarray(arr).tobytes()
                resp = self._call("POST", f"/v1/put/{quote(name, safe='/')}?{query}", data)
                return int(resp["version"])
            h = self._alloc(name, arr.shape, src.dtype, ttl)
            self._fill(h, arr)
        finally:
            src.close()
        self._publish(name, h.version)
        return h.version

    def _alloc(self, name: str, shape: Iterable[int], dtype: str, ttl: float | None,
               device: str = "cpu") -> Handle:
        body = {"name": name, "shape": [int(d) for d in shape], "dtype": dtype, "device": device, "ttl": ttl}
        return Handle.model_validate(self._call("POST", "/v1/alloc", body))

    def _fill(self, h: Handle, arr: Any) -> None:
        try:
            if h.nbytes:
                m = self._mapping(h.segment, True)
                dst = array_at(m.address + h.offset, tuple(h.shape), None, arr.dtype, writable=True, owner=m)
                copy_into(dst, arr)
        except BaseException:
            self._abort(h)
            raise

    def _abort(self, h: Handle) -> None:
        """Give back an allocation that will not be published (best effort: if
        the broker is gone, so is the allocation)."""
        try:
            self._call("POST", "/v1/abort", {"name": h.name, "version": h.version})
        except DepotError:
            pass

    def _publish(self, name: str, version: int) -> None:
        self._call("POST", "/v1/publish", {"name": name, "version": version})

    def empty(self, name: str, shape: Iterable[int], dtype: Any = "float32", *, device: str = "cpu",
              ttl: float | None = None) -> SharedTensor:
        """A writable tensor in broker memory: fill it in place, then ``publish()``.
        No copy is ever made.  Unpublished tensors are reclaimed if this process dies."""
        dt = _dtype_name(dtype)
        h = self._alloc(name, shape, dt, ttl, _cuda_ops.wire_device(device))
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
        return _cuda_ops.share(self, name, tensor, ttl=ttl, stream=stream, wait_on_close=wait_on_close)

    def put_many(self, tensors: Mapping[str, Any], *, ttl: float | None = None,
                 device: Any = None) -> dict[str, int]:
        """Put a whole state dict: one round trip to allocate, one to publish.
        GPU tensors stay on their GPU unless ``device`` says otherwise."""
        if any(_cuda_ops.involves_gpu(x, device) for x in tensors.values()):
            return _cuda_ops.put_many(self, tensors, device=device, ttl=ttl)
        sources = {name: _Source(x) for name, x in tensors.items()}
        try:
            items = [{"name": n, "shape": list(s.array.shape), "dtype": s.dtype, "ttl": ttl}
                     for n, s in sources.items()]
            handles = [Handle.model_validate(h) for h in
                       self._call("POST", "/v1/batch/alloc", {"items": items})["items"]]
            try:
                pairs = []
                for h in handles:
                    arr = sources[h.name].array
                    if h.nbytes:
                        m = self._mapping(h.segment, True)
                        pairs.append((array_at(m.address + h.offset, tuple(h.shape), None, arr.dtype,
                                               writable=True, owner=m), arr))
                copy_many(pairs)
            except BaseException:
                for h in handles:
                    self._abort(h)
                raise
        finally:
            for s in sources.values():
                s.close()
        pub = [{"name": h.name, "version": h.version} for h in handles]
        self._call("POST", "/v1/batch/publish", {"items": pub})
        return {h.name: h.version for h in handles}

    # -- reading -----------------------------------------------------------
    def get(self, name: str, timeout: float | None = 0.0, *, newer_than: int = 0) -> SharedTensor:
        """Lease the newest published version of ``name`` (read-only, zero copy).

        ``timeout=0`` (the default) raises ``TensorNotFound`` at once if there is
        none; a number waits up to that many seconds; ``None`` waits forever.
        ``newer_than=v`` waits for a version newer than ``v``."""
        path = f"/v1/tensors/{quote(name, safe='/')}?newer_than={int(newer_than)}"
        io_timeout: float | None | bool = False
        if timeout is None:
            path += "&timeout=inf"
            io_timeout = None
        elif timeout > 0:
            if not math.isfinite(timeout):
                raise InvalidRequest("timeout must be finite, or None to wait forever")
            path += f"&timeout={float(timeout)!r}"
            io_timeout = float(timeout) + self._transport.timeout
        elif timeout < 0:
            raise InvalidRequest(f"timeout must be >= 0 or None, not {timeout}")
        h = Handle.model_validate(self._call("GET", path, timeout=io_timeout))
        return self._tensor(h, writable=False)

    def get_many(self, names: Iterable[str], timeout: float | None = 0.0) -> dict[str, SharedTensor]:
        """Lease many tensors in one round trip (all of them, or an error and none)."""
        names = list(names)
        body = {"names": names, "timeout": float("inf") if timeout is None else timeout}
        io_timeout: float | None | bool = None if timeout is None else (timeout + self._transport.timeout)
        resp = self._call("POST", "/v1/batch/get", body, timeout=io_timeout)
        return {h["name"]: self._tensor(Handle.model_validate(h), writable=False) for h in resp["items"]}

    # -- names ---------------------------------------------------------------
    def delete(self, name: str) -> None:
        """Remove ``name`` now; readers keep their bytes until they release them."""
        self._call("DELETE", f"/v1/tensors/{quote(name, safe='/')}")

    def list(self) -> list[TensorInfo]:
        return [TensorInfo.model_validate(i) for i in self._call("GET", "/v1/tensors")["items"]]

    def stat(self) -> Stat:
        return Stat.model_validate(self._call("GET", "/v1/stat"))

    @property
    def round_trips(self) -> int:
        """Control-plane requests this client has sent (releases included)."""
        return self._transport.round_trips

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
        with self._maps_lock:
            self._maps.clear()
        import gc

        gc.collect()  # views caught in reference cycles would otherwise hold leases
        self._maybe_finish_close()

    def _maybe_finish_close(self) -> None:
        if not self._closing or self._closed:
            return
        with self._close_lock:  # close() and the background thread may both get here
            if self._closed:
                return
            if self._bg is not None:
                self._bg.flush()
            if self._bg is not None and self._bg.live:
                return  # the background thread retries as views die
            self._closed = True
            try:
                self._transport.request("DELETE", f"/v1/sessions/{self._sid}")
            except DepotError:
                pass
            if self._bg is not None:
                self._bg.stop()
            self._transport.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        if not self._closed and self._bg is not None:
            self._bg._stop = True

    def __repr__(self) -> str:
        return f"Client({self.url!r}, session={self._sid[:8]})"


def _dtype_name(dtype: Any) -> str:
    try:
        return dtype_from_name(str(dtype)).name
    except UnsupportedDType:
        pass
    try:
        return dtype_from_numpy(dtype).name
    except (UnsupportedDType, TypeError):
        raise InvalidRequest(f"unknown dtype {dtype!r}") from None
