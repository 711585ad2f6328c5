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

Consuming.  ``import_dlpack`` reads any ``__dlpack__`` producer (torch, jax,
cupy host arrays, numpy) into a numpy view of the same bytes, without numpy
having to know the dtype, and calls the producer's deleter when done.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ._dtypes import DType, dtype_from_dlpack
from ._posix import array_at

if TYPE_CHECKING:
    from typing_extensions import Self

kDLCPU = 1
kDLCUDA = 2
kDLCUDAHost = 3

FLAG_READ_ONLY = 1 << 0
FLAG_IS_COPIED = 1 << 1

# Our own capsules say DLPack 1.1: the float8 codes arrived in 1.1.
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


def export_capsule(address: int, shape: tuple[int, ...], strides: tuple[int, ...], dtype: DType,
                   owner: Any, *, read_only: bool, max_version: tuple[int, int] | None,
                   copy: bool = False) -> Any:
    """A DLPack capsule for memory at ``address`` (strides in elements).

    A legacy ``dltensor`` capsule when ``max_version`` is None or older than
    1.0, a versioned one otherwise.  ``copy=True`` exports an independent copy
    flagged IS_COPIED.  ``owner`` is kept alive until the consumer's deleter runs.
    """
    import numpy as np

    carrier = np.dtype(_numpy_carrier(dtype))
    byte_strides = tuple(s * dtype.itemsize for s in strides)
    arr = array_at(address, shape, byte_strides, carrier, writable=True, owner=owner)
    if copy:
        arr = np.array(arr, copy=True)
    versioned = max_version is not None and max_version[0] >= 1
    cap = arr.__dlpack__(max_version=VERSION if versioned else None)
    if versioned:
        mt = DLManagedTensorVersioned.from_address(_api.PyCapsule_GetPointer(cap, b"dltensor_versioned"))
        mt.version.major, mt.version.minor = VERSION
        flags = mt.flags & ~FLAG_READ_ONLY
        if read_only and not copy:
            flags |= FLAG_READ_ONLY
        if copy:
            flags |= FLAG_IS_COPIED
        mt.flags = flags
        t = mt.dl_tensor
    else:
        t = DLManagedTensor.from_address(_api.PyCapsule_GetPointer(cap, b"dltensor")).dl_tensor
    t.dtype.code, t.dtype.bits, t.dtype.lanes = dtype.code, dtype.bits, dtype.lanes
    return cap


class Imported:
    """A producer's tensor read through DLPack: a numpy view of its bytes.

    ``array`` has a numpy dtype of the same item size (bfloat16 reads as
    uint16); ``dtype`` is the real type.  Call ``close()`` when done: it
    returns the tensor to its producer by calling the DLPack deleter.
    """

    def __init__(self, array: Any, dtype: DType, device: tuple[int, int],
                 release: Callable[[], None]) -> None:
        self.array = array
        self.dtype = dtype
        self.device = device
        self._release: Callable[[], None] | None = release

    def close(self) -> None:
        release, self._release = self._release, None
        self.array = None
        if release is not None:
            release()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _call_deleter(deleter: Any, ptr: int) -> None:
    if deleter:
        deleter(ptr)


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
    try:
        cap = obj.__dlpack__(max_version=VERSION)
    except TypeError:  # producers that predate DLPack 1.0 take no max_version
        cap = obj.__dlpack__()
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
    elif _api.PyCapsule_IsValid(cap, b"dltensor"):
        ptr = _api.PyCapsule_GetPointer(cap, b"dltensor")
        ml = DLManagedTensor.from_address(ptr)
        deleter, t = ml.deleter, ml.dl_tensor
        _api.PyCapsule_SetName(cap, _USED)
    else:
        raise BufferError("__dlpack__ returned something that is not an unconsumed DLPack capsule")
    # From here we own the managed tensor and must call its deleter exactly once.
    try:
        dtype = dtype_from_dlpack(t.dtype.code, t.dtype.bits, t.dtype.lanes)
        ndim = t.ndim
        shape = tuple(t.shape[i] for i in range(ndim))
        if t.strides:
            strides = tuple(t.strides[i] * dtype.itemsize for i in range(ndim))
        else:
            strides = None  # NULL strides mean C order
        address = (t.data or 0) + t.byte_offset
        arr = array_at(address, shape, strides, dtype.storage if dtype.numpy_name is None else dtype.numpy_name,
                       writable=False, owner=None)
    except BaseException:  # whatever went wrong, the producer gets its tensor back
        _call_deleter(deleter, ptr)
        raise
    return Imported(arr, dtype, (t.device.device_type, t.device.device_id),
                    lambda: _call_deleter(deleter, ptr))
