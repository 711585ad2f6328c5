"""The CUDA side of DLPack that needs no GPU: the ``stream`` argument of
``__dlpack__``, capsules that describe device memory, and borrowing a
producer's tensor fields.

A capsule for device memory is built the way CPU capsules are (numpy
records the address and never reads it) with its device patched; here the
"device" address is host memory nobody reads through the capsule, so the
fields can be checked byte for byte.
"""

from __future__ import annotations

import gc
import weakref
from typing import Any

import numpy as np
import pytest
from _capsules import is_capsule, managed
from tensordepot.shm import FLAG_IS_COPIED, FLAG_READ_ONLY, dtype_from_name, export_capsule
from tensordepot.shm._dlpack import (
    NO_SYNC,
    STREAM_LEGACY,
    STREAM_PER_THREAD,
    borrow_dlpack,
    kDLCPU,
    kDLCUDA,
    parse_stream,
    patch_capsule,
)

POINTER = 0x7F3A_1C00_0000  # what a cudaStream_t looks like


@pytest.mark.parametrize(
    "stream,want",
    [
        pytest.param(None, STREAM_LEGACY, id="None-is-legacy"),
        pytest.param(1, STREAM_LEGACY, id="1-legacy"),
        pytest.param(2, STREAM_PER_THREAD, id="2-per-thread"),
        pytest.param(-1, None, id="-1-no-sync"),
        pytest.param(POINTER, POINTER, id="pointer"),
        pytest.param(3, 3, id="small-pointer"),
        pytest.param((1 << 64) - 1, (1 << 64) - 1, id="largest-pointer"),
    ],
)
def test_stream_values_the_array_api_allows(stream: Any, want: int | None) -> None:
    assert parse_stream(stream) == want


@pytest.mark.parametrize(
    "stream,exc,match",
    [
        pytest.param(0, ValueError, "ambiguous", id="0"),
        pytest.param(-2, ValueError, "not a cudaStream_t", id="-2"),
        pytest.param(1 << 64, ValueError, "not a cudaStream_t", id="too-big"),
        pytest.param(True, TypeError, "is an int", id="bool"),
        pytest.param(1.0, TypeError, "is an int", id="float"),
        pytest.param("1", TypeError, "is an int", id="str"),
        pytest.param(object(), TypeError, "cuda_stream", id="a-stream-object"),
    ],
)
def test_bad_streams_say_what_is_allowed(stream: Any, exc: type[Exception], match: str) -> None:
    with pytest.raises(exc, match=match):
        parse_stream(stream)
    assert NO_SYNC == -1


class Owner:
    def __init__(self, nbytes: int) -> None:
        self.buf = np.arange(nbytes, dtype=np.uint8)


@pytest.mark.parametrize(
    "max_version", [pytest.param(None, id="legacy"), pytest.param((1, 1), id="versioned")]
)
@pytest.mark.parametrize("dtype", ["bfloat16", "float32", "float8_e4m3fn", "int64", "complex128"])
def test_cuda_capsule_names_the_gpu_and_keeps_its_owner(
    max_version: tuple[int, int] | None, dtype: str
) -> None:
    dt = dtype_from_name(dtype)
    shape, strides = (3, 5), (5, 1)
    owner = Owner(15 * dt.itemsize)
    address = owner.buf.ctypes.data
    cap = export_capsule(
        address,
        shape,
        strides,
        dt,
        owner,
        read_only=True,
        max_version=max_version,
        device=(kDLCUDA, 3),
    )
    ref = weakref.ref(owner)
    del owner
    gc.collect()
    assert ref() is not None, "the capsule holds its owner until the consumer is done"
    mt, t = managed(cap)
    assert (t.device.device_type, t.device.device_id) == (kDLCUDA, 3)
    assert (t.dtype.code, t.dtype.bits, t.dtype.lanes) == (dt.code, dt.bits, 1)
    assert t.data + t.byte_offset == address
    assert [t.shape[i] for i in range(2)] == list(shape)
    assert [t.strides[i] for i in range(2)] == list(strides)
    if max_version is not None:
        assert is_capsule(cap, b"dltensor_versioned")
        assert (mt.version.major, mt.version.minor) == (1, 1)
        assert mt.flags & FLAG_READ_ONLY and not mt.flags & FLAG_IS_COPIED
    else:
        assert is_capsule(cap, b"dltensor")
    del cap, mt, t
    gc.collect()
    assert ref() is None, "an unconsumed capsule frees what it held"


def test_device_memory_is_never_copied_through_numpy() -> None:
    owner = Owner(8)
    with pytest.raises(ValueError, match="host memory only"):
        export_capsule(
            owner.buf.ctypes.data,
            (8,),
            (1,),
            dtype_from_name("uint8"),
            owner,
            read_only=False,
            max_version=(1, 0),
            copy=True,
            device=(kDLCUDA, 0),
        )


def test_patch_capsule_sets_flags_and_device() -> None:
    arr = np.zeros(4, dtype=np.uint16)
    cap = arr.__dlpack__(max_version=(1, 0))
    patch_capsule(cap, dtype_from_name("bfloat16"), (kDLCPU, 0), FLAG_IS_COPIED)
    mt, t = managed(cap)
    assert mt.flags == FLAG_IS_COPIED
    assert (t.dtype.code, t.dtype.bits) == (4, 16)


def test_borrow_reads_fields_and_returns_the_tensor() -> None:
    torch = pytest.importorskip("torch")
    base = torch.arange(24, dtype=torch.bfloat16).reshape(4, 6)
    x = base[:, 1:5]  # strided
    b = borrow_dlpack(x)
    assert b.device == (kDLCPU, 0)
    assert b.shape == (4, 4) and b.strides == (6, 1) and not b.contiguous
    assert b.dtype.name == "bfloat16" and b.nbytes == 32
    assert b.address == x.data_ptr()
    b.close()
    b.close()  # idempotent: the deleter runs once
    c = borrow_dlpack(base)
    assert c.contiguous
    c.close()


def test_borrow_passes_the_stream_only_when_given() -> None:
    seen: list[dict[str, Any]] = []

    class Producer:
        def __init__(self) -> None:
            self.arr = np.zeros((2, 2), dtype=np.float32)

        def __dlpack__(self, **kw: Any) -> Any:
            seen.append(kw)
            return self.arr.__dlpack__(max_version=kw.get("max_version"))

    borrow_dlpack(Producer()).close()
    borrow_dlpack(Producer(), stream=POINTER).close()
    assert seen == [{"max_version": (1, 1)}, {"max_version": (1, 1), "stream": POINTER}]


def test_contiguity_ignores_strides_of_size_one_dims() -> None:
    arr = np.zeros((3, 1, 4), dtype=np.float32)
    b = borrow_dlpack(arr[:, :, :])
    assert b.contiguous
    b.close()
    b = borrow_dlpack(np.asfortranarray(np.zeros((3, 4), dtype=np.float32)))
    assert not b.contiguous
    b.close()
