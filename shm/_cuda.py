"""CUDA memory: broker-owned device blocks, interprocess events, and each
process's opened IPC handles.

Everything CUDA is imported here, lazily, on first use: ``import
tensordepot`` and every CPU path work without cupy and without a GPU.  The
runtime calls go through cupy (``pip install tensordepot[cuda12]`` or
``[cuda13]``); a few driver calls cupy does not wrap (device UUIDs, an
allocation's base address) go through ``libcuda.so.1`` with ctypes, and the
broker's context size through ``libnvidia-ml.so.1`` (both in ``_cuda_driver.py``).

CUDA invariants this module relies on:

* Legacy CUDA IPC shares whole ``cudaMalloc`` allocations: the exporter
  calls ``cudaIpcGetMemHandle`` on an allocation, the importer
  ``cudaIpcOpenMemHandle`` and gets the allocation's base address.  Memory
  from a pool allocator's sub-allocation (``cudaMallocAsync``) or from the
  virtual memory API cannot be exported this way, which is why the broker
  allocates its blocks with plain ``cudaMalloc``.
* Opening a memory handle the process has open already does not map it
  again: ``cudaIpcOpenMemHandle`` returns the same pointer and counts one
  more opening, and each opening needs its own ``cudaIpcCloseMemHandle``.
  So each process keeps one ``CudaMapping`` per block (``open_mapping``),
  shared by every tensor and every Client in the process, and closes it once.
* The importer's mapping stays valid only while the exporter's allocation
  lives; CUDA promises nothing to importers once the exporter frees it or
  dies.  The broker is therefore the exporter for ``put`` and ``empty``, and
  frees a block only when no lease, no queued kernel and no client process's
  mapping can still reach it.
* ``cudaIpcCloseMemHandle`` unmaps the importer's view; it must not run while
  a view (or a kernel) still uses it, so a mapping closes only when the
  broker has reported its block gone, the last view is gone, and the release
  events of its tensors have completed (``close_finished``).
* Interprocess events (``cudaEventInterprocess | cudaEventDisableTiming``)
  may be recorded, waited on and queried from any process that opened their
  handle; a wait captures the event's most recent record at the time of the
  call, so an event can be re-recorded once nobody will wait on the old
  record.  The broker owns every event it hands out.

Why one long module: it is the one place that imports cupy
and talks to CUDA, for the broker and the client alike, and both halves
share its device switching, its lazy imports and its one lock; split, the
client's mappings and the broker's blocks would each import the other's
private state.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import functools
import importlib
import logging
import os
import threading
import weakref
from collections.abc import Iterator
from typing import Any

from ._cuda_driver import CudaError as CudaError
from ._cuda_driver import _check, _driver
from ._cuda_driver import device_uuids as device_uuids
from ._cuda_driver import nvml_used as nvml_used
from ._device import ENV_VISIBLE, DeviceMap

log = logging.getLogger("tensordepot.cuda")

KIND = "cuda"
IPC_HANDLE_BYTES = 64  # sizeof(cudaIpcMemHandle_t) == sizeof(cudaIpcEventHandle_t)
_ERROR_MEMORY_ALLOCATION = 2  # cudaErrorMemoryAllocation
_ERROR_NOT_READY = 600  # cudaErrorNotReady
_MEMCPY_DEFAULT = 4  # cudaMemcpyDefault: direction from the pointers (unified addressing)
_EVENT_IPC = 0x2 | 0x4  # cudaEventDisableTiming | cudaEventInterprocess
_EVENT_LOCAL = 0x2  # cudaEventDisableTiming
INSTALL_HINT = "pip install 'tensordepot[cuda12]' (or [cuda13], matching the CUDA driver)"


# -- lazy imports --------------------------------------------------------------


@functools.lru_cache(maxsize=1)
def _cupy() -> Any:
    try:
        return importlib.import_module("cupy")
    except ImportError as exc:
        raise CudaError(f"cupy is not installed ({exc}); {INSTALL_HINT}") from None


def _rt() -> Any:
    return _cupy().cuda.runtime


def unavailable() -> str | None:
    """Why this process cannot use CUDA, or None when it can."""
    try:
        cp = _cupy()
    except CudaError as exc:
        return str(exc)
    try:
        if not cp.is_available():
            return "cupy finds no usable CUDA GPU (no driver, or no device visible)"
    except Exception as exc:  # cupy reports driver trouble as various errors
        return f"cupy cannot reach a GPU: {exc}"
    return None


@contextlib.contextmanager
def on_device(ordinal: int) -> Iterator[None]:
    """Make ``ordinal`` this thread's current device (its primary context)
    for the runtime calls inside, and then give the thread back exactly the
    context it had: none, if it had none.

    Not ``cupy.cuda.Device``: its exit makes current the device the runtime
    reported on entry, which is device 0 for a thread that never chose one,
    and since CUDA 12 making a device current creates its context.  The
    broker, its pollers, a client's background thread and a user's threads
    would each put a context on GPU 0 (hundreds of MiB there, per process).
    Here a thread already on ``ordinal`` switches nothing, and the context
    put back is one the thread had already (``cuCtxSetCurrent``, which
    creates nothing)."""
    cuda = _cupy().cuda
    before = int(cuda.driver.ctxGetCurrent())  # 0: the thread has no context
    if before and int(cuda.runtime.getDevice()) == ordinal:
        yield
        return
    cuda.runtime.setDevice(ordinal)
    try:
        yield
    finally:
        cuda.driver.ctxSetCurrent(before)


def _status(exc: BaseException) -> int | None:
    return getattr(exc, "status", None)


@functools.lru_cache(maxsize=1)
def local_devices() -> DeviceMap:
    """This process's DeviceMap (its CUDA_VISIBLE_DEVICES cannot change once
    the driver has read it, so it is computed once)."""
    return DeviceMap(device_uuids(), os.environ.get(ENV_VISIBLE))


def current_device() -> int:
    return int(_rt().getDevice())


def allocation_range(address: int, ordinal: int) -> tuple[int, int]:
    """(base, size) of the ``cudaMalloc`` allocation that holds ``address``."""
    lib = _driver()
    base, size = ctypes.c_uint64(), ctypes.c_size_t()
    fn = getattr(lib, "cuMemGetAddressRange_v2", None) or lib.cuMemGetAddressRange
    fn.argtypes = [
        ctypes.POINTER(ctypes.c_uint64),
        ctypes.POINTER(ctypes.c_size_t),
        ctypes.c_uint64,
    ]
    with on_device(ordinal):  # the driver call needs the pointer's context current
        _check(lib, fn(ctypes.byref(base), ctypes.byref(size), address), "cuMemGetAddressRange")
    return int(base.value), int(size.value)


# -- the broker's side: blocks and events ----------------------------------------


def open_context(ordinal: int, uuid: str) -> tuple[int, int | None]:
    """Create this process's context on ``ordinal``; return (the device's total
    memory, the bytes the context took as NVML saw it, or None)."""
    before = nvml_used(uuid)
    with on_device(ordinal):
        _rt().free(0)  # cudaFree(NULL): the usual way to create the primary context
        _free, total = _rt().memGetInfo()
    after = nvml_used(uuid)
    ctx = after - before if before is not None and after is not None and after >= before else None
    return int(total), ctx


class CudaBlock:
    """A block of device memory the broker owns: one ``cudaMalloc`` and its IPC
    handle.  ``unlink()`` frees it, once, and only the broker calls it.

    Implements the Segment protocol, so the pool logic is the CPU's.  The
    pool passes ``mode``/``gid``/``prefault``, which mean nothing here: device
    memory is backed when allocated and reachable only through the handle."""

    kind = KIND
    name: str = ""
    size: int = 0
    address: int = 0
    ipc_handle: bytes = b""
    ordinal: int = -1
    _freed = True

    def __init__(self, name: str, size: int, *, ordinal: int, **_posix_options: Any) -> None:
        rt = _rt()
        self.name, self.size, self.ordinal = name, size, ordinal
        with on_device(ordinal):
            try:
                self.address = int(rt.malloc(max(size, 1)))
            except rt.CUDARuntimeError as exc:
                if _status(exc) == _ERROR_MEMORY_ALLOCATION:
                    raise OSError(
                        12, f"cudaMalloc of {size} bytes on cuda:{ordinal}: {exc}"
                    ) from None
                raise
            self._freed = False
            try:
                self.ipc_handle = bytes(rt.ipcGetMemHandle(self.address))
            except BaseException:
                self.unlink()
                raise

    def unlink(self) -> None:
        """cudaFree the block.  Idempotent; the broker calls it only when no
        lease and no queued kernel can reach the block."""
        if self._freed:
            return
        self._freed = True
        with on_device(self.ordinal):
            _rt().free(self.address)

    def __repr__(self) -> str:
        return f"CudaBlock({self.name!r}, size={self.size}, cuda:{self.ordinal})"


def query_event(event: int, ordinal: int) -> bool | None:
    """True once the work before ``event``'s latest record is done (or it was
    never recorded), False while pending, None if CUDA reports an error."""
    with on_device(ordinal):
        status = int(_rt().eventQuery(event))
    if status == 0:
        return True
    if status == _ERROR_NOT_READY:
        return False
    log.warning("cudaEventQuery on cuda:%d returned error %d", ordinal, status)
    return None


class IpcEvent:
    """An interprocess event the broker owns; clients open it by ``handle``."""

    ptr: int = 0
    _destroyed = True

    def __init__(self, ordinal: int) -> None:
        rt = _rt()
        self.ordinal = ordinal
        with on_device(ordinal):
            self.ptr = int(rt.eventCreateWithFlags(_EVENT_IPC))
            self._destroyed = False
            try:
                self.handle = bytes(rt.ipcGetEventHandle(self.ptr))
            except BaseException:
                self.destroy()
                raise

    def query(self) -> bool | None:
        return query_event(self.ptr, self.ordinal)

    def destroy(self) -> None:
        if self._destroyed:
            return
        self._destroyed = True
        with on_device(self.ordinal):
            _rt().eventDestroy(self.ptr)


class Gpu:
    """What the broker needs from CUDA for one device (see ``service/_registry/_cuda.py``).

    Tests of the broker's bookkeeping substitute an object with the same
    methods; this one talks to the GPU."""

    def __init__(self, ordinal: int, uuid: str) -> None:
        self.ordinal, self.uuid = ordinal, uuid
        self.total_memory, self.context_bytes = open_context(ordinal, uuid)

    def block(self, name: str, size: int, **posix_options: Any) -> CudaBlock:
        return CudaBlock(name, size, ordinal=self.ordinal, **posix_options)

    def event(self) -> IpcEvent:
        return IpcEvent(self.ordinal)


class Gpus:
    """The broker's way into CUDA: which GPUs it sees, and opening one."""

    def unavailable(self) -> str | None:
        return unavailable()

    def devices(self) -> DeviceMap:
        return local_devices()

    def open(self, ordinal: int, uuid: str) -> Gpu:
        return Gpu(ordinal, uuid)


# -- a client's side: opened handles, streams, copies -----------------------------


class Uses:
    """What must be done before a mapping may close: the leases of its
    tensors whose release event is not recorded yet, and the release events
    recorded (each completes once the kernels queued before it are done).
    Sets and lists: finalizers and threads add and remove without a lock."""

    __slots__ = ("events", "unrecorded")

    def __init__(self) -> None:
        self.unrecorded: set[int] = set()  # lease ids
        self.events: list[int] = []


# Mappings no view uses any more, each closed once its kernels are done
# (``close_finished``): (name, ordinal, address, uses).  Only finalizers append.
_closing: collections.deque[tuple[str, int, int, Uses]] = collections.deque()


def _close_mapping(ordinal: int, address: int) -> None:
    try:
        with on_device(ordinal):
            _rt().ipcCloseMemHandle(address)
    except Exception as exc:  # report, never raise: the driver unmaps it at exit anyway
        log.warning("cudaIpcCloseMemHandle(0x%x) on cuda:%d failed: %s", address, ordinal, exc)


def _completed(event: int, ordinal: int) -> bool:
    try:
        return query_event(event, ordinal) is not False
    except Exception:  # an event CUDA cannot query can never complete: do not wait on it
        return True


def close_finished() -> None:
    """Close each mapping no view uses any more, once every lease of its
    tensors has recorded its release event and those events completed: a
    kernel still queued on a reader's stream keeps its memory mapped, even
    after the reader's ``del`` and ``Client.close()``.  The client's
    background threads call it (and ``open_mapping``): it calls CUDA, so
    never from a finalizer."""
    for _ in range(len(_closing)):
        try:
            item = _closing.popleft()
        except IndexError:
            return
        _name, ordinal, address, uses = item
        if uses.unrecorded or not all(_completed(e, ordinal) for e in uses.events):
            _closing.append(item)  # not yet: looked at again on the next call
            continue
        _close_mapping(ordinal, address)


class CudaMapping:
    """This process's opened IPC handle of one block (or one shared allocation).

    Views keep it alive; ``open_mapping``'s cache keeps it too, until the
    broker reports the block gone (``forget``).  When both let go, its
    finalizer queues it, and ``close_finished`` calls
    ``cudaIpcCloseMemHandle`` once the kernels that read it are done
    (``uses``).  CUDA IPC has no read-only mappings: ``writable`` only
    records what the tensor was handed out as."""

    kind = KIND
    address: int = 0
    size: int = 0

    def __init__(self, name: str, handle: bytes, *, ordinal: int, size: int) -> None:
        if len(handle) != IPC_HANDLE_BYTES:
            raise ValueError(
                f"a CUDA IPC memory handle is {IPC_HANDLE_BYTES} bytes, not {len(handle)}"
            )
        rt = _rt()
        self.name, self.size, self.ordinal, self.writable = name, size, ordinal, True
        with on_device(ordinal):
            # Map on the device that holds the memory; the lazy flag only
            # matters for peer access, which we never need.
            self.address = int(rt.ipcOpenMemHandle(handle, rt.cudaIpcMemLazyEnablePeerAccess))
        self.uses = Uses()
        fin = weakref.finalize(self, _closing.append, (name, ordinal, self.address, self.uses))
        fin.atexit = False  # at exit the driver unmaps everything; cupy may be half gone

    def __repr__(self) -> str:
        return (
            f"CudaMapping({self.name!r}, cuda:{self.ordinal}, size={self.size}, "
            f"at=0x{self.address:x})"
        )


_lock = threading.Lock()
_mappings: dict[str, CudaMapping] = {}  # held open until the broker reports the block gone
# Every mapping still open, held or not: a block the cache let go of may still
# have views, and a get of it meanwhile shares their mapping (one opening, one
# close) rather than opening the handle a second time.
_open: weakref.WeakValueDictionary[str, CudaMapping] = weakref.WeakValueDictionary()
_events: dict[tuple[int, bytes], int] = {}
# IPC handle -> base address, of the allocations this process exported
# (share): a handle is stable for its allocation, and one entry stays per
# allocation ever shared (a new allocation has a new handle).
_exported: dict[bytes, int] = {}
_streams: dict[int, Any] = {}


class OwnMemory:
    """Memory this process shared (``export_handle``), got back by a get in
    the same process: CUDA refuses to open an IPC handle in the process that
    exported it, and needs not, since the pointer is ours.  Nothing to close;
    the sharing client keeps the memory alive while the share lives."""

    kind = KIND

    def __init__(self, name: str, address: int, *, ordinal: int, size: int) -> None:
        self.name, self.address, self.ordinal, self.size = name, address, ordinal, size
        self.writable = True

    def __repr__(self) -> str:
        return f"OwnMemory({self.name!r}, cuda:{self.ordinal}, size={self.size})"


def open_mapping(name: str, handle: bytes, *, ordinal: int, size: int) -> CudaMapping | OwnMemory:
    """The process's one mapping of block ``name`` (opened on first use), or
    its own memory when this process shared it."""
    m = _mappings.get(name)
    if m is None:
        close_finished()
        with _lock:
            own = _exported.get(handle)
            if own is not None:
                return OwnMemory(name, own, ordinal=ordinal, size=size)
            m = _mappings.get(name) or _open.get(name)
            if m is None:
                m = _open[name] = CudaMapping(name, handle, ordinal=ordinal, size=size)
            _mappings[name] = m
    return m


def open_names() -> set[str]:
    """Every block this process still maps: a view or the cache holds it, or
    it waits to close.  The broker frees a block it let go of only once no
    process that was handed it says so (``/v1/cuda/live``)."""
    return set(_open.keys()) | {item[0] for item in list(_closing)}


def forget(names: list[str] | set[str]) -> None:
    """Drop the cache's hold on blocks the broker no longer has: each closes as
    soon as no view uses it."""
    with _lock:
        for name in names:
            _mappings.pop(name, None)


def export_handle(address: int, ordinal: int) -> tuple[int, int, bytes]:
    """(base, size, IPC handle) of the allocation holding device ``address``,
    for sharing memory this process owns."""
    base, size = allocation_range(address, ordinal)
    with on_device(ordinal):
        raw = bytes(_rt().ipcGetMemHandle(base))
    with _lock:
        _exported[raw] = base
    return base, size, raw


def opened_event(handle: bytes, ordinal: int) -> int:
    """This process's opening of a broker event (once per event per process)."""
    key = (ordinal, handle)
    ev = _events.get(key)
    if ev is None:
        with _lock:
            ev = _events.get(key)
            if ev is None:
                with on_device(ordinal):
                    ev = _events[key] = int(_rt().ipcOpenEventHandle(handle))
    return ev


def stream(ordinal: int) -> Any:
    """This process's own non-blocking stream on ``ordinal`` (a cupy Stream),
    for copies and for joining consumer streams."""
    s = _streams.get(ordinal)
    if s is None:
        with _lock:
            s = _streams.get(ordinal)
            if s is None:
                with on_device(ordinal):
                    s = _streams[ordinal] = _cupy().cuda.Stream(non_blocking=True)
    return s


def record(event: int, streams: list[int], ordinal: int) -> None:
    """Record ``event`` after all work queued so far on every stream in ``streams``.

    One stream: record there.  Several: each gets a private event that our
    own stream waits on, and the event is recorded on our stream, so no
    consumer stream gains a dependency it did not ask for.  No host wait."""
    rt = _rt()
    with on_device(ordinal):
        if len(streams) == 1:
            rt.eventRecord(event, streams[0])
            return
        own = stream(ordinal).ptr
        for s in streams:
            tmp = rt.eventCreateWithFlags(_EVENT_LOCAL)
            try:
                rt.eventRecord(tmp, s)
                rt.streamWaitEvent(own, tmp, 0)
            finally:
                rt.eventDestroy(tmp)  # freed once its record completes
        rt.eventRecord(event, own)


def wait(stream_ptr: int, event: int, ordinal: int) -> None:
    """Make ``stream_ptr`` wait, on the GPU, for ``event``'s latest record."""
    with on_device(ordinal):
        _rt().streamWaitEvent(stream_ptr, event, 0)


def synchronize(event: int, ordinal: int) -> None:
    """Block this thread until ``event``'s latest record is reached (one event,
    never the whole device)."""
    with on_device(ordinal):
        _rt().eventSynchronize(event)


def synchronize_stream(stream_ptr: int, ordinal: int) -> None:
    """Block this thread until the work queued on one stream is done."""
    with on_device(ordinal):
        _rt().streamSynchronize(stream_ptr)


def memcpy(dst: int, src: int, nbytes: int, stream_ptr: int, ordinal: int) -> None:
    """Queue a copy of ``nbytes`` on ``stream_ptr`` (device or host on either side)."""
    if nbytes:
        with on_device(ordinal):
            _rt().memcpyAsync(dst, src, nbytes, _MEMCPY_DEFAULT, stream_ptr)


def copy_strided(
    dst: int,
    src: int,
    shape: tuple[int, ...],
    strides: tuple[int, ...],
    itemsize: int,
    ordinal: int,
    stream_obj: Any,
) -> None:
    """Queue a copy of a strided device tensor (element ``strides``) into C order
    at ``dst``, as raw items of ``itemsize`` bytes, on ``stream_obj``."""
    cp = _cupy()
    raw = {1: cp.uint8, 2: cp.uint16, 4: cp.uint32, 8: cp.uint64, 16: cp.uint64}[itemsize]
    byte_strides = tuple(s * itemsize for s in strides)
    if itemsize == 16:  # complex128: two uint64 words per item
        shape, byte_strides = (*shape, 2), (*byte_strides, 8)
    lo = sum((d - 1) * s for d, s in zip(shape, byte_strides, strict=True) if s < 0 and d > 0)
    hi = sum((d - 1) * s for d, s in zip(shape, byte_strides, strict=True) if s > 0 and d > 0)
    word = 8 if itemsize == 16 else itemsize
    nbytes = word
    for d in shape:
        nbytes *= d
    if nbytes == 0:
        return
    with on_device(ordinal), stream_obj:
        smem = cp.cuda.UnownedMemory(src + lo, hi - lo + word, None, ordinal)
        s_arr = cp.ndarray(shape, raw, cp.cuda.MemoryPointer(smem, -lo), strides=byte_strides)
        dmem = cp.cuda.UnownedMemory(dst, nbytes, None, ordinal)
        d_arr = cp.ndarray(shape, raw, cp.cuda.MemoryPointer(dmem, 0))
        cp.copyto(d_arr, s_arr)
