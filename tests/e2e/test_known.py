"""A get_many of a batch the client got whole before (client/_known.py,
``HandleColumns.key``): the broker leaves out the columns the client keeps
when the answer is the same pack's rows, and a tensor is never mapped by
columns that are not its own: not after the producer changes the batch's
layout, not for other rows, not from another run of the broker."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
from _harness import BrokerProc, drained
from tensordepot import Client

KIB = 1024
N = 20


def _batch(base: int, dtype: Any = np.uint8, n: int = KIB) -> dict[str, np.ndarray]:
    return {f"w{i}": np.full(n, base + i, dtype=dtype) for i in range(N)}


def _check(got: Any, want: dict[str, np.ndarray], version: int) -> None:
    assert list(got) == list(want)
    for name, t in got.items():
        a = np.from_dlpack(t)
        assert (t.version, a.dtype, a.shape) == (version, want[name].dtype, want[name].shape), name
        assert np.array_equal(a, want[name]), name


def _raw(c: Client, names: list[str], known: int) -> dict[str, Any]:
    """The broker's answer to a get_many of ``names`` naming ``known``, as it
    comes; its lease given back."""
    raw = c._core.call_now("POST", f"/v1/many/get?known={known}", {"names": names}, raw=True)
    got: dict[str, Any] = json.loads(raw)
    c._core.call_now("POST", "/v1/release", {"leases": [p[3] for p in got["packs"]]})
    return got


def test_a_batch_got_again_comes_without_its_columns(broker: BrokerProc) -> None:
    names = list(_batch(0))
    with broker.client() as producer, broker.client() as c:
        producer.put_many(_batch(0))
        _check(c.get_many(names), _batch(0), 1)
        key = c._core.known[tuple(names)].key
        short = _raw(c, names, key)
        assert (short["key"], short["names"], short["at"], short["layouts"]) == (key, [], [], [])
        assert short["versions"] == [1] * N and len(short["packs"]) == 1
        # Another key, or none: the whole columns.
        for other in (0, key + 1000):
            whole = _raw(c, names, other)
            assert (whole["key"], whole["names"]) == (key, names), other

        for version in (2, 3):  # the same layout again: answered short, read right
            producer.put_many(_batch(10 * version))
            _check(c.get_many(names), _batch(10 * version), version)
        assert c._core.known[tuple(names)].key == key

        # A new layout under the same names: whole columns, a new key.
        wide = _batch(40, np.float64, 64)
        producer.put_many(wide)
        _check(c.get_many(names), wide, 4)
        assert c._core.known[tuple(names)].key != key
        _check(c.get_many(names), wide, 4)
        # Other names, or the same in another order: their own columns.
        _check(c.get_many(names[::-1]), {n: wide[n] for n in names[::-1]}, 4)
        _check(c.get_many(names[:5]), {n: wide[n] for n in names[:5]}, 4)
    drained(broker, "leases")


def test_a_key_from_another_run_of_the_broker_is_never_sent(broker: BrokerProc) -> None:
    """Keys count from 1 in each run of the broker: the first batch of a new
    run may have the key the client kept from the old one, with another
    layout. The client names a key only to the run that gave it."""
    names = list(_batch(0))
    with broker.client() as c:
        c.put_many(_batch(0))
        _check(c.get_many(names), _batch(0), 1)
        key = c._core.known[tuple(names)].key
        broker.kill()
        broker.start()  # the same socket: a new run
        wide = _batch(50, np.float32, 256)
        c.put_many(wide)
        assert _raw(c, names, 0)["key"] == key  # the new run gave this layout the same key
        _check(c.get_many(names), wide, 1)
        _check(c.get_many(names), wide, 1)
    drained(broker, "leases")
