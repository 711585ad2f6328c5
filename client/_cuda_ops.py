"""The client's GPU writes: put, put_many and share where a GPU is the
source or the target, each an operation of steps (``_http.py``) that both
drivers run whole in one thread (an asyncio caller's worker thread), since
every step of it waits on a GPU or a copy.

Writes.  ``put`` copies on this process's own stream of the GPU, after the
producer's pending writes (the source is borrowed with
``__dlpack__(stream=ours)``), records the version's write event there and
waits for that one event before publishing: a published version's bytes are
in the broker's memory even if the producer exits a moment later (a
process's queued GPU work may be discarded with its context).  A batch
records one event per GPU.

Shares.  ``share`` publishes a tensor's own memory by IPC handle.  The
client keeps the tensor referenced until the broker no longer has the
version, and ``close()`` waits, up to the ``wait_on_close`` given to
``share``, for readers to release it: CUDA gives importers no guarantee
once the exporter frees the memory or exits.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from .._errors import InvalidRequest
from .._wire import (
    AllocRequest,
    Handle,
    HandleColumns,
    LinkRequest,
    ManyAlloc,
    ManyPublish,
    ShareRequest,
    c_strides,
    decode_ipc,
    encode_ipc,
)
from ..shm._device import DeviceError
from ..shm._dlpack import Borrowed, borrow_dlpack, parse_stream
from ._core import Core
from ._cuda_handles import _cuda, on_gpu, open_block, state, wire_device
from ._extent import broken, check_columns
from ._http import Op
from ._tensor import SharedTensor

if TYPE_CHECKING:
    from typing_extensions import Self


def _source_ordinal(x: Any) -> int:
    return int(x.__dlpack_device__()[1])


def _exportable(x: Any, what: str) -> Any:
    from ._source import _exportable  # the Client's own rule for what torch will export

    return _exportable(x, what)


def _host(x: Any, what: str) -> tuple[Any, str, Any]:
    """(C-contiguous numpy array of the bytes, dtype name, what to close) of a
    host source: the Client's own intake (``_source.Source``), so a host
    source is judged the same whichever device it goes to."""
    import numpy as np

    from ._source import Source

    src = Source(x, what)
    return np.ascontiguousarray(src.array), src.dtype, src


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

    def take(self, x: Any, what: str = "x") -> tuple[Any, tuple[int, ...], str, bool]:
        """(what to copy from, shape, dtype, whether it is on a GPU) of one
        input, which errors call ``what``."""
        if not on_gpu(x):
            arr, dtype, closer = _host(x, what)
            if closer is not None:
                self._lent.append(closer)
            return arr, arr.shape, dtype, False
        cuda = _cuda()
        ordinal = _source_ordinal(x)
        key = (type(x).__module__.split(".")[0], ordinal)
        stream = -1 if key in self._ordered else cuda.stream(ordinal).ptr
        with cuda.on_device(ordinal):  # torch exports only from its current device
            b = borrow_dlpack(_exportable(x, what), stream=stream)
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


def _fill(client: Core, h: Handle, src: Any, cuda: Any) -> None:
    """Queue (or do) the copy of one source into the block ``h`` names."""
    if h.nbytes == 0:
        return
    if h.kind == "cuda":
        assert h.cuda is not None
        ordinal = cuda.local_devices().ordinal(h.cuda.uuid)
        m = open_block(client, h, ordinal)
        dst = m.address + h.offset
        if isinstance(src, Borrowed):
            _copy_to_device(cuda, dst, src, ordinal)
        else:
            cuda.memcpy(dst, src.ctypes.data, h.nbytes, cuda.stream(ordinal).ptr, ordinal)
    else:
        m = client.segments.fill_map(h.segment)
        if isinstance(src, Borrowed):
            _copy_to_host(cuda, m.address + h.offset, src)
        else:  # host to host never comes here: the Client's own path does it
            raise AssertionError("host source to host memory")


# -- put / put_many ------------------------------------------------------------------


def put(client: Core, name: str, x: Any, *, device: object, ttl: float | None) -> Op[int]:
    """``put`` where a GPU is the source or the target."""
    cuda = _cuda()
    cuda_source = on_gpu(x)
    target = _target(x, device, cuda_source)
    lease = x._lease_id() if isinstance(x, SharedTensor) else None
    if lease is not None and x._client() is client and target == _wire_of(x):
        # Already in broker memory on that device: the new version shares the bytes.
        link = LinkRequest.model_construct(name=name, lease=lease, ttl=ttl, source=x.name)
        return int((yield from client.call("POST", "/v1/link", link, rid=client.rid()))["version"])
    with _Inputs() as inputs:
        src, shape, dtype, _ = inputs.take(x)
        body = AllocRequest.model_construct(
            name=name, shape=list(shape), dtype=dtype, device=target, ttl=ttl, hold=False
        )
        h = yield from client.alloc(body, Handle)
        try:
            _fill(client, h, src, cuda)
            _finish_writes(cuda, [h], _crossing(cuda, h, src))
        except BaseException:
            yield from client.abort(h.name, h.version)
            raise
    yield from client.publish(name, h.version)
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


def put_many(
    client: Core, tensors: Mapping[str, Any], *, device: object, ttl: float | None
) -> Op[dict[str, int]]:
    """``put_many`` where a GPU is involved: one round trip to allocate,
    the copies, one write event per GPU, one round trip to publish."""
    from ..shm._copy import copy_many
    from ..shm._posix import array_at

    cuda = _cuda()
    with _Inputs() as inputs:
        sources: dict[str, Any] = {}
        shapes: list[list[int]] = []
        dtypes: list[str] = []
        devices: list[str] = []
        for name, x in tensors.items():
            src, shape, dtype, cuda_source = inputs.take(x, f"tensors[{name!r}]")
            sources[name] = src
            shapes.append(list(shape))
            dtypes.append(dtype)
            devices.append(_target(x, device, cuda_source))
        body = ManyAlloc.model_construct(
            names=list(sources), shapes=shapes, dtypes=dtypes, ttl=ttl, same=None, devices=devices
        )
        cols = yield from client.alloc(body, HandleColumns, "/v1/many/alloc")
        try:
            handles = _handles_of(cols, body.names)
        except BaseException:
            for name, version in zip(cols.names, cols.versions, strict=False):
                yield from client.abort(name, version)
            raise
        try:
            host_pairs = []
            cross: set[int] = set()
            for h in handles:
                src = sources[h.name]
                if h.kind != "cuda" and not isinstance(src, Borrowed):
                    if h.nbytes:
                        m = client.segments.fill_map(h.segment)
                        host_pairs.append(
                            (
                                array_at(
                                    m.address + h.offset,
                                    tuple(h.shape),
                                    None,
                                    src.dtype,
                                    writable=True,
                                    owner=m,
                                ),
                                src,
                            )
                        )
                    continue
                _fill(client, h, src, cuda)
                cross |= _crossing(cuda, h, src)
            copy_many(host_pairs)
            _finish_writes(cuda, handles, cross)
        except BaseException:
            yield from client.give_back(handles)
            raise
    done = ManyPublish.model_construct(
        names=[h.name for h in handles], versions=[h.version for h in handles]
    )
    try:
        yield from client.call(
            "POST", "/v1/many/publish", done, rid=client.rid(), raw=True, keep=True
        )
    except BaseException:
        # If the broker published them, or gave them back itself, it finds nothing to abort.
        yield from client.give_back(handles)
        raise
    return {h.name: h.version for h in handles}


def _handles_of(cols: HandleColumns, names: list[str]) -> list[Handle]:
    """A batch's allocations, one handle per name in order: a shared-memory
    one from the columns, a GPU one as the broker gave it (``others``)."""
    check_columns(cols)
    if cols.names != names or cols.state != "writing":
        raise broken(f"a batch of {len(names)} tensor(s)", "it is not the batch asked for")
    handles = []
    for i, name in enumerate(names):
        h = cols.others.get(i)
        if h is None:
            seg, base, _, _ = cols.packs[cols.pack[i]]
            shape, dtype, nbytes = cols.layouts[cols.layout[i]]
            h = Handle.model_validate(
                {
                    "name": name,
                    "version": cols.versions[i],
                    "kind": "posix",
                    "segment": cols.segments[seg],
                    "offset": base + cols.at[i],
                    "nbytes": nbytes,
                    "shape": shape,
                    "strides": list(c_strides(tuple(shape))),
                    "dtype": dtype,
                    "device": "cpu",
                    "state": "writing",
                    "lease": None,
                    "cuda": None,
                }
            )
        elif h.name != name or h.version != cols.versions[i]:
            raise broken(f"a batch of {len(names)} tensor(s)", f"its handle {i} is not {name!r}'s")
        handles.append(h)
    return handles


# -- share -------------------------------------------------------------------------------


def share(
    client: Core, name: str, x: Any, *, ttl: float | None, stream: Any, wait_on_close: float
) -> Op[int]:
    """``share``: publish ``x``'s own GPU memory, without a copy."""
    if not on_gpu(x):
        raise InvalidRequest(
            f"share({name!r}) publishes GPU memory without a copy; this tensor is "
            f"not on a GPU: use put()"
        )
    lazy = [bit for bit in ("conj", "neg") if getattr(x, f"is_{bit}", lambda: False)()]
    if lazy:  # torch would export a resolved copy, freed when this returns
        raise InvalidRequest(
            f"share({name!r}): this tensor carries a lazy {' and '.join(lazy)} bit, so its memory "
            f"does not hold its values: share x.resolve_conj().resolve_neg() (and keep it), or "
            f"put() it"
        )
    cuda = _cuda()
    with _Inputs() as inputs:
        b, _, _, _ = inputs.take(x)
        ordinal = int(b.device[1])
        uuid = cuda.local_devices().uuid(ordinal)
        if not b.contiguous:
            raise InvalidRequest(
                f"share({name!r}) needs a contiguous tensor (x.contiguous()), or put()"
            )
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
        body = ShareRequest.model_construct(
            name=name,
            shape=list(b.shape),
            dtype=b.dtype.name,
            device=f"cuda:{uuid}",
            ipc_handle=encode_ipc(raw),
            offset=b.address - base,
            alloc_size=size,
            ttl=ttl,
        )
        h = Handle.model_validate(
            (yield from client.call("POST", "/v1/cuda/share", body, rid=client.rid()))
        )
    st = state(client)
    st.shared.setdefault(h.segment, []).append(x)  # the memory must outlive every reader
    st.wait_on_close = max(st.wait_on_close, wait_on_close)
    return h.version
