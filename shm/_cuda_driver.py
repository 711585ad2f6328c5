"""The CUDA driver API and NVML through ctypes, for what cupy does not wrap:
device UUIDs (by UUID, not by index: CUDA_VISIBLE_DEVICES differs between
processes), an allocation's base address, and a device's used memory.
Nothing here creates a CUDA context."""

from __future__ import annotations

import ctypes
import functools
from typing import Any

from ._device import format_uuid


class CudaError(RuntimeError):
    """CUDA is unavailable here, or a CUDA call failed; the message says which."""


class _CUuuid(ctypes.Structure):
    _fields_ = [("bytes", ctypes.c_ubyte * 16)]


@functools.lru_cache(maxsize=1)
def _driver() -> Any:
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError as exc:
        raise CudaError(f"the CUDA driver (libcuda.so.1) is not loadable: {exc}") from None
    _check(lib, lib.cuInit(0), "cuInit")
    return lib


def _check(lib: Any, rc: int, what: str) -> None:
    if rc != 0:
        name = ctypes.c_char_p()
        lib.cuGetErrorName(rc, ctypes.byref(name))
        raise CudaError(f"{what} failed: {(name.value or b'CUDA error').decode()} ({rc})")


def device_uuids() -> list[str]:
    """The UUIDs of the GPUs this process sees, in ordinal order (after
    CUDA_VISIBLE_DEVICES).  Initialises the driver but creates no context.

    cupy's ``getDeviceProperties()['uuid']`` goes through a C string and loses
    everything after a zero byte, so the driver is asked directly;
    ``cuDeviceGetUuid_v2`` gives a MIG device its own UUID."""
    try:
        lib = _driver()
    except CudaError as exc:
        if "CUDA_ERROR_NO_DEVICE" in str(exc):  # CUDA_VISIBLE_DEVICES hides every GPU
            return []
        raise
    count = ctypes.c_int()
    _check(lib, lib.cuDeviceGetCount(ctypes.byref(count)), "cuDeviceGetCount")
    get_uuid = getattr(lib, "cuDeviceGetUuid_v2", None) or lib.cuDeviceGetUuid
    out = []
    for i in range(count.value):
        dev = ctypes.c_int()
        _check(lib, lib.cuDeviceGet(ctypes.byref(dev), i), "cuDeviceGet")
        u = _CUuuid()
        _check(lib, get_uuid(ctypes.byref(u), dev), "cuDeviceGetUuid")
        out.append(format_uuid(bytes(u.bytes)))
    return out


class _NvmlMemory(ctypes.Structure):
    _fields_ = [
        ("total", ctypes.c_ulonglong),
        ("free", ctypes.c_ulonglong),
        ("used", ctypes.c_ulonglong),
    ]


def nvml_used(uuid: str) -> int | None:
    """Device memory in use on GPU ``uuid`` by everyone, as NVML counts it; None
    when NVML is unavailable (no libnvidia-ml, a MIG device, a sandbox)."""
    try:
        lib = ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        return None
    if lib.nvmlInit_v2() != 0:
        return None
    try:
        handle = ctypes.c_void_p()
        if lib.nvmlDeviceGetHandleByUUID(uuid.encode(), ctypes.byref(handle)) != 0:
            return None
        mem = _NvmlMemory()
        if lib.nvmlDeviceGetMemoryInfo(handle, ctypes.byref(mem)) != 0:
            return None
        return int(mem.used)
    finally:
        lib.nvmlShutdown()
