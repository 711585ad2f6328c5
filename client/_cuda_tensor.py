"""CudaSharedTensor: a SharedTensor in GPU memory, exported stream-correctly.

Streams (the DLPack protocol).  A consumer names its stream in
``__dlpack__(stream=s)``; before the capsule is handed over, ``s`` waits
(on the GPU, not the host) for the version's write event, so kernels on
``s`` see the published bytes.  ``None`` and ``1`` are the legacy default
stream, ``2`` the per-thread default stream, ``-1`` means the consumer
orders its own work.

Reuse.  Every stream a tensor was exported to is remembered.  When its
lease ends (the tensor and every view of it are gone), the client's
background thread records the lease's release event on those streams, then
queues the release (the finalizer itself only queues: it may run inside any
code, even this module's, holding its lock).  The broker reuses the memory
only once that event has completed: kernels still queued on a consumer's
stream keep reading the bytes they were given.  A consumer that uses the
tensor on another stream than the one it named must order that stream
itself, as with ``torch.Tensor.record_stream``.  Streams must outlive the
tensors exported to them by a moment (the background thread records on
them just after the last view goes); torch never destroys its streams.
With ``-1`` the legacy default stream stands in for the unknown consumer
stream.  So it does for ``2``, the per-thread default stream: that names the
calling thread's stream, and the event is recorded from another thread, but
the legacy default stream waits for the work queued before on every
thread's per-thread default stream.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .._errors import InvalidRequest, TensorBroken
from .._wire import Handle
from ..shm._dlpack import (
    FLAG_IS_COPIED,
    STREAM_LEGACY,
    STREAM_PER_THREAD,
    export_capsule,
    kDLCPU,
    kDLCUDA,
    parse_stream,
    patch_capsule,
)
from ._tensor import Publisher, SharedTensor, _Lease

if TYPE_CHECKING:
    from typing_extensions import Self

log = logging.getLogger("tensordepot.client")


def _for_release(stream: int | None) -> int:
    """The stream to record a release event on for a consumer's ``stream``,
    from another thread (module docstring)."""
    return STREAM_LEGACY if stream is None or stream == STREAM_PER_THREAD else stream


class Streams:
    """The events of one CUDA tensor and the streams it was exported to."""

    __slots__ = ("ordinal", "release_event", "streams", "write_event")

    def __init__(self, ordinal: int, write_event: int | None, release_event: int | None) -> None:
        self.ordinal = ordinal
        self.write_event = write_event
        self.release_event = release_event
        self.streams: set[int] = set()

    def consumed_on(self, stream: int | None) -> None:
        """A consumer got the tensor on ``stream`` (None: it orders its own work):
        make that stream wait for the write, and remember it for the release."""
        if stream is not None and self.write_event is not None:
            from ..shm import _cuda

            _cuda.wait(stream, self.write_event, self.ordinal)
        self.streams.add(_for_release(stream))

    def record_release(self) -> None:
        """Record the release event after every use queued on the consumers'
        streams.  The client's background thread calls it once the lease's
        views are gone (``Background.release_after``): it never raises."""
        if self.release_event is None or not self.streams:
            return
        try:
            from ..shm import _cuda

            _cuda.record(self.release_event, sorted(self.streams), self.ordinal)
        except Exception as exc:  # in a finalizer: report, never raise
            log.warning(
                "could not record the release event on cuda:%d: %s; the broker may reuse "
                "the memory before queued kernels finish reading it",
                self.ordinal,
                exc,
            )


class CudaSharedTensor(SharedTensor):
    """A tensor in GPU memory (a broker block, or a producer's ``share()``).

    ``device`` is this process's ``cuda:N``; ``device_uuid`` names the GPU
    everywhere.  CUDA IPC cannot map memory read-only: a tensor from ``get``
    is flagged READ_ONLY in its capsule, but a consumer that writes through
    it changes the published bytes."""

    def __init__(
        self,
        client: Publisher,
        handle: Handle,
        mapping: Any,
        lease: _Lease | None,
        *,
        writable: bool,
        ordinal: int,
        streams: Streams,
        producer_gone: Callable[[], bool] | None = None,
    ) -> None:
        super().__init__(client, handle, mapping, lease, writable=writable)
        self._address = mapping.address + handle.offset  # the block is mapped whole
        assert handle.cuda is not None
        self.device = f"cuda:{ordinal}"
        self.device_uuid: str = handle.cuda.uuid
        self._ordinal = ordinal
        self._streams = streams
        self._producer_gone = producer_gone

    def _check_producer(self) -> None:
        if self._producer_gone is not None and self._producer_gone():
            raise TensorBroken(
                f"tensor {self.name!r} v{self.version} was shared by a producer that has exited "
                f"or withdrawn it (closed its Client); its memory may hold other tensors now: get "
                f"the name again once it is re-published, and prefer put() when the producer may "
                f"exit or close first"
            )

    # -- DLPack ------------------------------------------------------------
    def __dlpack_device__(self) -> tuple[int, int]:
        return (kDLCUDA, self._ordinal)

    def __dlpack__(
        self,
        *,
        stream: Any = None,
        max_version: tuple[int, int] | None = None,
        dl_device: tuple[int, int] | None = None,
        copy: bool | None = None,
    ) -> Any:
        """A capsule on this GPU, ordered after the write on ``stream``.

        ``dl_device=(kDLCPU, 0)`` copies the bytes to host memory (it needs
        ``copy`` True or None); ``copy=True`` on the GPU exports a fresh copy."""
        owner = self._alive()
        self._check_producer()
        here = (kDLCUDA, self._ordinal)
        target = here if dl_device is None else (int(dl_device[0]), int(dl_device[1]))
        if target == (kDLCPU, 0):
            if copy is False:
                raise BufferError(
                    f"tensor {self.name!r} is on {self.device}; exporting it to the CPU needs a "
                    f"copy: pass copy=True (np.from_dlpack(t, device='cpu', copy=True))"
                )
            # torch.from_dlpack(t, device="cpu") names its current CUDA stream:
            # the copy runs there, after the work queued on it, as cupy does.
            try:
                s = None if stream is None or stream == -1 else parse_stream(stream)
            except (TypeError, ValueError) as exc:
                raise InvalidRequest(str(exc)) from None
            return self._host_capsule(max_version, s)
        if target != here:
            raise BufferError(
                f"tensor {self.name!r} is on {self.device} ({self.device_uuid}) and cannot be "
                f"exported to DLPack device {target}; import it here and move it"
            )
        try:
            s = parse_stream(stream)
        except (TypeError, ValueError) as exc:
            raise InvalidRequest(str(exc)) from None
        if copy:
            return self._device_copy(s, max_version)
        if self.writable:
            self._streams.streams.add(_for_release(s))  # nothing written yet
        else:
            self._streams.consumed_on(s)
        return export_capsule(
            self._address,
            self.shape,
            self.strides,
            self._dt,
            owner,
            read_only=not self.writable,
            max_version=max_version,
            device=here,
        )

    def _host_capsule(self, max_version: tuple[int, int] | None, stream: int | None) -> Any:
        """A host copy, made on ``stream`` (None: this process's own stream)."""
        import numpy as np

        from ..shm import _cuda

        host = np.empty(self.nbytes, dtype=np.uint8)
        ptr = _cuda.stream(self._ordinal).ptr if stream is None else stream
        self._streams.consumed_on(ptr)
        _cuda.memcpy(host.ctypes.data, self._address, self.nbytes, ptr, self._ordinal)
        _cuda.synchronize_stream(ptr, self._ordinal)  # this one stream: the host must see the bytes
        cap = export_capsule(
            host.ctypes.data,
            self.shape,
            self.strides,
            self._dt,
            host,
            read_only=False,
            max_version=max_version,
        )
        patch_capsule(cap, self._dt, (kDLCPU, 0), FLAG_IS_COPIED)
        return cap

    def _device_copy(self, s: int | None, max_version: tuple[int, int] | None) -> Any:
        from ..shm import _cuda

        cp = _cuda._cupy()
        stream_ptr = _cuda.stream(self._ordinal).ptr if s is None else s
        with _cuda.on_device(self._ordinal):
            buf = cp.empty(self.shape, dtype=self._dt.numpy_name or self._dt.storage)
        self._streams.consumed_on(stream_ptr)
        _cuda.memcpy(buf.data.ptr, self._address, self.nbytes, stream_ptr, self._ordinal)
        if s is None:  # the consumer orders nothing: the copy must be done when it gets it
            _cuda.stream(self._ordinal).synchronize()
        with _cuda.on_device(self._ordinal):
            cap = buf.__dlpack__(stream=-1, max_version=max_version)
        patch_capsule(cap, self._dt, (kDLCUDA, self._ordinal), FLAG_IS_COPIED)
        return cap

    def numpy(self) -> Any:
        raise InvalidRequest(
            f"tensor {self.name!r} is on {self.device} ({self.device_uuid}); numpy reads host "
            f"memory. Use torch.from_dlpack(t) or cupy.from_dlpack(t) on the GPU, or copy it to "
            f"the host: np.from_dlpack(t, device='cpu', copy=True)"
        )

    # -- writing -----------------------------------------------------------
    def publish(self, stream: Any = None) -> Self:
        """Make this ``empty()`` tensor visible, once the writes queued on the
        streams it was exported to (or on ``stream``) are done.

        Waits on the host for that one event, never the whole device: a
        version is published only with its bytes in place, so it survives
        this process exiting right after."""
        if self.writable and not self.published and self._streams.write_event is not None:
            self._alive()
            if stream is not None:
                try:
                    s = parse_stream(stream)
                except (TypeError, ValueError) as exc:
                    raise InvalidRequest(str(exc)) from None
                streams = [STREAM_LEGACY if s is None else s]
            else:
                streams = sorted(self._streams.streams) or [STREAM_LEGACY]
            from ..shm import _cuda

            _cuda.record(self._streams.write_event, streams, self._ordinal)
            _cuda.synchronize(self._streams.write_event, self._ordinal)
        super().publish()
        return self
