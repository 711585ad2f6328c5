"""DLPack capsules: producing them for our tensors, consuming them on put.

Producing.  The capsule machinery (the ``PyCapsule`` destructor that frees an
unconsumed tensor, the deleter a consumer calls when its tensor dies) must be
C code: a consumer may free its tensor while a Python exception is in flight,
and a ctypes callback cannot preserve that exception.  numpy already ships a
correct C implementation, so we let numpy build the capsule from a private,
same-sized view of our memory, then patch the fields numpy cannot express:

* the dtype triple (bfloat16 is code 4, the float8 family codes 7..14; numpy
  would call them uint16/uint8);
* the READ_ONLY flag of versioned capsules (numpy refuses to export
  read-only arrays as legacy capsules, and jax still asks for legacy ones,
  so the private view is writable and the flag is set here).

The private view holds a reference to ``owner``; numpy's deleter drops it, so
the mapping (and the lease) stay alive exactly as long as the consumer's
tensor does, and a capsule a consumer rejects is freed by its destructor.

CUDA.  The same capsule, with its device patched to ``(kDLCUDA, ordinal)``,
describes device memory: numpy only records the address and never reads
the bytes when it exports, so a private view at a device address is safe
as long as nothing reads it through numpy.  ``parse_stream`` validates the
``stream`` argument of a CUDA producer's ``__dlpack__``.

Consuming.  ``import_dlpack`` reads any ``__dlpack__`` producer (torch, jax,
cupy host arrays, numpy) into a numpy view of the same bytes, without numpy
having to know the dtype, and calls the producer's deleter when done.
``borrow_dlpack`` reads the same fields from a producer on any device
(a CUDA tensor to copy from) without building a view.
"""

from __future__ import annotations

import ctypes
import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .._wire import c_strides
from ._dtypes import DType, dtype_from_dlpack
from ._posix import array_at

if TYPE_CHECKING:
    from typing_extensions import Self

kDLCPU = 1
kDLCUDA = 2
kDLCUDAHost = 3
kDLCUDAManaged = 13

# The array API's stream values for CUDA producers (__dlpack__(stream=...)):
# None and 1 name the legacy default stream, 2 the per-thread default stream,
# -1 asks for no synchronisation, 0 is ambiguous and not allowed, and any
# other positive integer is a cudaStream_t.  cudaStreamLegacy and
# cudaStreamPerThread are the handles 0x1 and 0x2, so the values pass
# straight to the CUDA runtime.
STREAM_LEGACY = 1
STREAM_PER_THREAD = 2
NO_SYNC = -1

FLAG_READ_ONLY = 1 << 0
FLAG_IS_COPIED = 1 << 1

# Capsules of dtypes numpy lacks say DLPack 1.1: the float8 codes arrived in
# 1.1.  Those of numpy's own dtypes keep the 1.0 numpy writes: 1.1 has the
# same layout and adds only codes and a flag they do not use, and rewriting
# the header costs two foreign calls per capsule (a third of a batch
# tensor's export).
VERSION = (1, 1)


class DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device", DLDevice),
        ("ndim", ctypes.c_int32),
        ("dtype", DLDataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    ]


_Deleter = ctypes.CFUNCTYPE(None, ctypes.c_void_p)


class DLManagedTensor(ctypes.Structure):
    _fields_ = [("dl_tensor", DLTensor), ("manager_ctx", ctypes.c_void_p), ("deleter", _Deleter)]


class DLPackVersion(ctypes.Structure):
    _fields_ = [("major", ctypes.c_uint32), ("minor", ctypes.c_uint32)]


class DLManagedTensorVersioned(ctypes.Structure):
    _fields_ = [
        ("version", DLPackVersion),
        ("manager_ctx", ctypes.c_void_p),
        ("deleter", _Deleter),
        ("flags", ctypes.c_uint64),
        ("dl_tensor", DLTensor),
    ]


_api = ctypes.pythonapi
_api.PyCapsule_GetPointer.restype = ctypes.c_void_p
_api.PyCapsule_GetPointer.argtypes = [ctypes.py_object, ctypes.c_char_p]
_api.PyCapsule_IsValid.restype = ctypes.c_int
_api.PyCapsule_IsValid.argtypes = [ctypes.py_object, ctypes.c_char_p]
_api.PyCapsule_SetName.restype = ctypes.c_int
_api.PyCapsule_SetName.argtypes = [ctypes.py_object, ctypes.c_char_p]

# PyCapsule_SetName keeps the pointer, so these names must live forever.
_USED = ctypes.c_char_p(b"used_dltensor")
_USED_VERSIONED = ctypes.c_char_p(b"used_dltensor_versioned")


def _numpy_carrier(dtype: DType) -> str:
    """The numpy dtype numpy can export for ``dtype``'s bytes."""
    return dtype.numpy_name or dtype.storage


def export_capsule(
    address: int,
    shape: tuple[int, ...],
    strides: tuple[int, ...],
    dtype: DType,
    owner: Any,
    *,
    read_only: bool,
    max_version: tuple[int, int] | None,
    copy: bool = False,
    device: tuple[int, int] = (kDLCPU, 0),
) -> Any:
    """A DLPack capsule for memory at ``address`` (strides in elements).

    A legacy ``dltensor`` capsule when ``max_version`` is None or older than
    1.0, a versioned one otherwise.  ``copy=True`` exports an independent copy
    flagged IS_COPIED (host memory only: numpy would read device memory).
    ``device`` is the DLPack device the address belongs to.  ``owner`` is
    kept alive until the consumer's deleter runs.
    """
    import numpy as np

    if copy and device[0] != kDLCPU:
        raise ValueError("export_capsule copies host memory only")
    carrier = _CARRIER.get(dtype.name) or _carrier_dtype(dtype)
    byte_strides = tuple(s * dtype.itemsize for s in strides)
    arr = array_at(address, shape, byte_strides, carrier, writable=True, owner=owner)
    if not copy and device[0] == kDLCPU:
        return export_carrier(arr, dtype, read_only=read_only, max_version=max_version)
    if copy:
        arr = np.array(arr, copy=True)
    versioned = max_version is not None and max_version[0] >= 1
    cap = arr.__dlpack__(max_version=VERSION if versioned else None)
    flags = (FLAG_READ_ONLY if read_only and not copy else 0) | (FLAG_IS_COPIED if copy else 0)
    patch_capsule(cap, dtype, device, flags)
    return cap


_OWNED: Any = None
_NDARRAY: Any = None  # numpy.ndarray, once numpy is imported (export_view)
_CARRIER: dict[str, Any] = {}  # dtype name -> its numpy carrier dtype


def _owned_type() -> Any:
    global _OWNED
    if _OWNED is None:
        import numpy as np

        class Owned(np.ndarray):
            """An array that keeps ``_owner`` (a mapping, a lease) alive as long as it lives."""

        _OWNED = Owned
    return _OWNED


def owned(flat: Any, owner: Any) -> Any:
    """``flat`` (a flat uint8 array over a mapping) as an array that keeps
    ``owner`` (the mapping, a lease) alive as long as it, or any array made
    over it (``export_view``), lives.  A view of a view: numpy makes an array's
    base the first array up its chain whose own base is of another type
    (or that owns its bytes), so an array made over this one keeps this one."""
    kind = _OWNED or _owned_type()
    arr = flat.view(kind).view(kind)
    arr._owner = owner
    return arr


def _carrier_dtype(dtype: DType) -> Any:
    """``dtype``'s numpy carrier dtype, kept by name (and numpy's ndarray, once)."""
    global _NDARRAY
    import numpy as np

    _NDARRAY = np.ndarray
    dt = _CARRIER[dtype.name] = np.dtype(_numpy_carrier(dtype))
    return dt


def export_carrier(
    arr: Any, dtype: DType, *, read_only: bool, max_version: tuple[int, int] | None
) -> Any:
    """``export_capsule`` for a host ``carrier`` (not a copy): the same capsule."""
    versioned = max_version is not None and max_version[0] >= 1
    if versioned and read_only:
        arr.flags.writeable = False  # numpy then sets READ_ONLY itself
    return _exported(arr, dtype, versioned, FLAG_READ_ONLY if read_only else 0)


def export_view(
    flats: tuple[Any, Any],
    offset: int,
    shape: tuple[int, ...],
    dtype: DType,
    max_version: tuple[int, int] | None,
    views: Views | None = None,
    k: int = 0,
) -> Any:
    """The read-only ``export_capsule`` of the tensor at ``offset`` of a
    mapping, as an array over one of ``flats``: the mapping as a flat uint8
    array, each ``owned`` by what keeps the mapping, writable (for legacy
    capsules, which cannot say read-only: numpy exports no read-only array
    as one) and read-only (for versioned ones: numpy sets READ_ONLY itself).
    The array is C-ordered, of ``dtype``'s numpy carrier type, made over the
    flat array (its base, so the owner lives as long as it does; numpy
    refuses an offset outside it): a few times cheaper than an array built
    from an address.  ``views``: the run of tensors this one is the ``k``-th
    of, whose arrays over ``flats[1]`` are made together (``Views``): a
    versioned capsule is exported from the tensor's array there.  In one
    function: a batch exports a tensor each."""
    versioned = max_version is not None and max_version[0] >= 1
    if versioned and views is not None:
        return _exported((views.arrays or views.made())[k], dtype, True, FLAG_READ_ONLY)
    dt = _CARRIER.get(dtype.name) or _carrier_dtype(dtype)
    arr = _NDARRAY(shape, dt, flats[versioned], offset)
    return _exported(arr, dtype, versioned, FLAG_READ_ONLY)


class Views:
    """A run of a batch's tensors of one shape and dtype over one read-only
    flat array (``owned``), each at its offset: their arrays (``views_at``)
    are made together, when the first of them is exported, so that a batch
    read whole pays for one array of them all, and one read but not
    exported pays nothing.  Its ``offsets`` are all given before any is made."""

    __slots__ = ("arrays", "dtype", "flat", "offsets", "shape")

    def __init__(self, flat: Any, shape: tuple[int, ...], dtype: DType) -> None:
        self.flat, self.shape, self.dtype = flat, shape, dtype
        self.offsets: list[int] = []
        self.arrays: list[Any] | None = None  # made on the first export

    def made(self) -> list[Any]:
        """The arrays (made now if they are not yet)."""
        if self.arrays is None:
            self.arrays = views_at(self.flat, self.offsets, self.shape, self.dtype)
        return self.arrays


def views_at(flat: Any, offsets: list[int], shape: tuple[int, ...], dtype: DType) -> list[Any]:
    """The read-only arrays of the C-ordered tensors of one shape and dtype at
    ``offsets`` of ``flat`` (a read-only flat uint8 array, ``owned`` by what
    keeps its mapping), each of ``dtype``'s numpy carrier type, each made
    over ``flat`` or over an array made over it: what ``export_view``
    exports as they are.  Tensors evenly spaced, none overlapping the next, are the rows
    of one strided array, cut by numpy in one call (a batch of a thousand
    small tensors: a tenth of the cost of an array each)."""
    dt = _CARRIER.get(dtype.name) or _carrier_dtype(dtype)
    n = len(offsets)
    if n > 1 and shape:
        first, step = offsets[0], offsets[1] - offsets[0]
        if step >= dt.itemsize * math.prod(shape) > 0 and offsets == list(
            range(first, first + step * n, step)
        ):
            inner = [s * dt.itemsize for s in c_strides(shape)]
            return list(_NDARRAY((n, *shape), dt, flat, first, (step, *inner)))
    return [_NDARRAY(shape, dt, flat, at) for at in offsets]


def _exported(arr: Any, dtype: DType, versioned: bool, flags: int) -> Any:
    cap = arr.__dlpack__(max_version=VERSION if versioned else None)
    if dtype.numpy_name is None:  # numpy exported the carrier type: the dtype is ours
        patch_capsule(cap, dtype, (kDLCPU, 0), flags)
    return cap


def patch_capsule(cap: Any, dtype: DType, device: tuple[int, int], flags: int) -> None:
    """Set an unconsumed capsule's dtype triple and device, and (versioned
    capsules) its version and READ_ONLY / IS_COPIED flags."""
    if _api.PyCapsule_IsValid(cap, b"dltensor_versioned"):
        mt = DLManagedTensorVersioned.from_address(
            _api.PyCapsule_GetPointer(cap, b"dltensor_versioned")
        )
        mt.version.major, mt.version.minor = VERSION
        mt.flags = (mt.flags & ~(FLAG_READ_ONLY | FLAG_IS_COPIED)) | flags
        t = mt.dl_tensor
    else:
        t = DLManagedTensor.from_address(_api.PyCapsule_GetPointer(cap, b"dltensor")).dl_tensor
    t.dtype.code, t.dtype.bits, t.dtype.lanes = dtype.code, dtype.bits, dtype.lanes
    t.device.device_type, t.device.device_id = device


def parse_stream(stream: object) -> int | None:
    """The CUDA stream a consumer named in ``__dlpack__(stream=...)``.

    Returns the ``cudaStream_t`` to make wait (None and 1: the legacy default
    stream, 2: the per-thread default stream, a pointer: that stream) or
    None for -1 (the consumer synchronises itself).  Anything else is a
    TypeError (not an int) or ValueError that says what the array API allows."""
    if stream is None:
        return STREAM_LEGACY
    if isinstance(stream, bool) or not isinstance(stream, int):
        raise TypeError(
            f"stream={stream!r}: a CUDA stream is an int (a cudaStream_t such as "
            f"torch.cuda.current_stream().cuda_stream or cupy's stream.ptr), 1 or None for the "
            f"legacy default stream, 2 for the per-thread default stream, or -1 for none"
        )
    if stream == NO_SYNC:
        return None
    if stream == 0:
        raise ValueError(
            "stream=0 is ambiguous for CUDA (the array API forbids it); pass 1 for "
            "the legacy default stream or 2 for the per-thread default stream"
        )
    if stream < 0 or stream >= 1 << 64:
        raise ValueError(f"stream={stream}: not a cudaStream_t (use a pointer, 1, 2, None or -1)")
    return stream


class _Lent:
    """A producer's tensor held until ``close()`` hands it back (calls its
    DLPack deleter, once)."""

    def __init__(self, release: Callable[[], None]) -> None:
        self._release: Callable[[], None] | None = release

    def close(self) -> None:
        release, self._release = self._release, None
        if release is not None:
            release()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Imported(_Lent):
    """A producer's tensor read through DLPack: a numpy view of its bytes.

    ``array`` has a numpy dtype of the same item size (bfloat16 reads as
    uint16); ``dtype`` is the real type.  Call ``close()`` when done: it
    returns the tensor to its producer by calling the DLPack deleter.
    """

    def __init__(
        self, array: Any, dtype: DType, device: tuple[int, int], release: Callable[[], None]
    ) -> None:
        super().__init__(release)
        self.array = array
        self.dtype = dtype
        self.device = device

    def close(self) -> None:
        self.array = None
        super().close()


def _call_deleter(deleter: Any, ptr: int) -> None:
    if deleter:
        deleter(ptr)


def _consume(cap: Any) -> tuple[Any, int, DLTensor]:
    """Take ownership of an unconsumed capsule: (deleter, managed tensor pointer, DLTensor).

    The caller must call the deleter exactly once (``_call_deleter``)."""
    if _api.PyCapsule_IsValid(cap, b"dltensor_versioned"):
        ptr = _api.PyCapsule_GetPointer(cap, b"dltensor_versioned")
        mv = DLManagedTensorVersioned.from_address(ptr)
        deleter, t = mv.deleter, mv.dl_tensor
        if mv.version.major != 1:
            # ABI we do not know: the spec says call the deleter and give up.
            # Read the version first: the deleter frees the struct.
            version = f"{mv.version.major}.{mv.version.minor}"
            _api.PyCapsule_SetName(cap, _USED_VERSIONED)
            _call_deleter(deleter, ptr)
            raise BufferError(f"unsupported DLPack ABI version {version}; this reader takes 1.x")
        _api.PyCapsule_SetName(cap, _USED_VERSIONED)
        return deleter, ptr, t
    if _api.PyCapsule_IsValid(cap, b"dltensor"):
        ptr = _api.PyCapsule_GetPointer(cap, b"dltensor")
        ml = DLManagedTensor.from_address(ptr)
        _api.PyCapsule_SetName(cap, _USED)
        return ml.deleter, ptr, ml.dl_tensor
    raise BufferError("__dlpack__ returned something that is not an unconsumed DLPack capsule")


class Borrowed(_Lent):
    """The fields of a producer's DLPack tensor, on any device, borrowed
    until ``close()`` hands it back (calls the producer's deleter).

    ``strides`` are in elements, None for C order."""

    def __init__(
        self,
        address: int,
        shape: tuple[int, ...],
        strides: tuple[int, ...] | None,
        dtype: DType,
        device: tuple[int, int],
        release: Callable[[], None],
    ) -> None:
        super().__init__(release)
        self.address, self.shape, self.strides = address, shape, strides
        self.dtype, self.device = dtype, device

    @property
    def nbytes(self) -> int:
        n = self.dtype.itemsize
        for d in self.shape:
            n *= d
        return n

    @property
    def contiguous(self) -> bool:
        """C-contiguous (sizes-1 dimensions may carry any stride)."""
        if self.strides is None:
            return True
        want = 1
        for d, s in zip(reversed(self.shape), reversed(self.strides), strict=True):
            if d != 1 and s != want:
                return False
            want *= d
        return True


def _read(deleter: Any, ptr: int, t: DLTensor) -> Borrowed:
    try:
        dtype = dtype_from_dlpack(t.dtype.code, t.dtype.bits, t.dtype.lanes)
        ndim = t.ndim
        shape = tuple(t.shape[i] for i in range(ndim))
        strides = tuple(t.strides[i] for i in range(ndim)) if t.strides else None
        address = (t.data or 0) + t.byte_offset
        device = (t.device.device_type, t.device.device_id)
    except BaseException:  # whatever went wrong, the producer gets its tensor back
        _call_deleter(deleter, ptr)
        raise
    return Borrowed(address, shape, strides, dtype, device, lambda: _call_deleter(deleter, ptr))


def borrow_dlpack(obj: Any, *, stream: int | None = None) -> Borrowed:
    """Consume ``obj.__dlpack__(stream=stream)`` without viewing the bytes.

    ``stream`` is passed only when given (a CUDA consumer's stream: the
    producer orders its pending writes before it).  Producers that predate
    DLPack 1.0 or the ``stream`` keyword are asked without them."""
    kwargs: dict[str, Any] = {"max_version": VERSION}
    if stream is not None:
        kwargs["stream"] = stream
    try:
        cap = obj.__dlpack__(**kwargs)
    except TypeError:
        kwargs.pop("max_version")
        cap = obj.__dlpack__(**kwargs)
    return _read(*_consume(cap))


def import_dlpack(obj: Any) -> Imported:
    """Consume ``obj.__dlpack__()`` and view its bytes; see ``Imported``.

    Only host-accessible memory (kDLCPU, kDLCUDAHost) is viewed here.
    """
    dev = tuple(obj.__dlpack_device__()) if hasattr(obj, "__dlpack_device__") else (kDLCPU, 0)
    if dev[0] not in (kDLCPU, kDLCUDAHost):
        raise BufferError(
            f"cannot read a tensor on DLPack device {dev} from the host; move it to the CPU "
            f"first (for example x.cpu() or cupy.asnumpy(x))"
        )
    b = borrow_dlpack(obj)
    try:
        byte_strides = None if b.strides is None else tuple(s * b.dtype.itemsize for s in b.strides)
        carrier = b.dtype.storage if b.dtype.numpy_name is None else b.dtype.numpy_name
        arr = array_at(b.address, b.shape, byte_strides, carrier, writable=False, owner=None)
    except BaseException:
        b.close()
        raise
    return Imported(arr, b.dtype, b.device, b.close)
