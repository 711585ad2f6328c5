"""The client's CUDA state and reads: which devices a process has, the IPC
blocks it opened (once per process, as CUDA allows), CUDA tensors from get,
get_many and empty, and the housekeeping of both opened blocks and
``share()``d tensors.  The writes (put, put_many, share) are in
``_cuda_ops.py``.

Everything CUDA is imported on first use, so a process that never touches a
GPU never imports cupy.  A client's state is made on first use too, and
hooked into its core (``Core.gpu``): the background thread prunes it, and
``close()`` waits for readers of its shares (``before_close``).
"""

from __future__ import annotations

import functools
import logging
import sys
import time
import weakref
from dataclasses import dataclass, field
from typing import Any

from .._errors import BrokerUnavailable, DepotError, InvalidRequest, TensorBroken
from .._wire import Handle, LiveReply, LiveRequest, decode_ipc
from ..shm._device import Device, DeviceError, parse_device
from ..shm._dlpack import kDLCUDA, kDLCUDAManaged
from ._core import Core
from ._cuda_tensor import CudaSharedTensor, Streams
from ._tensor import _Lease

log = logging.getLogger("tensordepot.client")
_CUDA_KINDS = (kDLCUDA, kDLCUDAManaged)
_PRUNE_AT_LEAST = 60.0  # s: a busy client still drops what the broker has freed this often


@dataclass
class State:
    """What one client keeps for its GPU work (its ``Core.gpu``)."""

    opened: set[str] = field(default_factory=set)  # blocks this client opened
    shared: dict[str, list[Any]] = field(default_factory=dict)  # allocation -> tensors kept alive
    wait_on_close: float = 0.0
    seen_requests: int = -1  # the client's request count at the last background prune
    last_prune: float = field(default_factory=time.monotonic)

    def prune(self, core: Core, *, foreground: bool = False) -> None:
        prune(core, foreground=foreground)

    def before_close(self, core: Core) -> None:
        before_close(core)


def state(core: Core) -> State:
    st = core.gpu
    if not isinstance(st, State):
        st = core.gpu = State()
    return st


def _live(core: Core, segments: list[str], **kw: Any) -> LiveReply:
    """Which of ``segments`` the broker still has (one round trip, blocking)."""
    body = LiveRequest.model_construct(segments=segments)
    return LiveReply.model_validate(core.call_now("POST", "/v1/cuda/live", body, **kw))


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


def involves_gpu(xs: list[Any], device: object = None) -> bool:
    """Whether a put of any of ``xs`` to ``device`` needs this module (a
    numpy array is on the host; nothing to put needs nothing)."""
    if not xs:
        return False
    if device is not None and _device(device).is_cuda:
        return True
    import numpy as np

    return any(on_gpu(x) for x in xs if type(x) is not np.ndarray)


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


def open_block(client: Core, h: Handle, ordinal: int) -> Any:
    """This process's mapping of the block ``h`` is in (opened once per process)."""
    cuda = _cuda()
    assert h.cuda is not None
    raw = decode_ipc(h.cuda.ipc_handle)
    st = state(client)
    try:
        m = cuda.open_mapping(h.segment, raw, ordinal=ordinal, size=h.cuda.block_size)
    except (RuntimeError, ValueError) as exc:  # cupy raises CUDARuntimeError
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
    rest = data[data.rfind(b")") + 2 :].split()  # comm may hold spaces and parentheses
    return len(rest) > 19 and rest[0] not in (b"Z", b"X") and rest[19] == str(start).encode()


def _producer_check(client: Core, h: Handle) -> Any:
    """For a shared tensor: a function that says whether its producer is gone
    or withdrew it (closed its Client, or its session ended) while it may
    still run and reuse the memory.

    A dead producer's pid (as the broker saw it) says so here, with no round
    trip; a live one may have withdrawn the share, which only the broker
    knows (one round trip, before each export and at the get)."""
    assert h.cuda is not None
    pid, start, segment = h.cuda.owner_pid, h.cuda.owner_start, h.segment
    ref = weakref.ref(client)

    def gone() -> bool:
        if pid is not None and not _alive(pid, start):
            return True
        c = ref()
        if c is None:
            return True
        try:
            reply = _live(c, [segment])
        except DepotError:
            return True  # the broker is gone too: so are its names
        return segment in reply.orphaned or segment not in reply.live

    return gone


def tensor(client: Core, h: Handle, *, writable: bool) -> CudaSharedTensor:
    """A SharedTensor for a CUDA handle from get, get_many or empty."""
    gone = None
    # If this raises, the operation gives back what the broker handed out.
    if h.cuda is None:
        raise BrokerUnavailable(
            f"the broker sent a CUDA handle for {h.name!r} without its CUDA fields"
        )
    cuda = _cuda()
    ordinal = _resolve(Device("cuda", uuid=h.cuda.uuid))[0]
    if h.cuda.owner_pid is not None or h.segment.startswith("share-"):
        gone = _producer_check(client, h)
        if gone():
            raise TensorBroken(
                f"tensor {h.name!r} v{h.version} was shared by a producer that "
                f"has exited or withdrawn it; CUDA keeps no promise about its "
                f"memory now"
            )
    m = open_block(client, h, ordinal)
    wev = (
        cuda.opened_event(decode_ipc(h.cuda.event_handle), ordinal)
        if h.cuda.event_handle is not None
        else None
    )
    rev = (
        cuda.opened_event(decode_ipc(h.cuda.release_event_handle), ordinal)
        if h.cuda.release_event_handle is not None
        else None
    )
    streams = Streams(ordinal, wev, rev)
    lease = (
        None if h.lease is None else gpu_lease(client, h.lease, streams, getattr(m, "uses", None))
    )
    return CudaSharedTensor(
        client, h, m, lease, writable=writable, ordinal=ordinal, streams=streams, producer_gone=gone
    )


def gpu_lease(client: Core, lease_id: int, streams: Streams, uses: Any = None) -> _Lease | None:
    """What keeps a GPU tensor's lease while a view lives.  Its finalizer only
    queues: the background thread records the release event on ``streams``,
    notes it in the mapping's ``uses`` (which closes only once it completed),
    then queues the release.  A finalizer may run inside this module's or
    shm._cuda's own code, holding its lock."""
    bg = client.bg
    if bg is None:
        return None
    bg.track(client.sid, lease_id)
    if uses is not None:
        uses.unrecorded.add(lease_id)
    return _Lease(
        lease_id,
        functools.partial(
            bg.release_after, functools.partial(_record, streams, uses, lease_id), client.sid
        ),
    )


def _record(streams: Streams, uses: Any, lease_id: int) -> None:
    """In the background thread: record the release event, and let the
    mapping know what to wait for before it closes.  Never raises."""
    streams.record_release()
    if uses is not None:
        if streams.release_event is not None and streams.streams:
            uses.events.append(streams.release_event)
        uses.unrecorded.discard(lease_id)


# -- housekeeping ----------------------------------------------------------------------------


def prune(client: Core, *, foreground: bool = False) -> None:
    """Close what the broker no longer has: opened blocks (once no view uses
    them) and the tensors kept alive for shares; and tell the broker which
    blocks this process still maps, so it frees none of those.  One round
    trip, only when this client has opened or shared something on a GPU."""
    cuda = sys.modules.get("tensordepot.shm._cuda")  # imported only where a GPU was used
    if cuda is None:
        return
    if not foreground:
        cuda.close_finished()  # mappings whose readers' kernels are now done
    st = client.gpu
    if not isinstance(st, State):
        return
    mapped = cuda.open_names()  # the broker frees a block it let go of once none names it
    if not (st.opened or st.shared or mapped):
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
    names = sorted(st.opened | set(st.shared) | mapped)
    try:
        reply = _live(client, names, background=not foreground)
    except DepotError as exc:
        log.debug("cannot ask the broker which CUDA blocks live: %s", exc)
        return
    if not foreground:
        st.seen_requests = client.round_trips  # our own request is no sign of work
    gone = set(names) - set(reply.live)
    cuda.forget(gone & st.opened)
    st.opened -= gone
    for seg in gone & set(st.shared):
        del st.shared[seg]


def before_close(client: Core) -> None:
    """Wait, up to the longest ``wait_on_close`` of this client's shares, for
    readers to release them; then let go of everything this client opened."""
    st = client.gpu
    if not isinstance(st, State):
        return
    deadline = time.monotonic() + st.wait_on_close
    while st.shared:
        try:
            reply = _live(client, sorted(st.shared))
        except DepotError:
            break
        if not reply.busy:
            break
        if time.monotonic() >= deadline:
            log.warning(
                "closing with %d shared allocation(s) still read by other processes; they "
                "will be told TensorBroken",
                len(reply.busy),
            )
            break
        time.sleep(0.02)
    st.shared.clear()
    if st.opened:
        from ..shm import _cuda

        _cuda.forget(st.opened)
        st.opened.clear()
