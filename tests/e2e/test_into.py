"""Gets into buffers the caller owns, against a real broker, through both
clients: ``get(name, out=buffer)`` and ``get_many(names, out={...})`` copy
the version into numpy arrays and torch tensors (contiguous or not,
bfloat16 included), give the lease back at once, and return the buffers;
a buffer of another dtype or shape is refused and nothing is written."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from _both import Api
from _harness import wait_for
from tensordepot import InvalidRequest, InvalidType, SharedTensor


def _no_leases(api: Api) -> None:
    wait_for(lambda: api.stat().leases == 0, 10, what="every lease given back")


def test_get_into_numpy_and_torch_buffers(api: Api) -> None:
    big = np.arange(3 << 20, dtype=np.float32).reshape(3, -1)  # 12 MiB: the copy threads
    api.put("big", big)
    api.put("w", torch.arange(12, dtype=torch.float32).reshape(3, 4).to(torch.bfloat16))
    buf = np.zeros_like(big)
    assert api.get("big", out=buf) is buf and np.array_equal(buf, big)
    t = torch.zeros(3, 4, dtype=torch.bfloat16)
    assert api.get("w", out=t) is t
    assert torch.equal(t, torch.arange(12, dtype=torch.float32).reshape(3, 4).to(torch.bfloat16))
    strided = torch.zeros(4, 3, dtype=torch.bfloat16).t()  # not contiguous: torch copies it
    api.get("w", out=strided)
    assert torch.equal(strided, t)
    half = np.zeros((3, 8), np.float32)[:, ::2]  # a numpy view with strides
    api.put("f", np.ones((3, 4), np.float32))
    api.get("f", out=half)
    assert half.tolist() == [[1.0] * 4] * 3
    _no_leases(api)
    v = api.put("big", big + 1)
    assert api.get("big", out=buf, version=v) is buf and buf[0, 0] == 1.0
    api.delete_many(["big", "w", "f"])
    _no_leases(api)


def test_get_many_into_buffers_and_tensors(api: Api) -> None:
    sd = {f"layer{i}.w": torch.full((64, 64), float(i)) for i in range(4)}
    api.put_many(sd)
    mine = {n: torch.empty(64, 64) for n in list(sd)[:3]}
    got = api.get_many(list(sd), out=mine)
    for n in list(sd)[:3]:
        assert got[n] is mine[n] and torch.equal(mine[n], sd[n])
    rest = got["layer3.w"]
    assert isinstance(rest, SharedTensor) and torch.equal(torch.from_dlpack(rest), sd["layer3.w"])
    del got, rest
    _no_leases(api)
    api.delete(prefix="layer")


def test_a_buffer_that_does_not_match_is_refused_and_nothing_is_written(api: Api) -> None:
    api.put_many({"a": np.ones(4, np.float32), "b": np.ones((2, 2), np.float32)})
    a, b = np.zeros(4, np.float32), np.zeros(4, np.float32)  # b has the wrong shape
    with pytest.raises(InvalidRequest, match=r"out\['b'\] is float32 of shape \[4\]"):
        api.get_many(["a", "b"], out={"a": a, "b": b})
    assert not a.any() and not b.any(), "one bad buffer: none written"
    with pytest.raises(InvalidRequest, match="is float64 of shape"):
        api.get("a", out=np.zeros(4, np.float64))
    ro = np.zeros(4, np.float32)
    ro.flags.writeable = False
    with pytest.raises(InvalidRequest, match="read-only"):
        api.get("a", out=ro)
    with pytest.raises(InvalidType, match="jax arrays"):
        api.get("a", out=[0.0] * 4)
    with pytest.raises(InvalidRequest, match="not among the names"):
        api.get_many(["a"], out={"b": b})
    _no_leases(api)
    api.delete_many(["a", "b"])
