"""SharedTensor: a tensor in broker memory, exported through DLPack.

Lifetime: a ``get`` takes a lease.  The lease is held by a small ``_Lease``
object that the SharedTensor and every view exported from it (numpy arrays,
DLPack capsules, torch/jax tensors) keep alive.  When the last of them is
gone, a finalizer queues the lease for release; a background thread sends the
releases, so dropping a tensor never blocks on the broker.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from .._errors import DepotError, InvalidRequest, TensorBroken, TensorReleased
from .._wire import Handle
from ..shm import DType, array_at, dtype_from_name, export_capsule, numpy_dtype
from ..shm._dlpack import Views, export_view, kDLCPU

if TYPE_CHECKING:
    from typing_extensions import Self

_new = object.__new__


class Publisher(Protocol):
    """The client core a tensor came from (``_core.Core``)."""

    def publish_now(self, t: SharedTensor) -> None: ...


class _Lease:
    """Keeps a lease alive; when the last reference to it goes, ``on_free``
    queues the release.

    ``__del__``, not ``weakref.finalize``: a batch makes thousands of leases,
    and registering a finalizer costs several times more than the rest of a
    lease.  It runs wherever the last reference dies (any thread, inside any
    code, at interpreter exit too), so ``on_free`` must only queue, never
    block or take a lock; and it never raises."""

    __slots__ = ("id", "on_free")

    def __init__(self, lease_id: int, on_free: Callable[[int], None]) -> None:
        self.id = lease_id
        self.on_free = on_free

    def __del__(self) -> None:
        # A Ctrl-C that lands inside would lose the release, and the lease
        # with it until the session ends: try again (releasing twice is
        # harmless, ids are never reused).
        for _ in range(8):
            try:
                self.on_free(self.id)
                return
            except KeyboardInterrupt:
                continue
            except BaseException:  # nobody could handle it here
                return


class _Owner:
    """What every exported view holds: the mapping, and the lease if any."""

    __slots__ = ("lease", "mapping")

    def __init__(self, mapping: Any, lease: _Lease | None) -> None:
        self.mapping = mapping
        self.lease = lease


class SharedTensor:
    """A tensor in broker memory.  Read-only from ``get``; writable from ``empty``
    until ``publish()``.

    Import it without copying through DLPack (``torch.from_dlpack(t)``,
    ``np.from_dlpack(t)``, ``jax.dlpack.from_dlpack(t)``) or ``t.numpy()``.
    Views stay valid after the SharedTensor object is gone, and the lease ends
    when the last of them is freed.

    Attributes: ``name``, ``version``, ``shape``, ``strides`` (in elements),
    ``dtype`` (a name such as ``"float32"``), ``device`` (``"cpu"``),
    ``nbytes``, ``writable``, ``published``.

    A numpy view of a read-only tensor refuses writes.  torch and jax ignore
    the read-only flag; a write through them changes a private copy of the
    page in the writing process only, never what other processes read.
    """

    def __init__(
        self,
        client: Publisher,
        handle: Handle,
        window: Any,
        lease: _Lease | None,
        *,
        writable: bool,
    ) -> None:
        self._setup(
            weakref.ref(client),
            handle.name,
            handle.version,
            tuple(handle.shape),
            tuple(handle.strides),
            dtype_from_name(handle.dtype),
            handle.device,
            handle.nbytes,
            handle.state == "ready",
            window,
            window.address,
            _Owner(window, lease),
            writable,
        )

    # What a batch's tensor (``_of``) takes from the class: a published,
    # read-only tensor in host memory.  ``_setup`` sets each of them.
    device: str = "cpu"
    writable = False
    _writer = False
    published = True
    _flats: tuple[Any, Any] | None = None  # the window as flat uint8 arrays (export_view) ...
    _flat_offset = 0  # ... and where this tensor starts in it
    _views: Views | None = None  # a batch's: the run its read-only array is made in ...
    _views_k = 0  # ... and its place there (export_view)

    @classmethod
    def _of(
        cls,
        client: weakref.ref[Publisher],
        name: str,
        version: int,
        shape: tuple[int, ...],
        strides: tuple[int, ...],
        dt: DType,
        nbytes: int,
        window: Any,
        flats: tuple[Any, Any] | None,
        offset: int,
        owner: _Owner,
        session: str,
        instance: str,
    ) -> SharedTensor:
        """A published CPU tensor of a batch, at ``offset`` in ``window``, which
        it may share with the batch's other tensors of the same segment
        (``flats``: the window as flat uint8 arrays, writable and read-only,
        each ``owned`` by ``owner``, which the tensors of its pack share;
        None: its views are made from its address),
        leased in ``session`` of the broker's run ``instance``.  The fields
        ``_setup`` sets, those the class gives aside, in a batch's loop."""
        t = _new(cls)
        t.name = name
        t.version = version
        t.shape = shape
        t.strides = strides
        t.dtype = dt.name
        t.nbytes = nbytes
        t._dt = dt
        t._address = window.address + offset
        t._window = window
        t._owner = owner
        t._client = client
        t._lease_session = session
        t._instance = instance
        t._flats = flats
        t._flat_offset = offset
        return t

    def _setup(
        self,
        client: weakref.ref[Publisher],
        name: str,
        version: int,
        shape: tuple[int, ...],
        strides: tuple[int, ...],
        dt: DType,
        device: str,
        nbytes: int,
        published: bool,
        window: Any,
        address: int,
        owner: _Owner,
        writable: bool,
    ) -> None:
        self.name: str = name
        self.version: int = version
        self.shape: tuple[int, ...] = shape
        self.strides: tuple[int, ...] = strides
        self.dtype: str = dt.name
        self.device = device
        self.nbytes: int = nbytes
        self.writable = writable
        self._writer = writable  # from empty(): published once
        self.published = published
        self._dt: DType = dt
        self._address: int = address
        self._window = window
        self._owner: _Owner | None = owner
        self._client = client
        self._lease_session = ""  # the session the lease was taken in
        self._instance = ""  # the run of the broker it came from

    # -- DLPack ------------------------------------------------------------
    def __dlpack_device__(self) -> tuple[int, int]:
        """``(kDLCPU, 0)``: the bytes are in host memory."""
        return (kDLCPU, 0)

    def __dlpack__(
        self,
        *,
        stream: Any = None,
        max_version: tuple[int, int] | None = None,
        dl_device: tuple[int, int] | None = None,
        copy: bool | None = None,
    ) -> Any:
        """A DLPack capsule (legacy when ``max_version`` is None, else versioned).

        Read-only tensors set the READ_ONLY flag; ``copy=True`` exports an
        independent copy flagged IS_COPIED; ``copy=False`` never copies."""
        owner = self._owner or self._alive()  # (an _Owner is true; None raises)
        if stream is not None:  # the array API: CPU producers take no stream
            raise BufferError(f"stream={stream!r}: CPU tensors take stream=None")
        if dl_device is not None and tuple(dl_device) != (kDLCPU, 0):
            raise BufferError(
                f"tensor {self.name!r} is on the CPU and cannot be exported to DLPack device "
                f"{tuple(dl_device)} without a copy; import it on the CPU and move it"
            )
        if self._flats is not None and not copy and not self.writable:
            return export_view(
                self._flats,
                self._flat_offset,
                self.shape,
                self._dt,
                max_version,
                self._views,
                self._views_k,
            )
        return export_capsule(
            self._address,
            self.shape,
            self.strides,
            self._dt,
            owner,
            read_only=not self.writable,
            max_version=max_version,
            copy=bool(copy),
        )

    def numpy(self) -> Any:
        """A numpy view, no copy (read-only unless from ``empty``).  bfloat16 and
        float8 need ml_dtypes; without it this raises ``InvalidRequest`` saying
        what to do instead.  Raises ``TensorReleased`` after ``release()``."""
        owner = self._alive()
        try:
            dt = numpy_dtype(self._dt)
        except ValueError as exc:
            raise InvalidRequest(str(exc)) from None
        byte_strides = tuple(s * self._dt.itemsize for s in self.strides)
        return array_at(
            self._address, self.shape, byte_strides, dt, writable=self.writable, owner=owner
        )

    def __array__(self, dtype: Any = None, copy: bool | None = None) -> Any:
        """``np.asarray(t)``: the ``numpy()`` view; a copy only for another
        ``dtype`` or ``copy=True`` (``copy=False`` refuses to convert)."""
        import numpy as np

        arr = self.numpy()
        if dtype is not None and np.dtype(dtype) != arr.dtype:
            if copy is False:
                raise ValueError(
                    f"converting {self.dtype} to {np.dtype(dtype)} needs a copy, and copy=False"
                )
            return arr.astype(dtype)
        return arr.copy() if copy else arr

    # -- lifetime ----------------------------------------------------------
    def _alive(self) -> _Owner:
        if self._owner is None:
            raise TensorReleased(
                f"tensor {self.name!r} v{self.version} was released; get it again to read it"
            )
        return self._owner

    def _lease_id(self) -> int | None:
        owner = self._owner
        return owner.lease.id if owner is not None and owner.lease is not None else None

    def publish(self) -> SharedTensor:
        """Make this ``empty()`` tensor visible to readers (once); returns it.

        Raises ``InvalidRequest`` for a tensor from ``get`` or one already
        published, and ``TensorBroken`` if its allocation is gone (the broker
        restarted, or the name was deleted meanwhile).  From an
        ``AsyncClient``, ``await client.publish(t)`` does the same without
        blocking the event loop."""
        self._publishing().publish_now(self)
        return self

    def _publishing(self) -> Publisher:
        """The client that publishes this tensor; raises if it cannot be published."""
        if not self._writer:
            raise InvalidRequest(
                f"tensor {self.name!r} came from get(); only empty() tensors are published"
            )
        if self.published:
            raise InvalidRequest(f"tensor {self.name!r} v{self.version} is already published")
        client = self._client()
        if client is None:
            raise TensorReleased("the client that created this tensor is gone")
        self._alive()
        return client

    def _broken(self, exc: DepotError) -> TensorBroken:
        # The memory this tensor was written into is gone: the broker died,
        # or reclaimed the allocation (its name was deleted meanwhile).
        return TensorBroken(
            f"cannot publish {self.name!r} v{self.version}: its allocation is gone ({exc}); "
            f"write it again with empty() or put()"
        )

    def _seal(self) -> None:
        # Published bytes never change: before the broker publishes, a write
        # through this tensor's views starts to stay in this process (README,
        # Lifetime: M2).  A publish that fails after this publishes, when
        # tried again, the bytes as they were at the first try.
        make_private = getattr(self._window, "make_private", None)  # CPU windows; not CUDA blocks
        if make_private is not None:
            make_private()
        self.writable = False

    def release(self) -> None:
        """Drop this object's hold on the memory.  Idempotent.

        Views already exported (numpy, torch) keep the lease until they are
        freed too, so releasing never pulls memory out from under them."""
        self._owner = None
        self._flats = self._views = None  # a batch's: they keep the owner too (export_view)

    @property
    def released(self) -> bool:
        """Whether ``release()`` was called: reading it again raises ``TensorReleased``."""
        return self._owner is None

    def __enter__(self) -> Self:
        """``with c.get(name) as t:`` releases it on leaving the block."""
        return self

    def __exit__(self, *exc: object) -> None:
        """``release()``."""
        self.release()

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        """A pickle names the tensor (its broker, name and version); unpickled in
        another process, it is got there again, zero copy, under a lease of
        that process's own (``TensorNotFound`` if that version is no longer
        served).  So it travels through multiprocessing and torch.multiprocessing
        Queues, and back from DataLoader workers.  Unpublished ``empty()``
        tensors are refused."""
        from ._pickle import reduce_tensor

        return reduce_tensor(self)

    def __repr__(self) -> str:
        state = (
            "released" if self._owner is None else ("writable" if self.writable else "read-only")
        )
        return (
            f"SharedTensor({self.name!r}, v{self.version}, shape={self.shape}, "
            f"dtype={self.dtype}, device={self.device}, {state})"
        )
