"""put_many and get_many with a real broker: columns on the wire, one reader
window per segment per get_many, and what that must not change: every
tensor's bytes, copy-on-write reads (README, Lifetime: M2), leases, and
get_many waiting for newer versions."""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import pytest
from _harness import BrokerProc, wait_for
from tensordepot import InvalidRequest, InvalidType, TensorNotFound


@pytest.mark.parametrize("big", [True, False], ids=["copied-into-place", "carried-inline"])
def test_put_many_and_get_many_keep_every_tensor(broker: BrokerProc, big: bool) -> None:
    """With ``big`` the batch is allocated and copied into place; without,
    its bytes ride in the request, C-contiguous arrays joined as they are
    and the others as their C-ordered copies."""
    torch = pytest.importorskip("torch")
    sd = {
        "f32": np.arange(1000, dtype=np.float32),
        "i64": np.arange(12, dtype=np.int64).reshape(3, 4),
        "strided": np.arange(40, dtype=np.float64)[::3],  # not contiguous
        "fortran": np.asfortranarray(np.arange(6, dtype=np.int16).reshape(2, 3)),
        "empty": np.zeros((0, 5), dtype=np.float32),
        "scalar": np.float64(2.5),
        "int32": np.array([1, 2, 3], dtype=np.int32),  # a Python list needs a dtype: test_name_ops
        "torch": torch.arange(7, dtype=torch.float32),
        "bf16": torch.arange(5, dtype=torch.bfloat16),
        "big": np.full(9 << 20, 7, dtype=np.uint8),  # a block of its own, copied by threads
    }
    if not big:
        del sd["big"]
    with broker.client() as c:
        versions = c.put_many(sd)
        assert versions == dict.fromkeys(sd, 1)
        got = c.get_many(list(sd))
        for name, x in sd.items():
            t = got[name]
            want = x.float().numpy() if name == "bf16" else np.asarray(x)
            have = torch.from_dlpack(t).float().numpy() if name == "bf16" else np.from_dlpack(t)
            assert have.shape == want.shape and np.array_equal(have, want), name
            assert (t.version, t.shape) == (1, want.shape), name
        assert got["bf16"].dtype == "bfloat16" and got["scalar"].shape == ()
        # One lease for the small tensors' pack, one for "big" (a block of its own).
        assert c.stat().leases == (2 if big else 1)
        del got, t, have
        wait_for(lambda: c.stat().leases == 0, 10, what="the batch's leases to be released")


def test_a_batch_shares_one_window_per_segment(broker: BrokerProc) -> None:
    sd = {f"w{i}": np.full(300, i, dtype=np.float32) for i in range(50)}
    with broker.client() as c:
        c.put_many(sd)
        got = c.get_many(list(sd))
        windows = {id(t._window) for t in got.values()}
        segments = {t._window.name for t in got.values()}
        assert len(windows) == len(segments) == 1, "one mapping per segment per batch"
        single = c.get("w0")
        assert single._window is not got["w0"]._window, "a get maps its own window"
        del got, single


def test_a_stray_write_stays_in_its_tensor(broker: BrokerProc) -> None:
    """Copy-on-write reads with a shared window: a write through one tensor of a
    batch (torch ignores the read-only flag) changes neither its neighbours in
    the batch, nor the same name read again, nor what another process reads."""
    torch = pytest.importorskip("torch")
    sd = {f"w{i}": np.full(100, i, dtype=np.float32) for i in range(8)}  # 400 bytes: shared pages
    with broker.client() as c, broker.client() as other:
        c.put_many(sd)
        got = c.get_many(list(sd))
        x = torch.from_dlpack(got["w3"])
        x.fill_(-1.0)  # the whole tensor: its neighbours share its first and last pages
        assert float(x.sum()) == -100.0, "the write did not land in the writer's view"
        for name, t in got.items():
            if name != "w3":
                assert np.all(np.from_dlpack(t) == int(name[1:])), name
        again = c.get_many(["w3", "w4"])
        assert np.all(np.from_dlpack(again["w3"]) == 3) and np.all(np.from_dlpack(again["w4"]) == 4)
        assert np.all(np.from_dlpack(other.get("w3")) == 3)
        del got, again, x, t


def test_names_of_the_same_bytes_are_views_of_the_same_bytes(broker: BrokerProc) -> None:
    """A name and its alias come back from one get_many as one tie: a write
    through one shows through the other, and in nothing else (a later get,
    another process, a neighbour)."""
    torch = pytest.importorskip("torch")
    with broker.client() as c, broker.client() as other:
        c.put("w", np.arange(64, dtype=np.float32))
        c.put("alias", c.get("w"))  # the same bytes under a second name
        c.put("other", np.arange(64, dtype=np.float32))
        got = c.get_many(["w", "alias", "other"])
        assert got["w"]._address == got["alias"]._address != got["other"]._address
        torch.from_dlpack(got["w"]).fill_(5.0)
        assert np.all(np.from_dlpack(got["alias"]) == 5.0), "the tie is kept"
        want = np.arange(64, dtype=np.float32)
        assert np.array_equal(np.from_dlpack(got["other"]), want)
        assert np.array_equal(np.from_dlpack(c.get("alias")), want), "a later get sees no write"
        assert np.array_equal(np.from_dlpack(other.get("w")), want)
        del got
        wait_for(lambda: c.stat().leases == 0, 10, what="the leases to be released")


def test_get_many_waits_for_newer_versions(broker: BrokerProc) -> None:
    with broker.client() as c, broker.client() as producer:
        producer.put_many({"a": np.zeros(3, np.float32), "b": np.zeros(3, np.float32)})
        first = c.get_many(["a", "b"])
        seen = {n: t.version for n, t in first.items()}
        del first
        got: list[dict[str, int]] = []

        def read() -> None:
            batch = c.get_many(["a", "b"], timeout=30, newer_than=seen)
            got.append({n: t.version for n, t in batch.items()})

        th = threading.Thread(target=read)
        th.start()
        wait_for(lambda: producer.stat().waiting == 1, 10, what="get_many to wait")
        producer.put_many({"a": np.ones(3, np.float32), "b": np.ones(3, np.float32)})
        th.join(30)
        assert got == [{"a": 2, "b": 2}]
        assert c.get_many(["a", "b"], newer_than=1)["a"].version == 2
        with pytest.raises(TensorNotFound):
            c.get_many(["a", "b"], newer_than={"a": 2})
        with pytest.raises(InvalidType, match="newer_than"):
            c.get_many(["a"], newer_than="1")  # type: ignore[arg-type]
        with pytest.raises(InvalidRequest, match="newer_than"):
            c.get_many(["a"], newer_than={"a": -1})
        with pytest.raises(InvalidType, match=r"newer_than\['a'\] must be an int"):
            c.get_many(["a"], newer_than={"a": True})
        with pytest.raises(InvalidRequest, match="names does not: 'zz'"):
            c.get_many(["a"], newer_than={"a": 1, "zz": 1})
        with pytest.raises(InvalidType, match="1 is not a name"):
            c.get_many(["a"], newer_than={1: 1})  # type: ignore[dict-item]
        assert c.get_many(["a"], newer_than={"a": None})["a"].version == 2  # None: any
        wait_for(lambda: c.stat().leases == 0, 10, what="the leases to be released")


def test_get_many_keeps_what_it_found_while_it_waits_for_the_rest(broker: BrokerProc) -> None:
    """A get_many that waits for one name leases the others as it finds them:
    replaced meanwhile (their memory free to reuse), the versions it found
    come back whole."""
    with broker.client() as c, broker.client() as producer:
        producer.put_many({"a": np.full(1000, 1.0, np.float32), "b": np.zeros(3, np.float32)})
        got: list[dict[str, Any]] = []

        def read() -> None:
            batch = c.get_many(["a", "b"], timeout=30, newer_than={"b": 1})
            got.append({n: (t.version, np.from_dlpack(t).copy()) for n, t in batch.items()})

        th = threading.Thread(target=read)
        th.start()
        wait_for(lambda: producer.stat().waiting == 1, 10, what="get_many to wait for b")
        for i in range(4):  # a's first version is no longer current: these would take its bytes
            producer.put("a", np.full(1000, 2.0 + i, np.float32))
        producer.put("b", np.ones(3, np.float32))
        th.join(30)
        (va, a), (vb, b) = got[0]["a"], got[0]["b"]
        assert (va, vb) == (1, 2)
        assert (a == 1.0).all(), f"the version get_many found first changed: {a[:4]}"
        assert (b == 1.0).all()
        producer.delete_many(["a", "b"])
        wait_for(
            lambda: c.stat().leases == 0 and c.stat().bytes_in_use == 0,
            10,
            what="the leases and bytes to be given back",
        )


def test_batches_larger_than_one_request_are_split(broker: BrokerProc, tmp_path: Any) -> None:
    """One request carries at most 10,000 names: put_many, get_many and
    load_file send larger batches as several, tied tensors kept together
    (each tied name is a view of its source's bytes), under one deadline."""
    n = 10_050
    tensors = {f"big/{i:05d}": np.full(4, i, np.int32) for i in range(n)}
    tied = tensors["big/09999"]
    tensors["big/10040"] = tied  # tied across the boundary of the first request
    with broker.client() as c:
        versions = c.put_many(tensors)
        assert list(versions) == list(tensors) and set(versions.values()) == {1}
        stored = c.stat().bytes_in_use
        c.put("probe", np.zeros(4, np.int32))
        each = c.stat().bytes_in_use - stored  # one block of 16 bytes
        assert stored == (n - 1) * each, "the tie was stored twice"
        c.delete("probe")
        got = c.get_many(list(tensors))
        assert list(got) == list(tensors)
        assert all(int(np.from_dlpack(got[k])[0]) == int(v[0]) for k, v in tensors.items())
        with pytest.raises(InvalidRequest, match="at most 10000 names"):
            c.get_many(list(tensors), wait="any")
        with pytest.raises(TensorNotFound):  # one name of the last request is missing
            c.get_many([*tensors, "big/missing"], timeout=0.05)
        del got
        file = tmp_path / "many.safetensors"
        assert c.save_file("big/", file) == 4 * 4 * (n + 0)
        c.delete(prefix="big/")
        assert len(c.load_file(file, "again/")) == n
        assert len(c.list(prefix="again/")) == n
        c.delete(prefix="again/")
        wait_for(lambda: c.stat().leases == 0, 10, what="the leases to be released")
    broker.check_clean()
