"""DLPack capsules and the dtype table, without a broker.

Capsules are built over memory a numpy array owns; ``owner`` objects are
watched through weak references, so "the capsule freed what it held" is
observed, not assumed.
"""

from __future__ import annotations

import ctypes
import gc
import itertools
import weakref
from typing import Any

import numpy as np
import pytest
from _capsules import OneCapsule, is_capsule, managed
from tensordepot.shm import (
    DTYPES,
    FLAG_IS_COPIED,
    FLAG_READ_ONLY,
    DType,
    UnsupportedDType,
    array_at,
    dtype_from_dlpack,
    dtype_from_name,
    dtype_from_numpy,
    export_capsule,
    import_dlpack,
    numpy_dtype,
)

ml_dtypes = pytest.importorskip("ml_dtypes")

DTYPE_PARAMS = [pytest.param(name, id=name) for name in DTYPES]
VERSIONS = [pytest.param(None, id="legacy"), pytest.param((1, 0), id="versioned")]

# DLDataTypeCode in dlpack.h (v1.1+), written out here rather than read from the table under test.
DLPACK_CODES = {
    "bool": (6, 8),
    "int8": (0, 8),
    "int16": (0, 16),
    "int32": (0, 32),
    "int64": (0, 64),
    "uint8": (1, 8),
    "uint16": (1, 16),
    "uint32": (1, 32),
    "uint64": (1, 64),
    "float16": (2, 16),
    "float32": (2, 32),
    "float64": (2, 64),
    "bfloat16": (4, 16),
    "complex64": (5, 64),
    "complex128": (5, 128),
    "float8_e3m4": (7, 8),
    "float8_e4m3": (8, 8),
    "float8_e4m3b11fnuz": (9, 8),
    "float8_e4m3fn": (10, 8),
    "float8_e4m3fnuz": (11, 8),
    "float8_e5m2": (12, 8),
    "float8_e5m2fnuz": (13, 8),
    "float8_e8m0fnu": (14, 8),
}


class Owner:
    """Holds the bytes a capsule points at; weak-referenceable."""

    def __init__(self, nbytes: int) -> None:
        self.buf = np.random.default_rng(nbytes).integers(0, 2, nbytes, dtype=np.uint8)


def capsule(
    dtype: str,
    shape: tuple[int, ...] = (4, 6),
    *,
    max_version: tuple[int, int] | None = (1, 0),
    read_only: bool = True,
    copy: bool = False,
    strides: tuple[int, ...] | None = None,
) -> tuple[Any, Owner]:
    d = DTYPES[dtype]
    n = int(np.prod(shape)) if shape else 1
    owner = Owner(n * d.itemsize * 2)  # room for every-other-element strides
    if strides is None:
        strides = tuple(int(s) for s in np.empty(shape, np.uint8).strides)
    cap = export_capsule(
        owner.buf.ctypes.data,
        shape,
        strides,
        d,
        owner,
        read_only=read_only,
        max_version=max_version,
        copy=copy,
    )
    return cap, owner


# -- the dtype table ---------------------------------------------------------------
def test_table_has_every_dlpack_code() -> None:
    assert {n: (d.code, d.bits) for n, d in DTYPES.items()} == DLPACK_CODES
    assert all(d.lanes == 1 for d in DTYPES.values())


@pytest.mark.parametrize("dtype", DTYPE_PARAMS)
def test_table_round_trips(dtype: str) -> None:
    d = DTYPES[dtype]
    assert dtype_from_dlpack(d.code, d.bits, d.lanes) is d
    assert dtype_from_name(dtype) is d
    npdt = numpy_dtype(d)  # ml_dtypes is installed here
    assert npdt.itemsize == d.itemsize
    assert dtype_from_numpy(npdt) is d


def test_unknown_triple_is_clear() -> None:
    with pytest.raises(UnsupportedDType, match=r"code=17, bits=4, lanes=1.*not supported"):
        dtype_from_dlpack(17, 4, 1)


@pytest.mark.parametrize("dtype", DTYPE_PARAMS)
def test_array_at_every_dtype(dtype: str) -> None:
    """ml_dtypes types included: float8_e5m2 has a typestr ('<f1') numpy cannot parse back."""
    d = DTYPES[dtype]
    owner = Owner(5 * 2 * d.itemsize)
    npdt = numpy_dtype(d)
    arr = array_at(
        owner.buf.ctypes.data, (5,), (2 * d.itemsize,), npdt, writable=False, owner=owner
    )
    assert arr.dtype == npdt and not arr.flags.writeable
    want = owner.buf.reshape(5, 2, d.itemsize)[:, 0].tobytes()
    assert np.ascontiguousarray(arr).tobytes() == want
    assert array_at(
        owner.buf.ctypes.data, (5,), None, npdt, writable=True, owner=owner
    ).flags.writeable


# -- capsules we export ------------------------------------------------------------
@pytest.mark.parametrize("max_version", VERSIONS)
@pytest.mark.parametrize("dtype", DTYPE_PARAMS)
def test_capsule_dtype_and_strides(dtype: str, max_version: tuple[int, int] | None) -> None:
    shape, strides = (3, 4), (8, 2)  # every other element of a (3, 8) buffer
    cap, owner = capsule(dtype, shape, max_version=max_version, strides=strides)
    mt, t = managed(cap)
    assert (t.dtype.code, t.dtype.bits, t.dtype.lanes) == (*DLPACK_CODES[dtype], 1)
    assert [t.shape[i] for i in range(2)] == list(shape)
    assert t.strides, "strides must always be filled in"
    assert [t.strides[i] for i in range(2)] == list(strides)
    assert t.data + t.byte_offset == owner.buf.ctypes.data
    assert (t.device.device_type, t.device.device_id) == (1, 0)
    if max_version is None:
        assert is_capsule(cap, b"dltensor")
    else:  # 1.1 where the dtype needs it (float8 codes); numpy's own 1.0 for its dtypes
        want = (1, 1) if dtype_from_name(dtype).numpy_name is None else (1, 0)
        assert (mt.version.major, mt.version.minor) == want


@pytest.mark.parametrize(
    "shape",
    [
        pytest.param((7,), id="1d"),
        pytest.param((2, 3, 4), id="3d"),
        pytest.param((0, 5), id="empty"),
    ],
)
def test_contiguous_strides_are_filled(shape: tuple[int, ...]) -> None:
    for mv in (None, (1, 0)):
        cap, _ = capsule("float32", shape, max_version=mv)
        _, t = managed(cap)
        assert t.strides, f"NULL strides for shape {shape}"
        want = [s // 4 for s in np.empty(shape, np.float32).strides]
        assert [t.strides[i] for i in range(len(shape))] == want


@pytest.mark.parametrize(
    "read_only,copy,flags",
    [
        pytest.param(True, False, FLAG_READ_ONLY, id="read-only"),
        pytest.param(False, False, 0, id="writable"),
        pytest.param(True, True, FLAG_IS_COPIED, id="copy-of-read-only"),
        pytest.param(False, True, FLAG_IS_COPIED, id="copy-of-writable"),
    ],
)
def test_versioned_flags(read_only: bool, copy: bool, flags: int) -> None:
    cap, owner = capsule("bfloat16", read_only=read_only, copy=copy)
    mt, t = managed(cap)
    assert mt.flags == flags
    same = t.data + t.byte_offset == owner.buf.ctypes.data
    assert same != copy, "copy=True must point at new memory; copy=False at ours"
    n = 4 * 6 * 2
    got = ctypes.string_at(t.data + t.byte_offset, n)
    assert got == owner.buf[:n].tobytes()


def test_copy_does_not_hold_the_owner() -> None:
    cap, owner = capsule("float32", copy=True)
    ref = weakref.ref(owner)
    del owner
    gc.collect()
    assert ref() is None, "an independent copy must not keep the source memory alive"
    x = np.from_dlpack(OneCapsule(cap))
    assert x.flags.writeable  # IS_COPIED, not READ_ONLY


def test_numpy_honours_read_only() -> None:
    ro = np.from_dlpack(OneCapsule(capsule("float32", read_only=True)[0]))
    rw = np.from_dlpack(OneCapsule(capsule("float32", read_only=False)[0]))
    assert not ro.flags.writeable and rw.flags.writeable
    with pytest.raises(ValueError, match="read-only"):
        ro[0, 0] = 1


@pytest.mark.parametrize("max_version", VERSIONS)
def test_dropped_capsule_frees_its_owner(max_version: tuple[int, int] | None) -> None:
    cap, owner = capsule("bfloat16", max_version=max_version)
    ref = weakref.ref(owner)
    del owner
    assert ref() is not None, "the capsule must keep the memory alive"
    del cap  # consumed by nobody: the capsule's destructor calls the deleter
    assert ref() is None


@pytest.mark.parametrize("max_version", VERSIONS)
def test_rejected_capsule_frees_its_owner(max_version: tuple[int, int] | None) -> None:
    torch = pytest.importorskip("torch")
    with pytest.raises(Exception) as native:  # what numpy says about a torch bfloat16 tensor
        np.from_dlpack(torch.zeros(3, dtype=torch.bfloat16))
    cap, owner = capsule("bfloat16", max_version=max_version)
    ref = weakref.ref(owner)
    del owner
    with pytest.raises(Exception) as ours:
        np.from_dlpack(OneCapsule(cap))
    assert (type(ours.value), str(ours.value)) == (type(native.value), str(native.value))
    del cap, ours
    gc.collect()
    assert ref() is None


@pytest.mark.parametrize("max_version", VERSIONS)
def test_capsule_consumed_twice_raises(max_version: tuple[int, int] | None) -> None:
    torch = pytest.importorskip("torch")
    cap, owner = capsule("bfloat16", max_version=max_version)
    x = torch.utils.dlpack.from_dlpack(cap)
    assert x.dtype == torch.bfloat16
    assert x.view(torch.uint8).numpy().tobytes() == owner.buf[:48].tobytes()
    with pytest.raises(RuntimeError, match="consumed only once"):
        torch.utils.dlpack.from_dlpack(cap)
    ref = weakref.ref(owner)
    del owner, cap
    assert ref() is not None, "torch's tensor must keep the memory alive"
    del x
    assert ref() is None


# -- capsules we import (put) ------------------------------------------------------
def test_import_unknown_dtype_calls_the_deleter() -> None:
    weird = DType("float4_e2m1fn", 17, 8)  # a DLPack 1.1 code outside our table
    owner = Owner(16)
    ref = weakref.ref(owner)
    cap = export_capsule(
        owner.buf.ctypes.data, (16,), (1,), weird, owner, read_only=True, max_version=(1, 0)
    )
    del owner
    with pytest.raises(UnsupportedDType, match="code=17"):
        import_dlpack(OneCapsule(cap))
    del cap
    assert ref() is None, "a rejected producer tensor must be handed back through its deleter"


def test_import_unknown_major_version_calls_the_deleter() -> None:
    cap, owner = capsule("float32")
    mt, _ = managed(cap)
    mt.version.major = 2
    ref = weakref.ref(owner)
    del owner, mt
    with pytest.raises(BufferError, match="ABI version 2"):
        import_dlpack(OneCapsule(cap))
    del cap
    assert ref() is None


def test_import_torch_every_dtype() -> None:
    torch = pytest.importorskip("torch")
    for name, d in DTYPES.items():
        tdt = getattr(torch, name, None)
        if not isinstance(tdt, torch.dtype):
            continue
        rng = np.random.default_rng(d.code * 100 + d.bits)
        raw = rng.integers(0, 2, (6, 4 * d.itemsize), dtype=np.uint8)
        x = torch.from_numpy(raw).view(tdt)[:, ::2]  # strided
        with import_dlpack(x) as imp:
            assert imp.dtype is d, name
            assert imp.array.shape == (6, 2)
            want = np.ascontiguousarray(raw.reshape(6, 4, d.itemsize)[:, ::2]).tobytes()
            assert np.ascontiguousarray(imp.array).tobytes() == want, name


# -- a batch's arrays, made together (Views, views_at) ---------------------------------
class Keeper:
    """What a flat's owner stands for (a mapping, a lease); weak-referenceable."""


def _fields(cap: Any) -> tuple[Any, ...]:
    """A versioned capsule's dtype triple, shape, strides, address and flags."""
    mt, t = managed(cap)
    n = t.ndim
    return (
        (t.dtype.code, t.dtype.bits, t.dtype.lanes),
        [t.shape[i] for i in range(n)],
        [t.strides[i] for i in range(n)] if t.strides else None,
        t.data + t.byte_offset,
        mt.flags,
    )


@pytest.mark.parametrize(
    ("shape", "dtype", "offsets"),
    [
        pytest.param((256,), "float32", [0, 1024, 2048, 3072], id="evenly-spaced"),
        pytest.param((2, 3), "bfloat16", [64, 128, 192], id="evenly-spaced-2d-carrier"),
        pytest.param((100,), "float32", [0, 448, 896, 1344], id="spaced-with-gaps"),
        pytest.param((100,), "float32", [0, 448, 1024], id="unevenly-spaced"),
        pytest.param((256,), "float32", [0, 0, 1024], id="a-tie"),
        pytest.param((256,), "float32", [0, 512], id="overlapping"),
        pytest.param((), "int64", [8, 16, 24], id="scalars"),
        pytest.param((0,), "float32", [0, 0, 0], id="empty"),
        pytest.param((3,), "int16", [2048], id="one"),
    ],
)
def test_views_at_are_each_tensor_and_keep_the_owner(
    shape: tuple[int, ...], dtype: str, offsets: list[int]
) -> None:
    """Each array is the tensor at its offset, as an array made alone there
    would be (shape, dtype, bytes, read-only), whether numpy cut them as the
    rows of one array (evenly spaced, none overlapping the next) or made
    each; its capsule is the tensor's; the arrays are made at the first
    export of the run (``Views``); one array left keeps the owner."""
    from tensordepot.shm._dlpack import Views, export_view, owned

    flat = np.random.default_rng(1).integers(0, 256, 4096, dtype=np.uint8)
    flat.flags.writeable = False
    keeper = Keeper()
    ref = weakref.ref(keeper)
    d = DTYPES[dtype]
    ro = owned(flat, keeper)
    run = Views(ro, shape, d)
    run.offsets.extend(offsets)
    assert run.arrays is None, "nothing is made before an export"
    got = [
        _fields(export_view((ro, ro), at, shape, d, (1, 0), run, k)) for k, at in enumerate(offsets)
    ]
    views = run.arrays
    assert views is not None and len(views) == len(offsets) and run.made() is views
    rows = len(offsets) > 1 and views[0].base is views[1].base is not ro
    n = int(np.prod(shape)) * d.itemsize
    evenly = len(offsets) > 1 and len({b - a for a, b in itertools.pairwise(offsets)}) == 1
    assert rows == (evenly and shape != () and 0 < n <= offsets[1] - offsets[0]), "cut as rows"
    for view, at, fields in zip(views, offsets, got, strict=True):
        assert type(view) is np.ndarray and view.shape == shape and not view.flags.writeable
        assert view.flags.c_contiguous and view.dtype.itemsize == d.itemsize
        assert view.tobytes() == flat[at : at + n].tobytes()
        alone = _fields(export_view((ro, ro), at, shape, d, (1, 0)))
        assert fields == alone, "as one made alone"
        assert fields[0] == (*DLPACK_CODES[dtype], 1) and fields[-1] & FLAG_READ_ONLY
    last = export_view((ro, ro), at, shape, d, (1, 0), run, len(offsets) - 1)  # not consumed yet
    del keeper, ro, views, view, run
    gc.collect()
    assert ref() is not None, "an export of one array keeps the owner"
    del last
    gc.collect()
    assert ref() is None, "the owner goes with the last array"
