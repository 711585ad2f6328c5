"""The Client's GPU paths: put, put_many and empty on a GPU, CUDA handles
from get, share(), and the bookkeeping of opened IPC handles.

The Client calls in from a few lines; everything CUDA is imported on first
use, so a process that never touches a GPU never imports cupy.

Writes.  ``put`` copies on this process's own stream of the GPU, after the
producer's pending writes (the source is borrowed with
``__dlpack__(stream=ours)``), records the version's write event there and
waits for that one event before publishing: a published version's bytes are
in the broker's memory even if the producer exits a moment later (a
process's queued GPU work may be discarded with its context).  A batch
records one event per GPU.

Shares.  ``share`` publishes a tensor's own memory by IPC handle.  The
Client keeps the tensor referenced until the broker no longer has the
version, and ``close()`` waits, up to the ``wait_on_close`` given to
``share``, for readers to release it: CUDA gives importers no guarantee
once the exporter frees the memory or exits.
"""

from __future__ import annotations

import functools
import logging
import time
import weakref
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .._errors import BrokerUnavailable, DepotError, InvalidRequest, TensorBroken
from .._wire import Handle, LiveReply, decode_ipc, encode_ipc
from ..shm._device import Device, DeviceError, parse_device
from ..shm._dlpack import (
    Borrowed,
    borrow_dlpack,
    import_dlpack,
    kDLCUDA,
    kDLCUDAManaged,
    parse_stream,
)
from ..shm._dtypes import dtype_from_numpy
from ._cuda_tensor import CudaSharedTensor, Streams, release_after_record
from ._tensor import SharedTensor, _Lease

if TYPE_CHECKING:
    from typing_extensions import Self

    from ._client import Client

log = logging.getLogger("tensordepot.client")
_CUDA_KINDS = (kDLCUDA, kDLCUDAManaged)
_PRUNE_AT_LEAST = 60.0  # s: a busy client still drops what the broker has freed this often


@dataclass
class _State:
    """What one Client keeps for its GPU work."""

    opened: set[str] = field(default_factory=set)  # blocks this client opened
    shared: dict[str, list[Any]] = field(default_factory=dict)  # allocation -> tensors kept alive
    wait_on_close: float = 0.0
    seen_requests: int = -1  # the Client's request count at the last background prune
    last_prune: float = field(default_factory=time.monotonic)


_states: weakref.WeakKeyDictionary[Any, _State] = weakref.WeakKeyDictionary()


def _state(client: Client) -> _State:
    st = _states.get(client)
    if st is None:
        st = _states[client] = _State()
    return st


def _cuda() -> Any:
    """The CUDA module, or InvalidRequest saying why this process has no CUDA."""
    from ..shm import _cuda

    reason = _cuda.unavailable()
    if reason is not None:
        raise InvalidRequest(f"this process cannot use a GPU: {reason}")
    return _cuda


def on_gpu(x: Any) -> bool:
    """Whether ``x`` is a DLPack producer on a GPU (asks it; imports nothing)."""
    dev = getattr(x, "__dlpack_device__", None)
    if dev is None:
        return False
    try:
        return int(dev()[0]) in _CUDA_KINDS
    except Exception:  # not a DLPack producer after all: a host value
        return False


def _device(device: object) -> Device:
    try:
        return parse_device(device)
    except DeviceError as exc:
        raise InvalidRequest(str(exc)) from None


def involves_gpu(x: Any, device: object = None) -> bool:
    """Whether a put of ``x`` to ``device`` needs this module."""
    return on_gpu(x) or (device is not None and _device(device).is_cuda)


def _resolve(device: Device) -> tuple[int, str]:
    """(this process's ordinal, UUID) of a CUDA device name."""
    cuda = _cuda()
    try:
        devices = cuda.local_devices()
        return devices.resolve(device, current=cuda.current_device())  # type: ignore[no-any-return]
    except (DeviceError, cuda.CudaError) as exc:
        raise InvalidRequest(str(exc)) from None


def wire_device(device: object) -> str:
    """A device as requests name it: ``cpu``, or ``cuda:GPU-<uuid>``."""
    d = _device(device)
    if not d.is_cuda:
        return "cpu"
    return f"cuda:{_resolve(d)[1]}"


def _source_ordinal(x: Any) -> int:
    return int(x.__dlpack_device__()[1])


def _exportable(x: Any) -> Any:
    from ._source import _exportable  # the Client's own rule for what torch will export

    return _exportable(x)


def _host(x: Any) -> tuple[Any, str, Any]:
    """(C-contiguous numpy array of the bytes, dtype name, what to close) of a host source."""
    import numpy as np

    closer = None
    if isinstance(x, np.ndarray):
        arr, dtype = x, dtype_from_numpy(x.dtype).name
    elif hasattr(x, "__dlpack__"):
        closer = import_dlpack(_exportable(x))
        arr, dtype = closer.array, closer.dtype.name
    else:
        arr = np.asarray(x)
        dtype = dtype_from_numpy(arr.dtype).name
    return np.ascontiguousarray(arr), dtype, closer


class _Inputs:
    """A put's inputs, read through DLPack for as long as the copies need them.

    GPU sources are borrowed with ``__dlpack__``: the first of each library
    on each GPU orders the producer's pending work before our stream, the
    rest ask for no synchronisation (the producer's current stream is the
    same), which saves an event per tensor in a state dict.  Leaving the
    ``with`` hands every input back, and turns device errors into
    InvalidRequest."""

    def __init__(self) -> None:
        self._lent: list[Any] = []
        self._ordered: set[tuple[str, int]] = set()

    def take(self, x: Any) -> tuple[Any, tuple[int, ...], str, bool]:
        """(what to copy from, shape, dtype, whether it is on a GPU) of one input."""
        if not on_gpu(x):
            arr, dtype, closer = _host(x)
            if closer is not None:
                self._lent.append(closer)
            return arr, arr.shape, dtype, False
        cuda = _cuda()
        ordinal = _source_ordinal(x)
        key = (type(x).__module__.split(".")[0], ordinal)
        stream = -1 if key in self._ordered else cuda.stream(ordinal).ptr
        with cuda.on_device(ordinal):  # torch exports only from its current device
            b = borrow_dlpack(_exportable(x), stream=stream)
        self._ordered.add(key)
        self._lent.append(b)
        return b, b.shape, b.dtype.name, True

    def __enter__(self) -> Self:
        return self

    def __exit__(self, kind: object, exc: BaseException | None, tb: object) -> None:
        for lent in self._lent:
            lent.close()
        self._lent.clear()
        from ..shm._cuda import CudaError

        if isinstance(exc, (DeviceError, CudaError)):
            raise InvalidRequest(str(exc)) from None


def _copy_to_device(cuda: Any, dst: int, b: Borrowed, ordinal: int) -> None:
    """Queue a copy of a borrowed device tensor into C order at ``dst`` (on
    GPU ``ordinal``) on the source GPU's own stream."""
    src = int(b.device[1])
    s = cuda.stream(src)
    if b.contiguous:
        cuda.memcpy(dst, b.address, b.nbytes, s.ptr, src)
    elif src == ordinal:
        cuda.copy_strided(dst, b.address, b.shape, b.strides, b.dtype.itemsize, src, s)
    else:  # across GPUs: compact it on its own GPU first
        cp = cuda._cupy()
        with cuda.on_device(src):
            tmp = cp.empty(b.nbytes, dtype=cp.uint8)
        cuda.copy_strided(tmp.data.ptr, b.address, b.shape, b.strides, b.dtype.itemsize, src, s)
        cuda.memcpy(dst, tmp.data.ptr, b.nbytes, s.ptr, src)
        s.synchronize()  # tmp dies here


def _copy_to_host(cuda: Any, dst: int, b: Borrowed) -> None:
    """Copy a borrowed device tensor into host memory at ``dst``, C order; waits."""
    src = int(b.device[1])
    s = cuda.stream(src)
    tmp = None
    if b.contiguous:
        cuda.memcpy(dst, b.address, b.nbytes, s.ptr, src)
    else:
        cp = cuda._cupy()
        with cuda.on_device(src):
            tmp = cp.empty(b.nbytes, dtype=cp.uint8)
        cuda.copy_strided(tmp.data.ptr, b.address, b.shape, b.strides, b.dtype.itemsize, src, s)
        cuda.memcpy(dst, tmp.data.ptr, b.nbytes, s.ptr, src)
    s.synchronize()
    del tmp


def _finish_writes(cuda: Any, handles: list[Handle], sources: set[int]) -> None:
    """Record each GPU's write event after the copies queued into it, then wait
    for those events (never the whole device)."""
    for src in sources:  # copies from another GPU ran on that GPU's stream
        cuda.stream(src).synchronize()
    events: dict[tuple[int, bytes], int] = {}
    for h in handles:
        if h.cuda is not None and h.cuda.event_handle is not None:
            ordinal = cuda.local_devices().ordinal(h.cuda.uuid)
            raw = decode_ipc(h.cuda.event_handle)
            events[(ordinal, raw)] = cuda.opened_event(raw, ordinal)
    for (ordinal, _), ev in events.items():
        cuda.record(ev, [cuda.stream(ordinal).ptr], ordinal)
    for (ordinal, _), ev in events.items():
        cuda.synchronize(ev, ordinal)


def _target(x: Any, device: object, cuda_source: bool) -> str:
    """The wire device a put writes to: ``device``, else the source's own."""
    if device is not None:
        return wire_device(device)
    if cuda_source:
        return f"cuda:{_cuda().local_devices().uuid(_source_ordinal(x))}"
    return "cpu"


def _fill(client: Client, h: Handle, src: Any, cuda: Any) -> None:
    """Queue (or do) the copy of one source into the block ``h`` names."""
    if h.nbytes == 0:
        return
    if h.kind == "cuda":
        assert h.cuda is not None
        ordinal = cuda.local_devices().ordinal(h.cuda.uuid)
        m = _open_block(client, h, ordinal)
        dst = m.address + h.offset
        if isinstance(src, Borrowed):
            _copy_to_device(cuda, dst, src, ordinal)
        else:
            cuda.memcpy(dst, src.ctypes.data, h.nbytes, cuda.stream(ordinal).ptr, ordinal)
    else:
        m = client._fill_map(h.segment)
        if isinstance(src, Borrowed):
            _copy_to_host(cuda, m.address + h.offset, src)
        else:  # host to host never comes here: the Client's own path does it
            raise AssertionError("host source to host memory")


# -- put / put_many ------------------------------------------------------------------


def put(client: Client, name: str, x: Any, *, device: object, ttl: float | None) -> int:
    """``Client.put`` where a GPU is the source or the target."""
    cuda = _cuda()
    cuda_source = on_gpu(x)
    target = _target(x, device, cuda_source)
    if (isinstance(x, SharedTensor) and x._lease_id() is not None and x._client() is client
            and target == _wire_of(x)):
        # Already in broker memory on that device: the new version shares the bytes.
        body = {"name": name, "lease": x._lease_id(), "ttl": ttl}
        return int(client._call("POST", "/v1/link", body, rid=client._rid())["version"])
    with _Inputs() as inputs:
        src, shape, dtype, _ = inputs.take(x)
        h = client._alloc(name, shape, dtype, ttl, target)
        try:
            _fill(client, h, src, cuda)
            _finish_writes(cuda, [h], _crossing(cuda, h, src))
        except BaseException:
            client._abort(h)
            raise
    client._publish(name, h.version)
    return h.version


def _crossing(cuda: Any, h: Handle, src: Any) -> set[int]:
    """The source GPU, when a copy into ``h`` came from another GPU's stream."""
    if h.cuda is None or not isinstance(src, Borrowed):
        return set()
    ordinal = int(src.device[1])
    return set() if ordinal == cuda.local_devices().ordinal(h.cuda.uuid) else {ordinal}


def _wire_of(t: SharedTensor) -> str:
    uuid = getattr(t, "device_uuid", None)
    return "cpu" if uuid is None else f"cuda:{uuid}"


def put_many(client: Client, tensors: Mapping[str, Any], *, device: object,
             ttl: float | None) -> dict[str, int]:
    """``Client.put_many`` where a GPU is involved: one round trip to allocate,
    the copies, one write event per GPU, one round trip to publish."""
    from ..shm._copy import copy_many
    from ..shm._posix import array_at

    cuda = _cuda()
    with _Inputs() as inputs:
        sources: dict[str, Any] = {}
        items = []
        for name, x in tensors.items():
            src, shape, dtype, cuda_source = inputs.take(x)
            sources[name] = src
            items.append({"name": name, "shape": list(shape), "dtype": dtype,
                          "device": _target(x, device, cuda_source), "ttl": ttl})
        handles = [Handle.model_validate(h) for h in
                   client._call("POST", "/v1/batch/alloc", {"items": items},
                                rid=client._rid())["items"]]
        try:
            host_pairs = []
            cross: set[int] = set()
            for h in handles:
                src = sources[h.name]
                if h.kind != "cuda" and not isinstance(src, Borrowed):
                    if h.nbytes:
                        m = client._fill_map(h.segment)
                        host_pairs.append((array_at(m.address + h.offset, tuple(h.shape), None,
                                                    src.dtype, writable=True, owner=m), src))
                    continue
                _fill(client, h, src, cuda)
                cross |= _crossing(cuda, h, src)
            copy_many(host_pairs)
            _finish_writes(cuda, handles, cross)
        except BaseException:
            for h in handles:
                client._abort(h)
            raise
    client._call("POST", "/v1/batch/publish",
                 {"items": [{"name": h.name, "version": h.version} for h in handles]},
                 rid=client._rid())
    return {h.name: h.version for h in handles}


# -- handles from get / empty ------------------------------------------------------------


def _open_block(client: Client, h: Handle, ordinal: int) -> Any:
    """This process's mapping of the block ``h`` is in (opened once per process)."""
    cuda = _cuda()
    assert h.cuda is not None
    raw = decode_ipc(h.cuda.ipc_handle)
    st = _state(client)
    try:
        m = cuda.open_mapping(h.segment, raw, ordinal=ordinal, size=h.cuda.block_size)
    except (RuntimeError, ValueError):  # cupy raises CUDARuntimeError
        # A handle we still hold open for a block the broker has replaced can
        # make the driver refuse a new one: drop what is gone, and try again.
        prune(client, foreground=True)
        try:
            m = cuda.open_mapping(h.segment, raw, ordinal=ordinal, size=h.cuda.block_size)
        except (RuntimeError, ValueError) as exc:
            if h.cuda.owner_pid is not None:
                raise TensorBroken(
                    f"cannot open the memory {h.name!r} was shared from (cudaIpcOpenMemHandle: "
                    f"{exc}); its producer may have exited"
                ) from exc
            raise BrokerUnavailable(
                f"cannot open CUDA block {h.segment} of {h.name!r} on GPU {h.cuda.uuid} "
                f"(cuda:{ordinal} here): cudaIpcOpenMemHandle failed: {exc}. CUDA IPC needs the "
                f"broker's pid and IPC namespaces (docker: pid: service:broker and ipc: "
                f"service:broker) and that GPU visible to both"
            ) from exc
    st.opened.add(h.segment)
    return m


def _alive(pid: int, start: int | None) -> bool:
    """Whether ``pid`` is the live process that started at ``start`` (/proc stat 22)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return False
    rest = data[data.rfind(b")") + 2:].split()  # comm may hold spaces and parentheses
    return len(rest) > 19 and rest[0] not in (b"Z", b"X") and rest[19] == str(start).encode()


def _producer_check(client: Client, h: Handle) -> Any:
    """For a shared tensor: a function that says whether its producer is gone.

    The producer's pid as the broker saw it is checked here first (no round
    trip); when this process cannot vouch for it (gone, reused, or another
    pid namespace), the broker decides."""
    assert h.cuda is not None
    pid, start, segment = h.cuda.owner_pid, h.cuda.owner_start, h.segment
    ref = weakref.ref(client)

    def gone() -> bool:
        if pid is not None and _alive(pid, start):
            return False
        c = ref()
        if c is None:
            return True
        try:
            reply = LiveReply.model_validate(c._call("POST", "/v1/cuda/live",
                                                     {"segments": [segment]}))
        except DepotError:
            return True  # the broker is gone too: so are its names
        return segment in reply.orphaned or segment not in reply.live

    return gone


def tensor(client: Client, h: Handle, *, writable: bool) -> CudaSharedTensor:
    """A SharedTensor for a CUDA handle from get, get_many or empty."""
    gone = None
    try:
        if h.cuda is None:
            raise BrokerUnavailable(f"the broker sent a CUDA handle for {h.name!r} without its "
                                    "CUDA fields")
        cuda = _cuda()
        ordinal = _resolve(Device("cuda", uuid=h.cuda.uuid))[0]
        if h.cuda.owner_pid is not None or h.segment.startswith("share-"):
            gone = _producer_check(client, h)
            if gone():
                raise TensorBroken(f"tensor {h.name!r} v{h.version} was shared by a producer that "
                                   f"has exited; CUDA keeps no promise about its memory now")
        m = _open_block(client, h, ordinal)
        wev = (cuda.opened_event(decode_ipc(h.cuda.event_handle), ordinal)
               if h.cuda.event_handle is not None else None)
        rev = (cuda.opened_event(decode_ipc(h.cuda.release_event_handle), ordinal)
               if h.cuda.release_event_handle is not None else None)
    except BaseException:
        # Give back what the broker handed out, then say why it cannot be used.
        if h.lease is not None and client._bg is not None:
            client._bg.release_later(client._sid, h.lease)
        elif writable:
            client._abort(h)
        raise
    streams = Streams(ordinal, wev, rev)
    lease = None
    if h.lease is not None and client._bg is not None:
        on_free = functools.partial(release_after_record, streams, client._bg.release_later,
                                    client._sid)
        lease = _Lease(h.lease, on_free)
        client._bg.track(client._sid, h.lease)
    return CudaSharedTensor(client, h, m, lease, writable=writable, ordinal=ordinal,
                            streams=streams, producer_gone=gone)


# -- share -------------------------------------------------------------------------------


def share(client: Client, name: str, x: Any, *, ttl: float | None, stream: Any,
          wait_on_close: float) -> int:
    """``Client.share``: publish ``x``'s own GPU memory, without a copy."""
    if not on_gpu(x):
        raise InvalidRequest(f"share({name!r}) publishes GPU memory without a copy; this tensor is "
                             f"not on a GPU: use put()")
    cuda = _cuda()
    with _Inputs() as inputs:
        b, _, _, _ = inputs.take(x)
        ordinal = int(b.device[1])
        uuid = cuda.local_devices().uuid(ordinal)
        if not b.contiguous:
            raise InvalidRequest(f"share({name!r}) needs a contiguous tensor (x.contiguous()), or "
                                 "put()")
        if b.nbytes == 0:
            raise InvalidRequest(f"share({name!r}) of an empty tensor: put() it instead")
        try:
            base, size, raw = cuda.export_handle(b.address, ordinal)
        except (RuntimeError, ValueError) as exc:
            raise InvalidRequest(
                f"share({name!r}): this memory cannot be exported with CUDA IPC ({exc}); memory "
                f"from cudaMallocAsync pools or torch's expandable_segments cannot: put() it"
            ) from None
        # The producer's writes to x were ordered before our stream when it
        # was borrowed; readers get it once they are done.
        if stream is not None:  # the writes may be queued on a stream of the caller's
            try:
                s = parse_stream(stream)
            except (TypeError, ValueError) as exc:
                raise InvalidRequest(str(exc)) from None
            if s is not None:
                cuda.synchronize_stream(s, ordinal)
        cuda.stream(ordinal).synchronize()
        body = {"name": name, "shape": list(b.shape), "dtype": b.dtype.name,
                "device": f"cuda:{uuid}",
                "ipc_handle": encode_ipc(raw), "offset": b.address - base, "alloc_size": size,
                "ttl": ttl}
        h = Handle.model_validate(client._call("POST", "/v1/cuda/share", body, rid=client._rid()))
    st = _state(client)
    st.shared.setdefault(h.segment, []).append(x)  # the memory must outlive every reader
    st.wait_on_close = max(st.wait_on_close, wait_on_close)
    return h.version


# -- housekeeping ----------------------------------------------------------------------------


def prune(client: Client, *, foreground: bool = False) -> None:
    """Close what the broker no longer has: opened blocks (once no view uses
    them) and the tensors kept alive for shares.  One round trip, only when
    this client has opened or shared something on a GPU."""
    st = _states.get(client)
    if st is None or not (st.opened or st.shared):
        return
    if not foreground:
        # In the background, ask only once the client has been idle since the
        # last tick (or a minute has passed): a burst of work (a state dict)
        # never has a request of ours in the middle of it.
        now, count = time.monotonic(), client.round_trips
        busy = count != st.seen_requests
        st.seen_requests = count
        if busy and now - st.last_prune < _PRUNE_AT_LEAST:
            return
        st.last_prune = now
    from ..shm import _cuda

    names = sorted(st.opened | set(st.shared))
    try:
        reply = LiveReply.model_validate(
            client._call("POST", "/v1/cuda/live", {"segments": names}, background=not foreground))
    except DepotError as exc:
        log.debug("cannot ask the broker which CUDA blocks live: %s", exc)
        return
    if not foreground:
        st.seen_requests = client.round_trips  # our own request is no sign of work
    gone = set(names) - set(reply.live)
    _cuda.forget(gone & st.opened)
    st.opened -= gone
    for seg in gone & set(st.shared):
        del st.shared[seg]


def before_close(client: Client) -> None:
    """Wait, up to the longest ``wait_on_close`` of this client's shares, for
    readers to release them; then let go of everything this client opened."""
    st = _states.get(client)
    if st is None:
        return
    deadline = time.monotonic() + st.wait_on_close
    while st.shared:
        try:
            reply = LiveReply.model_validate(
                client._call("POST", "/v1/cuda/live", {"segments": sorted(st.shared)}))
        except DepotError:
            break
        if not reply.busy:
            break
        if time.monotonic() >= deadline:
            log.warning("closing with %d shared allocation(s) still read by other processes; they "
                        "will be told TensorBroken", len(reply.busy))
            break
        time.sleep(0.02)
    st.shared.clear()
    if st.opened:
        from ..shm import _cuda

        _cuda.forget(st.opened)
        st.opened.clear()

