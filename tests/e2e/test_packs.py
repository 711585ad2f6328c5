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
from tensordepot import TensorNotFound

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
