"""Packs (service/_registry/_packs.py): a put_many's small tensors share one
block, allocated once and freed once, when the last version in it goes.  What
must hold: each name still lives and dies on its own for its readers, and the
broker counts what a pack keeps (its bytes in use) until it goes."""

from __future__ import annotations

import os
import signal
from collections.abc import Callable

import numpy as np
import pytest
from _harness import BrokerProc, drained, stat_when
from _workerio import Worker
from tensordepot import TensorMap, TensorNotFound, TensorReleased

KIB = 1024


def _batch(n: int, base: int = 0, prefix: str = "w") -> dict[str, np.ndarray]:
    return {f"{prefix}{i}": np.full(KIB, base + i, dtype=np.uint8) for i in range(n)}


def test_a_packs_memory_goes_with_its_last_name(broker: BrokerProc) -> None:
    """Names deleted one by one: the pack stays whole (and counted) while any
    of its versions lives, the last one held by a lease past its delete."""
    sd = _batch(20)
    with broker.client() as c:
        c.put_many(sd)
        assert c.stat().bytes_in_use == 20 * KIB
        for i in range(19):
            c.delete(f"w{i}")
            assert c.stat().bytes_in_use == 20 * KIB, f"after deleting w{i}"
            assert np.all(np.from_dlpack(c.get("w19")) == 19)
        last = c.get("w19")
        c.delete("w19")
        st = c.stat()
        assert (st.tensors, st.bytes_in_use) == (0, 20 * KIB), "a lease keeps the pack"
        assert np.all(np.from_dlpack(last) == 19)
        del last
        drained(c, "leases", "bytes_in_use")


def test_a_put_of_one_name_of_a_pack_leaves_the_others_alone(broker: BrokerProc) -> None:
    sd = _batch(10)
    with broker.client() as c:
        assert c.put_many(sd) == dict.fromkeys(sd, 1)
        assert c.put("w3", np.full(KIB, 99, dtype=np.uint8)) == 2
        got = c.get_many(list(sd))
        for name, t in got.items():
            want = 99 if name == "w3" else int(name[1:])
            assert t.version == (2 if name == "w3" else 1), name
            assert np.all(np.from_dlpack(t) == want), name
        # w3's first version stays in its pack, counted, until the pack goes.
        assert c.stat().bytes_in_use == 11 * KIB
        del got, t
        c.put_many(_batch(10, 50))  # every name again: the first pack goes
        stat_when(c, lambda st: st.bytes_in_use == 10 * KIB and st.leases == 0, "one pack left")


def test_a_reader_of_one_tensor_keeps_its_pack_while_every_name_is_replaced(
    broker: BrokerProc,
) -> None:
    sd = _batch(10)
    with broker.client() as producer, broker.client() as reader:
        producer.put_many(sd)
        held = reader.get("w3")
        for round_ in range(1, 4):
            assert producer.put_many(_batch(10, 10 * round_)) == dict.fromkeys(sd, round_ + 1)
            # The newest pack and the first one, which the reader's lease keeps whole.
            assert producer.stat().bytes_in_use == 20 * KIB, round_
            assert held.version == 1 and np.all(np.from_dlpack(held) == 3)
        now = reader.get_many(list(sd))
        assert all(np.all(np.from_dlpack(t) == 30 + int(n[1:])) for n, t in now.items())
        del now, held
        drained(reader, "leases")
        stat_when(producer, lambda st: st.bytes_in_use == 10 * KIB, "only the newest pack")


def test_a_get_many_of_a_pack_holds_one_lease_that_a_sigkill_gives_back(
    broker: BrokerProc, workers: Callable[..., Worker]
) -> None:
    """A consumer that get_many's a pack's 20 tensors holds one lease, which
    keeps the whole pack through the producer's deletes; SIGKILLed, its
    session is reaped and the pack goes."""
    sd = _batch(20, prefix="p")
    with broker.client() as c:
        c.put_many(sd)
        h = workers("lifetime_holder", broker.url, ready="ready")
        h.send("many p 20")
        assert h.expect("got many") == "got many 20"
        assert c.stat().leases == 1, "one lease for the pack"
        c.delete_many(list(sd))
        assert c.stat().bytes_in_use == 20 * KIB, "the lease keeps the pack"
        h.send("check")
        assert h.expect("ok") == "ok 20"
        os.kill(h.pid, signal.SIGKILL)
        drained(c, "leases", "bytes_in_use", sessions=1)


def test_a_tensor_of_a_pack_lease_links_by_its_name(broker: BrokerProc) -> None:
    """put(name, t) of a tensor got in a batch shares its bytes (no copy): the
    link names which of the pack lease's tensors it means."""
    with broker.client() as c:
        c.put_many(_batch(5))
        got = c.get_many([f"w{i}" for i in range(5)])
        lease = got["w2"]._lease_id()
        assert lease is not None and got["w3"]._lease_id() == lease, "one lease for the pack"
        with pytest.raises(TensorNotFound, match="name the one to link"):
            c._call("POST", "/v1/link", {"name": "alias", "lease": lease}, rid=c._rid())
        assert c.put("alias", got["w2"]) == 1
        assert np.all(np.from_dlpack(c.get("alias")) == 2)
        assert c.stat().bytes_in_use == 5 * KIB, "the alias shares w2's bytes"
        del got
        c.delete_many(["alias", *(f"w{i}" for i in range(5))])
        drained(c, "leases", "bytes_in_use")


def test_rows_a_get_many_holds_are_got_by_version_after_a_put_or_a_delete(
    broker: BrokerProc,
) -> None:
    """A pack's names point at its rows (no version object each): a row
    replaced by a later put_many or deleted while a get_many's lease holds
    its pack is still got by its exact version (as a pickle's receiver gets
    it), with the bytes it had, and counted, until that lease ends."""
    sd = _batch(4)
    with broker.client() as c, broker.client() as other:
        c.put_many(sd)
        held = c.get_many(list(sd))
        assert c.stat().leases == 1
        assert c.put_many(_batch(2, 50)) == {"w0": 2, "w1": 2}
        c.delete("w2")
        st = c.stat()
        assert (st.tensors, st.versions, st.bytes_in_use) == (3, 6, 6 * KIB)
        for _ in range(2):  # a version of its own each time: the row stays kept
            for name in ("w0", "w1", "w2"):
                again = other.get(name, version=1)
                assert np.all(np.from_dlpack(again) == int(name[1:])), name
                del again
            stat_when(c, lambda st: st.leases == 1, "the gets by version to be released")
        assert np.all(np.from_dlpack(held["w0"]) == 0)
        del held
        stat_when(c, lambda st: (st.leases, st.versions) == (0, 3), "the kept rows to go")
        assert c.stat().bytes_in_use == 6 * KIB, "w3 keeps the first pack (not its kept rows)"
        for name in ("w0", "w2"):
            with pytest.raises(TensorNotFound, match="is not kept"):
                other.get(name, version=1)
        assert np.all(np.from_dlpack(other.get("w3")) == 3)
        c.delete(prefix="w")
        drained(c, "leases", "bytes_in_use", "versions")


def test_a_torch_write_into_a_lazily_got_tensor_reaches_nothing_else(
    broker: BrokerProc, workers: Callable[..., Worker]
) -> None:
    """get_many makes each tensor when it is first read (TensorMap), all of
    one pack from one window under one lease.  A torch write into one of them
    (torch ignores the read-only flag) reaches none of its pack's other
    tensors, read before the write or made after it, no other process and no
    later get."""
    torch = pytest.importorskip("torch")
    sd = {f"p{i}": np.full(100, i, dtype=np.float32) for i in range(20)}  # 400 bytes: pages shared
    with broker.client() as c:
        c.put_many(sd)
        got = c.get_many(list(sd))
        assert isinstance(got, TensorMap) and repr(got).endswith("0 made)"), repr(got)
        x = torch.from_dlpack(got["p5"])
        before = np.from_dlpack(got["p4"])  # read before the write (out of order: made alone)
        assert repr(got).endswith("2 made)"), "reading two tensors made only those two"
        assert got["p4"]._window is got["p5"]._window, "one window for the batch"
        x.fill_(-1.0)  # its neighbours share its first and last pages
        assert float(x.sum()) == -100.0, "the write did not land in the writer's view"
        assert np.all(before == 4), "a tensor read before the write changed"
        for name, t in got.items():  # the other 17 are made now, after the write
            if name != "p5":
                assert np.all(np.from_dlpack(t) == int(name[1:])), name
        h = workers("lifetime_holder", broker.url, ready="ready")
        h.send("many p 20")  # checks every element of p<i> == i
        assert h.expect("got many") == "got many 20", "another process saw the write"
        again = c.get_many(["p5", "p6"])
        assert np.all(np.from_dlpack(again["p5"]) == 5), "a later get saw the write"
        assert np.all(np.from_dlpack(again["p6"]) == 6)
        assert float(x.sum()) == -100.0, "the writer's own view lost its write"
        del got, again, x, t, before
        h.send("exit")
        assert h.expect("bye") == "bye"
        c.delete_many(list(sd))
        drained(c, "leases", "bytes_in_use", sessions=1)


def test_a_batch_read_whole_exports_each_tensor_on_its_own(broker: BrokerProc) -> None:
    """A batch's tensors of one layout, read together (``values()``), are
    exported from the rows of one array (``Views``): each export is its own
    tensor (its bytes, shape and dtype, read-only in numpy), a torch write
    into one reaches none of the others nor a later get, and the last export
    left keeps the pack's lease after the map and its tensors are gone."""
    torch = pytest.importorskip("torch")
    sd: dict[str, np.ndarray] = {f"p{i}": np.full(100, i, dtype=np.float32) for i in range(20)}
    sd["s"] = np.array(7, dtype=np.int64)
    sd["m"] = np.arange(6, dtype=np.int16).reshape(2, 3)
    sd |= {f"q{i}": np.full((2, 3), i, dtype=np.int16) for i in range(3)}
    with broker.client() as c:
        c.put_many(sd)
        got = c.get_many(list(sd))
        ts = list(got.values())
        xs = [torch.from_dlpack(t) for t in ts]
        p0, p19 = ts[0]._views, ts[19]._views
        assert p0 is p19 and p0.arrays is not None and p0.arrays[0].base is p0.arrays[19].base, (
            "p0..p19 are exported from the rows of one array"
        )
        arrays = [np.from_dlpack(t) for t in ts]
        xs[5].fill_(-1.0)
        for (name, want), x, a in zip(sd.items(), xs, arrays, strict=True):
            assert a.shape == want.shape and a.dtype == want.dtype and not a.flags.writeable
            assert tuple(x.shape) == want.shape, name
            if name != "p5":
                assert np.array_equal(a, want) and np.array_equal(x.numpy(), want), name
        assert np.all(arrays[5] == -1.0), "the write is in the writer's own pages"
        assert np.all(np.from_dlpack(c.get("p5")) == 5), "a later get saw the write"
        last = arrays[7]
        del got, ts, xs, arrays, a, x, p0, p19
        assert c.stat().leases == 1 and np.all(last == 7), "the last export keeps the lease"
        del last
        stat_when(c, lambda st: st.leases == 0, "the last export's lease given back")
        c.delete_many(list(sd))
        drained(c, "leases", "bytes_in_use")


def test_a_batchs_large_tensors_are_each_exported_on_their_own_lease(broker: BrokerProc) -> None:
    """A state dict: its large tensors (over ``PACK_MEMBER_MAX``) each in a
    block of its own under a lease of its own, its small ones in the pack.
    A large tensor is exported from its own address, owned by its own lease
    (no flat array of its window: it is alone in it): its bytes, shape and
    dtype, read-only in numpy; a torch write into one reaches no other
    tensor and no later get; its view alone keeps its lease."""
    torch = pytest.importorskip("torch")
    sd: dict[str, np.ndarray] = {}
    for i in range(3):
        sd[f"l{i}.w"] = np.full((1100, 1000), i, dtype=np.float32)  # 4.4 MB: over 4 MiB
        sd[f"l{i}.b"] = np.full(100, -i, dtype=np.float32)
    with broker.client() as c:
        c.put_many(sd)
        got = c.get_many(list(sd))
        assert c.stat().leases == 4, "a lease per large tensor, one for the pack"
        ts = dict(got)
        assert ts["l0.w"]._flats is None and ts["l0.b"]._flats is not None
        xs = {name: torch.from_dlpack(t) for name, t in ts.items()}
        arrays = {name: np.from_dlpack(t) for name, t in ts.items()}
        xs["l1.w"].fill_(-5.0)
        for name, want in sd.items():
            a = arrays[name]
            assert a.shape == want.shape and a.dtype == want.dtype and not a.flags.writeable
            assert tuple(xs[name].shape) == want.shape, name
            if name != "l1.w":
                assert np.array_equal(a, want) and np.array_equal(xs[name].numpy(), want), name
        assert np.all(arrays["l1.w"] == -5.0), "the write is in the writer's own pages"
        assert np.all(np.from_dlpack(c.get("l1.w")) == 1), "a later get saw the write"
        keep = arrays["l2.w"]
        del got, ts, xs, arrays, a
        stat_when(c, lambda st: st.leases == 1, "every lease but the kept view's given back")
        assert np.all(keep == 2), "the view keeps its tensor's bytes"
        del keep
        stat_when(c, lambda st: st.leases == 0, "the last view's lease given back")
        c.delete_many(list(sd))
        drained(c, "leases", "bytes_in_use")


def test_a_batchs_mid_size_tensors_share_packs_of_at_most_32_mib(broker: BrokerProc) -> None:
    """Tensors of up to 4 MiB share packs (per tensor, a block and a lease
    of its own cost about what copying a few MiB does), at most 32 MiB each:
    twelve 3 MiB tensors take two packs and two leases.  A put of one name
    leaves the others' bytes alone; its old row stays counted with its pack
    until every name of that pack is replaced."""
    mib = 1 << 20
    sd = {f"m{i}": np.full(3 * mib, i, dtype=np.uint8) for i in range(12)}
    with broker.client() as c:
        assert c.put_many(sd) == dict.fromkeys(sd, 1)
        got = c.get_many(list(sd))
        for name, t in got.items():
            assert np.all(np.from_dlpack(t) == int(name[1:])), name
        assert c.stat().leases == 2, "one lease per pack: ten tensors, then two"
        del got, t
        stat_when(c, lambda st: st.leases == 0, "the packs' leases given back")
        assert c.put("m0", np.full(3 * mib, 99, dtype=np.uint8)) == 2
        assert np.all(np.from_dlpack(c.get("m1")) == 1)
        assert np.all(np.from_dlpack(c.get("m0")) == 99)
        stat_when(
            c,
            lambda st: st.bytes_in_use == 13 * 3 * mib and st.leases == 0,
            "m0's old row counted with its pack",
        )
        c.put_many({f"m{i}": np.full(3 * mib, 50 + i, dtype=np.uint8) for i in range(1, 10)})
        stat_when(c, lambda st: st.bytes_in_use == 12 * 3 * mib, "the first pack gone")
        c.delete_many(list(sd))
        drained(c, "leases", "bytes_in_use")


def test_a_lazy_batch_gives_its_leases_back_with_the_map_and_on_release(
    broker: BrokerProc,
) -> None:
    """The map holds its packs' leases for the tensors not read yet: they go
    when it goes, or on ``release()`` (after which an unread name raises
    TensorReleased, and a tensor read before keeps only its own views)."""
    with broker.client() as c:
        c.put_many(_batch(10))
        names = [f"w{i}" for i in range(10)]
        got = c.get_many(names)
        assert c.stat().leases == 1
        del got  # nothing read: the lease goes with the map
        stat_when(c, lambda st: st.leases == 0, "the map's lease given back")
        got = c.get_many(names)
        view = np.from_dlpack(got["w1"])
        got.release()
        with pytest.raises(TensorReleased):
            got["w2"]
        with pytest.raises(TensorReleased):
            np.from_dlpack(got["w1"])  # released, as SharedTensor.release() does
        assert c.stat().leases == 1 and np.all(view == 1), "a view keeps the lease"
        del view
        stat_when(c, lambda st: st.leases == 0, "the last view's lease given back")
        assert dict(c.get_many(names[:2])).keys() == {"w0", "w1"}
        c.delete_many(names)
        drained(c, "leases", "bytes_in_use")


def test_a_lazy_batch_behaves_as_a_dict_of_its_tensors(broker: BrokerProc) -> None:
    """What code written for a dict of SharedTensors does with a get_many's
    answer: order, a name given twice, ``in``, ``get``, ``pop``, ``del``,
    assignment (``get_many(out=)`` puts buffers in), ``dict()``, equality,
    and a pickle, which is a dict of tensors pickled by name and version."""
    import pickle

    with broker.client() as c:
        c.put_many(_batch(6))
        got = c.get_many(["w3", "w1", "w5", "w1", "w0", "w2", "w4"])
        assert list(got) == ["w3", "w1", "w5", "w0", "w2", "w4"] and len(got) == 6
        assert "w1" in got and "w9" not in got and got.get("w9") is None
        assert np.all(np.from_dlpack(got.pop("w5")) == 5) and "w5" not in got
        del got["w0"]
        buffer = np.zeros(4)
        got["w2"] = buffer  # not a tensor: values() must not compare it
        assert [type(v).__name__ for v in got.values()] == [
            "SharedTensor",
            "SharedTensor",
            "ndarray",
            "SharedTensor",
        ]
        assert got.get("w2") is buffer and got["w1"] is got["w1"], "made once"
        plain = dict(got)
        assert list(plain) == ["w3", "w1", "w2", "w4"] and plain["w3"] is got["w3"]
        del plain["w2"], got["w2"]
        assert got == plain
        back = pickle.loads(pickle.dumps(got))
        assert type(back) is dict and list(back) == ["w3", "w1", "w4"]
        assert [(t.name, t.version) for t in back.values()] == [("w3", 1), ("w1", 1), ("w4", 1)]
        assert all(np.all(np.from_dlpack(back[n]) == int(n[1:])) for n in back)
        del got, plain, back
        c.delete(prefix="w")
        drained(c, "leases", "bytes_in_use")


def _made(got: TensorMap) -> int:
    """How many of the map's tensors are made (its repr says)."""
    return int(repr(got).rsplit(", ", 1)[1].split()[0])


def test_a_lazy_batch_read_in_order_makes_runs_of_the_names_ahead(broker: BrokerProc) -> None:
    """Names read in their order (``dict(m)``, a loop over the names) are
    made a run at a time, the run doubling while the reads stay in order:
    each is the tensor of its own name, read alone or not; a read out of
    order makes one; names deleted, assigned or given twice are skipped;
    a reader that stops early leaves most of the map unmade."""
    n = 250
    with broker.client() as c:
        c.put_many(_batch(n))
        names = [f"w{i}" for i in range(n)]

        def check(got: TensorMap, name: str) -> None:
            t = got[name]
            assert t.name == name and np.all(np.from_dlpack(t) == int(name[1:])), name

        got = c.get_many(names)
        for name in names[:5]:
            check(got, name)
        assert 5 <= _made(got) <= 8, repr(got)  # runs of 1, 2, 4: at most 8 made
        check(got, "w200")  # out of order: one more
        assert _made(got) <= 9, repr(got)
        plain = dict(got)  # in order from the start: the rest in runs
        assert list(plain) == names and _made(got) == n
        for name in names:
            check(got, name)
            assert plain[name] is got[name], "made once"
        del got, plain

        # A write through torch into a tensor made in a run reaches no other.
        torch = pytest.importorskip("torch")
        got = c.get_many(names[:64])
        first = torch.from_dlpack(got["w0"])
        first.fill_(99)
        assert all(np.all(np.from_dlpack(got[f"w{i}"]) == i) for i in range(1, 64))
        del first, got

        got = c.get_many(["w1", "w0", "w2", "w0", "w3", "w4", "w5"])  # w0 twice: its last place
        del got["w2"]
        got["w4"] = buffer = np.zeros(4)
        assert list(dict(got)) == ["w1", "w0", "w3", "w4", "w5"]
        assert got["w4"] is buffer
        for name in ("w1", "w0", "w3", "w5"):
            check(got, name)
        del got
        c.delete(prefix="w")
        drained(c, "leases", "bytes_in_use")


def test_a_batch_put_again_over_its_own_pack_moves_every_name_on(broker: BrokerProc) -> None:
    """The same batch put step after step (a state dict's names, shapes and
    dtypes: each pack placed over the one before, which is retired whole),
    with what users do between steps: nothing, a get_many that holds the
    pack, a single get (a Version of one row), a put of one name, a delete
    of one, an empty() published.  After each step every name has its next
    version and its bytes, for a get_many of the batch again (which asks
    the board first, on the lane) and, at the end, for a single get; what a
    lease holds keeps its bytes, and is got by its version; nothing stays
    once the leases go."""
    names = [f"w{i}" for i in range(50)]
    with broker.client() as c, broker.client() as r:
        want = dict.fromkeys(names, 0)
        held: list[tuple[dict[str, int], object]] = []  # (versions, a get_many) kept a while
        between = ["nothing", "hold", "nothing", "get", "nothing", "put", "delete", "empty"]
        for step, what in enumerate(["first", *between, "nothing", "nothing"]):
            if what == "hold":
                got = r.get_many(names)
                held.append(({k: t.version for k, t in got.items()}, got))
            elif what == "get":
                one = r.get("w3")
                assert one.version == want["w3"]
                del one
            elif what == "put":
                want["w5"] = c.put("w5", np.full(KIB, 7, np.uint8))
            elif what == "delete":
                c.delete("w9")
            elif what == "empty":
                t = c.empty("w11", [KIB], "uint8")
                t.publish()  # a version newer than the pack's row, then the pack again
                want["w11"] = t.version
                del t
            versions = c.put_many({n: np.full(KIB, step, np.uint8) for n in names})
            assert versions == {n: want[n] + 1 for n in names}, (step, what)
            want = versions
            got = r.get_many(names)
            assert {k: t.version for k, t in got.items()} == want, (step, what)
            assert all(np.all(np.from_dlpack(t) == step) for t in got.values()), (step, what)
            del got
        for name in ("w0", "w5", "w49"):  # (a single get makes a Version of a row: last)
            t = r.get(name)
            assert (t.version, int(np.from_dlpack(t)[0])) == (want[name], step), name
            del t
        versions_held, got = held.pop()
        for name in ("w0", "w9", "w49"):  # the held pack's rows: its bytes, by version
            assert np.all(np.from_dlpack(got[name]) == 1), name  # type: ignore[index]
            again = c.get(name, version=versions_held[name])
            assert np.all(np.from_dlpack(again) == 1), name
            del again
        del got
        drained(r, "leases")
        stat_when(c, lambda st: st.bytes_in_use == 50 * KIB, "only the newest pack")
        c.delete(prefix="w")
        drained(c, "leases", "bytes_in_use", "versions")


def test_a_list_counts_the_readers_of_a_packs_rows(broker: BrokerProc) -> None:
    """Leases of a pack's rows count as readers of their names in a list
    (any version of the name: kept rows too), alongside a single get's
    lease, and no longer once they are given back."""
    sd = _batch(6)
    with broker.client() as c, broker.client() as d:
        c.put_many(sd)
        whole = c.get_many(list(sd))  # every row of the pack: one lease
        part = d.get_many(["w1", "w4"])  # two rows of it, in another session
        one = d.get("w4")  # a get of one name: a lease of its own

        def readers() -> dict[str, int]:
            return {i.name: i.readers for i in c.list(prefix="w")}

        held = {"w0": 1, "w1": 2, "w2": 1, "w3": 1, "w4": 3, "w5": 1}
        assert readers() == held
        c.put_many(_batch(6, 10))  # every name moves on: the leased rows are kept
        assert readers() == held  # leases of any version of the name count
        assert np.all(np.from_dlpack(part["w4"]) == 4) and np.all(np.from_dlpack(one) == 4)
        got = c.get_many(["w2", "w3"])  # rows of the new pack
        assert readers() == {**held, "w2": 2, "w3": 2}
        del whole
        stat_when(c, lambda st: st.leases == 3, "the whole batch's lease given back")
        assert readers() == {"w0": 0, "w1": 1, "w2": 1, "w3": 1, "w4": 2, "w5": 0}
        del part, one, got
        stat_when(c, lambda st: st.leases == 0, "every lease given back")
        assert readers() == dict.fromkeys(sd, 0)
        c.delete(prefix="w")
        drained(c, "leases", "bytes_in_use")
