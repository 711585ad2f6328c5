"""Issue: DLPack done right.  SharedTensor.__dlpack__ against a real broker.

The legacy path of torch.utils.dlpack, capsules consumed twice, dropped or
rejected, copy / dl_device / stream, strides, read-only numpy views, views
that outlive their SharedTensor, and numpy() without ml_dtypes.  Leaks are
read from the broker: its lease count and the bytes it holds.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest
from _capsules import OneCapsule, is_capsule, managed
from _harness import BrokerProc, drained, run_worker, wait_for
from tensordepot import Client, SharedTensor
from tensordepot.shm import FLAG_IS_COPIED, FLAG_READ_ONLY

torch = pytest.importorskip("torch")

VERSIONS = [pytest.param(None, id="legacy"), pytest.param((1, 0), id="versioned")]
BIG = (512, 1024)  # 2 MiB of float32: the alloc path, and a range the pool would reuse
# A get's tensor exports from its own window; a get_many's from slices of the batch's window.
GETS = [
    pytest.param(lambda c, name: c.get(name), id="get"),
    pytest.param(lambda c, name: c.get_many([name])[name], id="get_many"),
]


def pointer(t: SharedTensor) -> int:
    return t._address


def freed(c: Client) -> None:
    wait_for(lambda: c.stat().bytes_in_use == 0, 10, what="the broker to free the bytes")


def raw_bytes(x: Any) -> bytes:
    return bytes(x.contiguous().view(torch.uint8).numpy().tobytes())


# -- the legacy path and double consumption ---------------------------------------
@pytest.mark.parametrize("get", GETS)
@pytest.mark.parametrize("dtype", ["bfloat16", "float8_e4m3fn", "float16"])
def test_legacy_torch_utils_path(broker: BrokerProc, dtype: str, get: Any) -> None:
    src = torch.from_numpy(np.random.default_rng(5).integers(0, 256, (64, 34), dtype=np.uint8))
    src = src.view(getattr(torch, dtype))
    with broker.client() as c:
        c.put("w", src)
        t = get(c, "w")
        cap = t.__dlpack__()
        assert is_capsule(cap, b"dltensor"), "max_version=None must give a legacy capsule"
        x = torch.utils.dlpack.from_dlpack(cap)
        assert x.dtype == src.dtype and raw_bytes(x) == raw_bytes(src)
        assert x.data_ptr() == pointer(t), "the legacy path must not copy"
        with pytest.raises(RuntimeError, match="consumed only once"):
            torch.utils.dlpack.from_dlpack(cap)
        y = torch.from_dlpack(t)  # the modern path
        assert raw_bytes(y) == raw_bytes(src) and y.data_ptr() == pointer(t)
        del x, y, cap, t
        drained(c, "leases")


def test_versioned_capsule_consumed_twice_raises(broker: BrokerProc) -> None:
    with broker.client() as c:
        c.put("w", np.arange(10.0))
        t = c.get("w")
        cap = t.__dlpack__(max_version=(1, 0))
        assert is_capsule(cap, b"dltensor_versioned")
        x = torch.utils.dlpack.from_dlpack(cap)
        with pytest.raises(RuntimeError, match="consumed only once"):
            torch.utils.dlpack.from_dlpack(cap)
        assert x.tolist() == list(np.arange(10.0))
        del x, cap, t
        drained(c, "leases")


# -- capsules that nobody consumes, or that a consumer rejects ----------------------
@pytest.mark.parametrize("max_version", VERSIONS)
def test_dropped_capsule_leaks_nothing(
    broker: BrokerProc, max_version: tuple[int, int] | None
) -> None:
    with broker.client() as c:
        c.put("w", np.ones(BIG, np.float32))
        t = c.get("w")
        cap = t.__dlpack__(max_version=max_version)
        c.delete("w")
        del t
        st = c.stat()
        assert st.leases == 1 and st.bytes_in_use > 0, "the unconsumed capsule must hold the lease"
        del cap  # consumed by nobody
        drained(c, "leases")
        freed(c)


@pytest.mark.parametrize("max_version", VERSIONS)
def test_rejected_capsule_leaks_nothing(
    broker: BrokerProc, max_version: tuple[int, int] | None
) -> None:
    """numpy refuses bfloat16; its own error reaches the caller, and nothing leaks."""
    native = torch.zeros(3, dtype=torch.bfloat16)
    with pytest.raises(Exception) as want:
        np.from_dlpack(native)
    with broker.client() as c:
        c.put("w", torch.ones(BIG, dtype=torch.bfloat16))
        t = c.get("w")
        c.delete("w")
        producer = t if max_version is not None else OneCapsule(t.__dlpack__())
        with pytest.raises(Exception) as got:
            np.from_dlpack(producer)
        assert (type(got.value), str(got.value)) == (type(want.value), str(want.value))
        assert got.value.__cause__ is None and got.value.__context__ is None
        del t, producer, got
        drained(c, "leases")
        freed(c)


# -- copy, dl_device, stream, strides ------------------------------------------------
def test_copy_true_is_independent_and_flagged(broker: BrokerProc) -> None:
    want = np.arange(12, dtype=np.float32).reshape(3, 4)
    with broker.client() as c:
        c.put("w", want)
        t = c.get("w")
        cap = t.__dlpack__(max_version=(1, 0), copy=True)
        mt, dl = managed(cap)
        assert mt.flags & FLAG_IS_COPIED and not mt.flags & FLAG_READ_ONLY
        assert dl.data + dl.byte_offset != pointer(t)
        del mt, dl, cap
        a = np.from_dlpack(t, copy=True)  # numpy passes copy=True to the producer
        assert a.flags.writeable and a.ctypes.data != pointer(t)
        a[...] = -1
        assert np.array_equal(t.numpy(), want), "writing the copy changed the shared tensor"
        del t
        drained(c, "leases")  # the copy holds no lease
        assert (a == -1).all()


@pytest.mark.parametrize("get", GETS)
def test_copy_false_and_none_never_copy(broker: BrokerProc, get: Any) -> None:
    with broker.client() as c:
        c.put("w", np.arange(12, dtype=np.float32))
        t = get(c, "w")
        for copy in (False, None):
            cap = t.__dlpack__(max_version=(1, 0), copy=copy)
            mt, dl = managed(cap)
            assert dl.data + dl.byte_offset == pointer(t)
            assert mt.flags == FLAG_READ_ONLY
            del mt, dl, cap
        a = np.from_dlpack(t, copy=False)
        assert a.ctypes.data == pointer(t)
        del a, t
        drained(c, "leases")


@pytest.mark.parametrize(
    "dl_device,ok",
    [
        pytest.param((1, 0), True, id="kDLCPU-0"),
        pytest.param((2, 0), False, id="kDLCUDA-0"),
        pytest.param((3, 0), False, id="kDLCUDAHost-0"),
        pytest.param((1, 1), False, id="kDLCPU-1"),
    ],
)
def test_dl_device(broker: BrokerProc, dl_device: tuple[int, int], ok: bool) -> None:
    with broker.client() as c:
        c.put("w", np.arange(4.0))
        t = c.get("w")
        if ok:
            cap = t.__dlpack__(max_version=(1, 0), dl_device=dl_device)
            _, dl = managed(cap)
            assert (dl.device.device_type, dl.device.device_id) == dl_device
            del dl, cap
            assert torch.from_dlpack(t, device="cpu").data_ptr() == pointer(t)
        else:
            for copy in (None, True, False):
                with pytest.raises(BufferError, match="cannot be exported to DLPack device"):
                    t.__dlpack__(max_version=(1, 0), dl_device=dl_device, copy=copy)
        del t
        drained(c, "leases")


def test_stream_must_be_none_on_cpu(broker: BrokerProc) -> None:
    with broker.client() as c:
        c.put("w", np.arange(4.0))
        t = c.get("w")
        with pytest.raises(BufferError, match="stream"):
            t.__dlpack__(stream=7)
        del t
        drained(c, "leases")


@pytest.mark.parametrize("max_version", VERSIONS)
def test_strides_always_filled(broker: BrokerProc, max_version: tuple[int, int] | None) -> None:
    with broker.client() as c:
        c.put("w", np.zeros((2, 3, 5), np.float16))
        t = c.get("w")
        cap = t.__dlpack__(max_version=max_version)
        _, dl = managed(cap)
        assert dl.ndim == 3 and dl.strides, "strides must be filled in, even for C order"
        assert [dl.strides[i] for i in range(3)] == [15, 5, 1] == list(t.strides)
        del dl, cap, t
        drained(c, "leases")


# -- read-only views ------------------------------------------------------------------
@pytest.mark.parametrize("get", GETS)
def test_numpy_views_of_published_tensors_are_read_only(broker: BrokerProc, get: Any) -> None:
    with broker.client() as c:
        c.put("f", np.arange(6, dtype=np.float32))
        c.put("bf", torch.ones(6, dtype=torch.bfloat16))
        f, bf = get(c, "f"), get(c, "bf")
        for view in (np.from_dlpack(f), f.numpy(), np.asarray(f), bf.numpy()):
            assert not view.flags.writeable
            with pytest.raises(ValueError, match="read-only"):
                view[0] = 1
            with pytest.raises(ValueError):
                view.flags.writeable = True  # numpy will not lift it either
        del view, f, bf
        drained(c, "leases")


def test_numpy_views_of_empty_are_writable(broker: BrokerProc) -> None:
    with broker.client() as c:
        out = c.empty("y", (4, 4), "float32")
        a, b = np.from_dlpack(out), out.numpy()
        assert a.flags.writeable and b.flags.writeable
        a[:2] = 1
        b[2:] = 2
        out.publish()
        got = c.get("y").numpy()
        assert got.tolist() == [[1.0] * 4] * 2 + [[2.0] * 4] * 2
        bf = c.empty("z", (3,), "bfloat16")
        v = bf.numpy()  # ml_dtypes bfloat16
        assert v.flags.writeable
        v[...] = 1.5
        bf.publish()
        assert torch.from_dlpack(c.get("z")).tolist() == [1.5] * 3
        del a, b, got, out, bf, v
        drained(c, "leases")


# -- lifetimes across consumers -------------------------------------------------------
def test_views_outlive_their_shared_tensor(
    broker: BrokerProc, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every imported view keeps the bytes; the lease ends with the last of them."""
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    jax = pytest.importorskip("jax")
    want = np.random.default_rng(3).standard_normal(BIG).astype(np.float32)
    with broker.client() as c:
        c.put("w", want)
        t = c.get("w")
        views: dict[str, Any] = {
            "numpy": np.from_dlpack(t),
            "torch": torch.from_dlpack(t),
            "jax": jax.dlpack.from_dlpack(t),
            "capsule": torch.utils.dlpack.from_dlpack(t.__dlpack__()),
        }
        t.release()
        del t
        c.delete("w")
        for name in list(views):
            for i in range(3):  # churn: a freed range would be reused and overwritten
                c.put(f"churn{i}", np.zeros(BIG, np.float32))
            changed = [
                other for other, v in views.items() if not np.array_equal(np.asarray(v), want)
            ]
            assert not changed, f"{changed} changed after the views before {name} were dropped"
            assert c.stat().leases == 1
            del views[name]
        drained(c, "leases")


def test_numpy_without_ml_dtypes(broker: BrokerProc) -> None:
    res = json.loads(run_worker("interop_noml", broker.url).stdout.splitlines()[-1])
    assert res["ml_dtypes_hidden"]
    for dtype in ("bfloat16", "float8_e4m3fn"):
        r = res[dtype]
        assert r["torch_bitexact"], f"{dtype}: put from torch and read into torch must be bit-exact"
        etype, msg = r["numpy_method"]
        assert etype == "InvalidRequest", r
        assert f"numpy has no built-in {dtype}" in msg and "pip install ml_dtypes" in msg, msg
        assert "torch.from_dlpack" in msg, "the error should say what to do instead"
        assert r["np_from_dlpack"] == r["np_native"], (
            "numpy's own error must come through unchanged"
        )
        assert r["drained"]
    assert res["float32_numpy"] == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
