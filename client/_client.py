"""Client: what worker processes use to put, get and share tensors.

It drives the client core's operations (``_core.py``, ``_ops.py``,
``_batch.py``) with blocking sockets (``_transport.py``), in the calling
thread: every step of an operation, its offloaded copies included, runs
here.  ``AsyncClient`` drives the same operations on an event loop.
"""

from __future__ import annotations

import builtins
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeVar, overload

from .._defaults import ENV_TOKEN, default_url
from .._wire import Holder, SessionInfo, Stat, TensorInfo
from . import _batch, _files, _into, _ops, _pickle, _push, _state
from ._background import Background
from ._core import Core
from ._tensor import SharedTensor
from ._tensormap import TensorMap
from ._transport import Transport

if TYPE_CHECKING:
    from typing_extensions import Self

_T = TypeVar("_T")  # the buffer get(out=) fills and returns


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

    ``lane``: on a unix socket, the client asks the broker for a
    shared-memory lane, and the requests it serves (``stat``, ``get``, and
    a ``put`` whose bytes fit in the request, so far) go through memory
    shared with the broker instead of HTTP; ``False`` (or
    ``$TENSORDEPOT_LANE=0``) keeps everything on HTTP, as do TCP and a
    broker started with ``--no-lane``.

    Creating a Client opens a session: ``BrokerUnavailable`` if nothing
    answers at ``url`` (or what answers is not a tensordepot broker),
    ``AuthError`` if the broker refuses the credentials, ``LimitExceeded``
    if this process holds too many sessions.

    A Client may be shared by threads.  It survives ``fork()``: the child gets
    a session of its own that holds the views it inherited (README, Lifetime:
    M8).  Every method raises a ``DepotError`` subclass: ``InvalidRequest``
    (also a ``ValueError``) or ``InvalidType`` (also a ``TypeError``) for bad
    arguments, ``BrokerUnavailable`` when the broker cannot be reached."""

    _core: Core

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
        self._setup(url, token, timeout, label, trust_uid, open=True, lane=lane)

    def _setup(
        self,
        url: str | None,
        token: str | None,
        timeout: float,
        label: str | None,
        trust_uid: Any,
        *,
        open: bool,
        lane: bool | None = None,
    ) -> None:
        self.url = url or default_url()
        self._core = Core(
            self.url,
            token=token or os.environ.get(ENV_TOKEN),
            timeout=timeout,
            label=label,
            trust_uid=trust_uid,
            transport=Transport,
            open=open,
            lane=lane,
        )
        self._run = self._core.run
        _pickle.track(self)

    @classmethod
    def _unopened(
        cls, url: str, *, token: str | None, timeout: float, label: str | None, trust_uid: Any
    ) -> Client:
        """A Client whose session opens on its first call (one unpickled)."""
        c = cls.__new__(cls)
        c._setup(url, token, timeout, label, trust_uid, open=False)
        return c

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        """A pickle of this client is its configuration (token included: never
        store one); unpickled, a fresh client that opens its own session on
        its first call.  So a Dataset that keeps a Client works under
        DataLoader workers started with spawn or forkserver."""
        return _pickle.reduce_client(self._core, "sync")

    # -- plumbing ----------------------------------------------------------
    def _call(self, method: str, path: str, body: Any = None, **kw: Any) -> Any:
        """One request under this session (``Core.call``), for tests and tools."""
        return self._run(self._core.call(method, path, body, **kw))

    _rid = staticmethod(Core.rid)

    @property
    def _transport(self) -> Transport:
        return self._core.transport  # type: ignore[return-value]

    @property
    def _bg(self) -> Background | None:
        return self._core.bg

    @property
    def _session(self) -> SessionInfo | None:
        return self._core.session

    @property
    def _sid(self) -> str:
        return self._core.sid

    @property
    def _closed(self) -> bool:
        return self._core.closed

    @property
    def _closing(self) -> bool:
        return self._core.closing

    # -- writing -----------------------------------------------------------
    def put(
        self, name: str, x: Any, *, ttl: float | None = None, device: Any = None, dtype: Any = None
    ) -> int:
        """Copy ``x`` into broker memory as the next version of ``name``; returns the version.

        ``x`` may be a numpy array or scalar, any ``__dlpack__`` object
        (torch, jax, cupy, on the CPU or a GPU), or a Python number or list
        of numbers with ``dtype`` (a name such as ``"float32"``, or a numpy or
        torch dtype), which they are stored as; without it they are refused,
        as their dtype would be a guess.
        Non-contiguous input is stored contiguous.  The tensor outlives this
        process; ``ttl`` deletes it that many seconds after publishing.
        ``device`` ("cpu", "cuda", "cuda:N", "cuda:GPU-<uuid>") is where the
        copy goes; by default the input's own device.  A ``SharedTensor``
        this client got is linked, not copied: both names share the bytes.

        Raises ``InvalidType`` for a value that is not a tensor or a bad
        name type, ``InvalidRequest`` for a bad name (1 to 512 printable
        ASCII characters, no spaces), dtype or ttl, ``OutOfMemory`` when the
        broker's memory limit cannot fit it."""
        return self._run(_ops.put(self._core, name, x, ttl, device, dtype))

    def empty(
        self,
        name: str,
        shape: Iterable[int],
        dtype: Any = "float32",
        *,
        device: str = "cpu",
        ttl: float | None = None,
    ) -> SharedTensor:
        """A writable tensor in broker memory: fill it in place, then ``publish()``.

        No copy is ever made.  ``shape`` is a sequence of ints, ``dtype`` a
        name ("float32", "bfloat16", ...) or a numpy/torch dtype, ``device``
        "cpu" or a GPU ("cuda", "cuda:N", "cuda:GPU-<uuid>").  Unpublished
        tensors are reclaimed if this process dies (or after the broker's
        --alloc-ttl).  After ``publish()`` its views stay readable, and a
        write through them no longer reaches anyone else.  Raises
        ``InvalidRequest`` for a bad name, shape or dtype and ``OutOfMemory``
        when it does not fit."""
        return self._run(_ops.empty(self._core, name, shape, dtype, device, ttl))

    def share(
        self,
        name: str,
        tensor: Any,
        *,
        ttl: float | None = None,
        stream: Any = None,
        wait_on_close: float = 30.0,
    ) -> int:
        """Publish a GPU tensor's own memory as the next version of ``name``, without a copy.

        The name is withdrawn when this Client's session ends, and CUDA keeps
        no promise to readers once this process frees the memory or exits:
        readers get ``TensorBroken`` then.  ``close()`` waits up to
        ``wait_on_close`` seconds for readers to release it.  ``stream``: the
        stream the tensor was written on, if not the framework's current one.
        ``put`` (a copy the broker owns) is the safer default."""
        return self._run(_ops.share(self._core, name, tensor, ttl, stream, wait_on_close))

    def put_many(
        self, tensors: Mapping[str, Any], *, ttl: float | None = None, device: Any = None
    ) -> dict[str, int]:
        """Put a whole state dict: one round trip to allocate, one to publish.

        ``tensors`` maps names to what ``put`` accepts; returns each name's
        new version.  All of them are published, or none (an error leaves
        nothing behind).  GPU tensors stay on their GPU unless ``device``
        says otherwise.  Raises ``InvalidType`` if ``tensors`` is not a
        mapping, and what ``put`` raises for any of its items."""
        return self._run(_batch.put_many(self._core, tensors, ttl, device))

    def put_state_dict(self, prefix: str, state_dict: Any, *, ttl: float | None = None) -> int:
        """Put a nested state dict (an optimizer's: dicts with int keys,
        lists, tuples, numbers, strings, None, tensors) under ``prefix`` in
        one batch: each tensor as ``prefix`` + its path (``state.0.exp_avg``),
        the rest as ``prefix + "__structure__"``.  A reader gets all of one
        put or none of it; names the previous put used and this one does not
        are deleted.  Returns the structure's version."""
        return self._run(_state.put_state_dict(self._core, prefix, state_dict, ttl))

    def get_state_dict(self, prefix: str, timeout: float | None = 0.0) -> Any:
        """The state dict ``put_state_dict`` put under ``prefix``, rebuilt:
        tensors zero copy, as the kind they were put as (torch, numpy; others
        as ``SharedTensor``), so ``optimizer.load_state_dict`` takes it.
        ``timeout`` is as for ``get``."""
        return self._run(_state.get_state_dict(self._core, prefix, timeout))

    # -- reading -----------------------------------------------------------
    @overload
    def get(
        self,
        name: str,
        timeout: float | None = 0.0,
        *,
        newer_than: int | None = 0,
        version: int | None = None,
        out: None = None,
    ) -> SharedTensor: ...
    @overload
    def get(
        self,
        name: str,
        timeout: float | None = 0.0,
        *,
        newer_than: int | None = 0,
        version: int | None = None,
        out: _T,
    ) -> _T: ...
    def get(
        self,
        name: str,
        timeout: float | None = 0.0,
        *,
        newer_than: int | None = 0,
        version: int | None = None,
        out: Any = None,
    ) -> Any:
        """Lease the newest published version of ``name`` (read-only, zero copy).

        ``timeout=0`` (the default) raises ``TensorNotFound`` at once if there is
        none; a number waits up to that many seconds; ``None`` (or ``inf``)
        waits forever.  ``newer_than=v`` waits for a version newer than ``v``.
        ``version=v`` leases exactly ``v``, now, while it lives: the newest, or
        an older one that some lease still keeps (a sender's, say).
        The lease ends when the returned ``SharedTensor`` and every view made
        from it are gone.  On the shared-memory lane, a get of the newest
        version right after the views of this client's last get of the same
        version are gone takes that lease back, with no request, while the
        broker's board shows the version is still the newest (the answer is
        the broker's; the broker does not count such a get).
        Raises ``TensorNotFound`` when nothing (newer) was
        published in time, ``InvalidRequest``/``InvalidType`` for a bad name,
        timeout or version.

        ``out=buffer`` (a numpy array, a torch tensor on any device, a cupy
        array) copies the version into ``buffer`` instead, gives the lease
        back, and returns ``buffer``; its dtype and shape must match exactly
        (``InvalidRequest``, and nothing written, if not)."""
        if out is not None:
            return self._run(_into.get_into(self._core, name, timeout, newer_than, version, out))
        return self._run(_ops.get(self._core, name, timeout, newer_than, version))

    def get_many(
        self,
        names: Iterable[str],
        timeout: float | None = 0.0,
        *,
        newer_than: int | Mapping[str, int] = 0,
        wait: str = "all",
        out: Mapping[str, Any] | None = None,
    ) -> TensorMap:
        """Lease many tensors in one round trip, under one deadline (all of
        them, or an error and none).

        ``names`` is an iterable of names (a str is refused: pass a list);
        ``timeout`` is as for ``get``.  ``newer_than``: a version every name
        must be newer than, or a mapping from name to version (names it
        lacks: any version; a key that is not in ``names`` is refused),
        e.g. the versions of the previous ``get_many``.  ``wait="all"``
        waits until every name has such a version; ``wait="any"`` until one
        has, and then returns the newest version of every name (compare
        ``.version`` to see which are new).  Returns a ``TensorMap``: a
        dict-like mapping from name to ``SharedTensor``, each made when
        first read, all sharing the batch's leases and mappings.  Raises
        ``TensorNotFound`` naming every name that was missing when the
        deadline passed.

        ``out={name: buffer}`` copies those names into the buffers, as
        ``get(out=)`` does (every buffer is checked before any is written),
        and maps them to their buffers in the answer."""
        if out is not None:
            return self._run(_into.get_many_into(self._core, names, timeout, newer_than, wait, out))
        return self._run(_batch.get_many(self._core, names, timeout, newer_than, wait))

    def push(
        self,
        name: str,
        to: str,
        *,
        token: str | None = None,
        tls_ca: str | bytes | None = None,
        timeout: float | None = None,
    ) -> int:
        """Send the newest version of ``name`` to the broker on another host whose
        Flight endpoint is ``to`` (``grpc://HOST:PORT``, ``grpc+tls://``); returns
        its version there.  ``token`` (default ``$TENSORDEPOT_PEER_TOKEN``) needs
        write scope there.  Needs ``pip install 'tensordepot[flight]'``."""
        return self._run(_push.push(self._core, name, to, token, tls_ca, timeout))

    # -- files ---------------------------------------------------------------
    def load_file(
        self,
        path: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
        prefix: str = "",
        *,
        ttl: float | None = None,
        progress: Callable[[int, int], None] | None = None,
    ) -> dict[str, int]:
        """Put every tensor of the safetensors file ``path`` as ``prefix`` +
        its name, in one batch (all of them, or none), each copied once from
        the file; its metadata is kept as ``prefix + "__metadata__"``.
        ``path`` may also be a sharded checkpoint: its folder, its index
        (``model.safetensors.index.json``) or a list of its files.
        ``progress(done, total)`` hears the bytes copied as the copy goes.
        Returns the versions.  Raises ``InvalidRequest`` for a file it cannot
        read, saying why."""
        return self._run(_files.load_file(self._core, path, prefix, ttl, progress))

    def save_file(
        self,
        prefix: str,
        path: str | os.PathLike[str],
        *,
        progress: Callable[[int, int], None] | None = None,
        max_shard_size: int | str | None = None,
    ) -> int:
        """Write every published tensor whose name starts with ``prefix`` to
        the safetensors file ``path``, named without the prefix (a whole file
        or none: it is written beside and renamed), with the metadata
        ``load_file`` kept.  With ``max_shard_size`` (bytes, or ``"5GB"``), ``path`` is a
        folder that gets shards and ``model.safetensors.index.json``, as
        ``save_pretrained`` writes them.  Returns the bytes of tensors written."""
        return self._run(_files.save_file(self._core, prefix, path, progress, max_shard_size))

    # -- names ---------------------------------------------------------------
    def delete(self, name: str | None = None, *, prefix: str | None = None) -> builtins.list[str]:
        """Remove ``name``, or every name that starts with ``prefix`` (in one
        request; none may match), now; readers keep their bytes until they
        release them.  Returns the names deleted.

        Raises ``TensorNotFound`` if there is no such name."""
        return self._run(_ops.delete(self._core, name, prefix))

    def delete_many(self, names: Iterable[str]) -> builtins.list[str]:
        """Remove every one of ``names`` in one request, or, if one does not
        exist, none (``TensorNotFound`` names every missing one)."""
        return self._run(_ops.delete_many(self._core, names))

    def list(self, prefix: str = "") -> builtins.list[TensorInfo]:  # ``list``: this method
        """Every name with a version (those that start with ``prefix``): one
        ``TensorInfo`` each, for its newest version, sorted by name."""
        return self._run(_ops.names(self._core, prefix))

    def stat(self) -> Stat:
        """The broker's accounting: memory, names, versions, leases, sessions (``Stat``)."""
        return self._run(_ops.stat(self._core))

    def who(self) -> builtins.list[Holder]:
        """Which process holds what: a ``Holder`` per session (pid, label,
        leases, bytes, and the versions it holds by name).  Your own
        sessions; an admin token (or the socket's owner) sees every one."""
        return self._run(_ops.who(self._core))

    @property
    def round_trips(self) -> int:
        """Control-plane requests this client has sent (releases included)."""
        return self._core.round_trips

    # -- closing -------------------------------------------------------------
    def close(self) -> None:
        """End the session.  Never raises.

        Leases of views that are still alive (numpy arrays, torch tensors)
        stay held until those views are freed or this process exits, so
        closing never pulls memory out from under a live tensor."""
        self._core.close()

    def __enter__(self) -> Self:
        """``with Client() as c:`` closes it on leaving the block."""
        return self

    def __exit__(self, *exc: object) -> None:
        """Close (never raises)."""
        self.close()

    def __repr__(self) -> str:
        return f"Client({self.url!r}, session={self._core.sid[:8]})"


_pickle.MAKERS["sync"] = Client._unopened
