"""CudaSharedTensor without a GPU: what its DLPack export checks and says,
and the order of a lease's end (record the release event, then release).

``StandIn`` plays the opened IPC mapping: its address is host memory that
nothing reads through the capsule (a device address is only recorded, as
on a GPU).  With no write or release event, no CUDA call is made, so every
check below runs here; the GPU paths run in tests/e2e/test_cuda.py.
"""

from __future__ import annotations

import functools
import gc
import logging
import os
from typing import Any

import numpy as np
import pytest
from _capsules import managed
from tensordepot import InvalidRequest, SharedTensor, TensorBroken, TensorReleased
from tensordepot._wire import CudaHandle, Handle, encode_ipc
from tensordepot.client._cuda_tensor import CudaSharedTensor, Streams
from tensordepot.client._tensor import _Lease
from tensordepot.shm import FLAG_READ_ONLY
from tensordepot.shm._dlpack import kDLCPU, kDLCUDA

UUID = "GPU-8932f937-d72c-4106-c12f-20bd9faed9f6"
ORDINAL = 2
POINTER = 0x7F3A_1C00_0000


class StandIn:
    kind = "cuda"
    name = "block"
    writable = True

    def __init__(self, nbytes: int) -> None:
        self.buf = np.zeros(nbytes, dtype=np.uint8)
        self.address = self.buf.ctypes.data
        self.size = nbytes


class ClientStandIn:
    """Only held by weak reference; a publish would need a real Client."""


def make(
    *,
    writable: bool = False,
    release_event: int | None = None,
    lease: _Lease | None = None,
    producer_gone: Any = None,
    dtype: str = "bfloat16",
) -> tuple[CudaSharedTensor, Streams]:
    h = Handle(
        name="w",
        version=1,
        kind="cuda",
        segment="block",
        offset=256,
        nbytes=2 * 12,
        shape=[3, 4],
        strides=[4, 1],
        dtype=dtype,
        device=f"cuda:{UUID}",
        state="writing" if writable else "ready",
        lease=None if lease is None else lease.id,
        cuda=CudaHandle(uuid=UUID, ipc_handle=encode_ipc(os.urandom(64)), block_size=4096),
    )
    streams = Streams(ORDINAL, None, release_event)
    client = ClientStandIn()
    t = CudaSharedTensor(
        client,
        h,
        StandIn(4096),
        lease,  # type: ignore[arg-type]
        writable=writable,
        ordinal=ORDINAL,
        streams=streams,
        producer_gone=producer_gone,
    )
    t._keep = client  # type: ignore[attr-defined]
    return t, streams


def test_it_is_a_shared_tensor_on_this_processs_ordinal() -> None:
    t, _ = make()
    assert isinstance(t, SharedTensor)
    assert t.__dlpack_device__() == (kDLCUDA, ORDINAL)
    assert (t.device, t.device_uuid) == (f"cuda:{ORDINAL}", UUID)


@pytest.mark.parametrize(
    "stream,noted",
    [
        pytest.param(None, 1, id="None-legacy"),
        pytest.param(1, 1, id="legacy"),
        pytest.param(2, 1, id="per-thread-is-released-on-legacy"),
        pytest.param(POINTER, POINTER, id="pointer"),
        pytest.param(-1, 1, id="no-sync-falls-back-to-legacy"),
    ],
)
@pytest.mark.parametrize(
    "max_version", [pytest.param(None, id="legacy"), pytest.param((1, 0), id="versioned")]
)
def test_export_names_the_gpu_and_remembers_the_stream(
    stream: Any, noted: int, max_version: tuple[int, int] | None
) -> None:
    t, streams = make()
    cap = t.__dlpack__(stream=stream, max_version=max_version)
    mt, dl = managed(cap)
    assert (dl.device.device_type, dl.device.device_id) == (kDLCUDA, ORDINAL)
    assert (dl.dtype.code, dl.dtype.bits) == (4, 16), "bfloat16 keeps its DLPack code"
    assert dl.data + dl.byte_offset == t._address
    if max_version is not None:
        assert mt.flags & FLAG_READ_ONLY
    assert streams.streams == {noted}, "the release will be ordered after this stream"
    del cap, mt, dl


@pytest.mark.parametrize("stream", [0, -2, True, 1.5, "1", object(), 1 << 64])
def test_invalid_streams_are_invalid_requests(stream: Any) -> None:
    t, streams = make()
    with pytest.raises(InvalidRequest, match="stream"):
        t.__dlpack__(stream=stream, max_version=(1, 0))
    assert streams.streams == set(), "nothing is remembered for a refused export"


def test_other_devices_and_copies_are_refused_or_explained() -> None:
    t, _ = make()
    with pytest.raises(BufferError, match="cannot be exported to DLPack device"):
        t.__dlpack__(dl_device=(kDLCUDA, ORDINAL + 1))
    with pytest.raises(BufferError, match="pass copy=True"):
        t.__dlpack__(dl_device=(kDLCPU, 0), copy=False)
    # torch.from_dlpack(t, device="cpu") names its CUDA stream: taken (the
    # copy runs there), but it must still be a stream.
    with pytest.raises(InvalidRequest, match="stream"):
        t.__dlpack__(dl_device=(kDLCPU, 0), copy=True, stream="1")
    same = t.__dlpack__(dl_device=(kDLCUDA, ORDINAL))  # torch.from_dlpack passes its own device
    del same


def test_numpy_says_how_to_read_it() -> None:
    t, _ = make()
    with pytest.raises(InvalidRequest, match=r"np.from_dlpack\(t, device='cpu', copy=True\)"):
        t.numpy()
    with pytest.raises(InvalidRequest, match=r"torch\.from_dlpack"):
        np.asarray(t)


def test_a_shared_tensor_whose_producer_died_is_broken() -> None:
    t, _ = make(producer_gone=lambda: True)
    with pytest.raises(TensorBroken, match="producer that has exited"):
        t.__dlpack__(stream=1)
    alive, _ = make(producer_gone=lambda: False)
    cap = alive.__dlpack__(stream=1, max_version=(1, 0))  # a live producer: exported as usual
    del cap


def test_a_released_tensor_says_so() -> None:
    t, _ = make()
    t.release()
    with pytest.raises(TensorReleased):
        t.__dlpack__(stream=1)


def test_writable_tensors_export_writable_and_wait_for_nothing() -> None:
    t, streams = make(writable=True, dtype="float16")
    cap = t.__dlpack__(stream=POINTER, max_version=(1, 0))
    mt, _ = managed(cap)
    assert not mt.flags & FLAG_READ_ONLY
    assert streams.streams == {POINTER}, "publish() records the write after this stream"
    del cap, mt


def test_the_release_comes_after_the_record_and_after_every_view(
    caplog: pytest.LogCaptureFixture,
) -> None:
    released: list[tuple[str, int]] = []
    streams_seen: list[set[int]] = []

    # No release event: nothing to record (the background thread then queues
    # the release: tests/client/test_cuda_release.py).
    plain = Streams(ORDINAL, None, None)
    plain.consumed_on(None)
    plain.record_release()

    # A release event, but no GPU here: the record fails and is reported, and
    # never raises, so the background thread still sends the release.
    recorded = Streams(1000, None, 12345)  # an ordinal no machine has: CUDA refuses at once
    recorded.streams.add(POINTER)
    with caplog.at_level(logging.WARNING, logger="tensordepot.client"):
        recorded.record_release()
    assert "could not record the release event" in caplog.text

    # Through a real lease: the release waits for the tensor and its capsule.
    def on_free(streams: Streams, sid: str, lease_id: int) -> None:
        streams_seen.append(set(streams.streams))
        released.append((sid, lease_id))

    holder = Streams(ORDINAL, None, None)
    lease = _Lease(3, functools.partial(on_free, holder, "s"))
    t, _ = make(lease=lease)
    t._streams = holder
    del lease
    cap = t.__dlpack__(stream=POINTER, max_version=(1, 0))
    del t
    gc.collect()
    assert released == [], "the capsule still holds the lease"
    del cap
    gc.collect()
    assert released == [("s", 3)]
    assert streams_seen == [{POINTER}], "the streams it was used on were known at release"
