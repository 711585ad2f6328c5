"""Nested state dicts against a real broker, through both clients: an AdamW
state after 3 steps goes in with ``put_state_dict`` and comes back with
``get_state_dict`` bit-exact, its tensors zero copy (mapped from the
broker's segments), and ``optimizer.load_state_dict`` takes it; a second
put replaces the first whole, and a structure nobody put is refused."""

from __future__ import annotations

import gc
from typing import Any

import numpy as np
import pytest
import torch
from _both import Api
from _harness import BrokerProc, in_segment, wait_for
from tensordepot import InvalidRequest, InvalidType, TensorNotFound


def _trained(steps: int = 3) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.8, 0.95))
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(4, 8)).sum().backward()
        opt.step()
    return model, opt


def _same(a: Any, b: Any, path: str = "") -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape, path
        assert torch.equal(
            a.view(torch.uint8) if a.dim() else a, b.view(torch.uint8) if b.dim() else b
        ), path
        return
    assert type(a) is type(b), (path, type(a), type(b))
    if isinstance(a, dict):
        assert list(a) == list(b), path
        for k in a:
            _same(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _same(x, y, f"{path}.{i}")
    else:
        assert a == b, path


def test_an_adamw_state_round_trips_bit_exact_and_zero_copy(api: Api, broker: BrokerProc) -> None:
    _, opt = _trained()
    sd = opt.state_dict()
    assert set(sd["state"]) == {0, 1, 2, 3} and isinstance(sd["param_groups"][0]["betas"], tuple)
    v = api.put_state_dict("opt/", sd)
    names = sorted(i.name for i in api.list(prefix="opt/"))
    assert "opt/state.0.exp_avg" in names and "opt/__structure__" in names, names
    back = api.get_state_dict("opt/")
    _same(sd, back)
    for state in back["state"].values():
        for t in state.values():
            assert in_segment(t.data_ptr(), broker.prefix), "zero copy"
    _, fresh = _trained(0)
    fresh.load_state_dict(back)
    _same(sd, fresh.state_dict())
    del back, fresh, state, t

    sd2 = {"step": 7, "nested": {"w": [np.arange(3.0), (None, "x", 1.5)]}}
    assert api.put_state_dict("opt/", sd2) > v
    again = api.get_state_dict("opt/")
    assert again["step"] == 7 and again["nested"]["w"][1] == (None, "x", 1.5)
    assert np.array_equal(again["nested"]["w"][0], np.arange(3.0))
    assert sorted(i.name for i in api.list(prefix="opt/")) == [
        "opt/__structure__",
        "opt/nested.w.0",
    ], "the first put's tensors are gone"
    del again
    gc.collect()  # an optimizer lives in reference cycles (its hooks): collected, not freed
    api.delete(prefix="opt/")
    wait_for(lambda: api.stat().leases == 0, 10, what="every lease given back")


def test_what_is_not_a_state_dict_is_refused(api: Api) -> None:
    with pytest.raises(InvalidType, match=r"state dict value a\.b is a builtins\.object"):
        api.put_state_dict("s/", {"a": {"b": object()}})
    with pytest.raises(InvalidType, match="keys are str"):
        api.put_state_dict("s/", {(1, 2): 3})
    assert api.list(prefix="s/") == []
    with pytest.raises(TensorNotFound):
        api.get_state_dict("s/")
    api.put("s/__structure__", np.frombuffer(b'{"$d":[[1]]}', np.uint8))
    with pytest.raises(InvalidRequest, match="put the state dict again"):
        api.get_state_dict("s/")
    api.put("s/__structure__", np.zeros(3, np.float32))
    with pytest.raises(InvalidRequest, match="not a state dict's structure"):
        api.get_state_dict("s/")
    api.delete(prefix="s/")
