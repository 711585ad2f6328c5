"""Tensors and clients across processes the torch way, against a real broker:
a DataLoader whose Dataset keeps the parent's Client (workers started with
fork, spawn and forkserver) hands SharedTensors back to the main process,
and a torch.multiprocessing Queue carries SharedTensors and a Client to a
spawned process.  Every tensor arrives zero copy (its bytes are mapped from
one of the broker's segments), and nothing is left: no session, no lease, no
/dev/shm entry (the broker fixture checks the last two at teardown)."""

from __future__ import annotations

import pickle
from typing import Any

import numpy as np
import pytest
import torch
import torch.multiprocessing as tmp
from _harness import BrokerProc, in_segment, wait_for
from tensordepot import AsyncClient, Client, InvalidRequest, SharedTensor, TensorNotFound


def address_of(t: SharedTensor) -> int:
    return int(np.from_dlpack(t).ctypes.data)


class Named(torch.utils.data.Dataset[Any]):
    """What a Dataset over broker tensors looks like: the parent's Client and
    the names; each item is the SharedTensor itself (its pickle names it)."""

    def __init__(self, client: Client, names: list[str], prefix: str) -> None:
        self.client, self.names, self.prefix = client, names, prefix

    def __len__(self) -> int:
        return len(self.names)

    def __getitem__(self, i: int) -> tuple[SharedTensor, bool]:
        t = self.client.get(self.names[i])
        return t, in_segment(address_of(t), self.prefix)


def keep(batch: list[Any]) -> list[Any]:
    """collate_fn: the items as they are (SharedTensors do not stack)."""
    return batch


# jax, once another test imported it, warns at every fork (it runs threads); the
# Client is made for fork, so the warning is not this test's.
@pytest.mark.filterwarnings(r"ignore:os\.fork\(\) was called:RuntimeWarning")
@pytest.mark.parametrize("method", ["fork", "spawn", "forkserver"])
def test_a_dataloader_hands_shared_tensors_back_zero_copy(broker: BrokerProc, method: str) -> None:
    with broker.client() as c:
        names = [f"sample/{i}" for i in range(6)]
        c.put_many({n: np.full(1024, i, np.float32) for i, n in enumerate(names)})
        loader = torch.utils.data.DataLoader(
            Named(c, names, broker.prefix),
            batch_size=2,
            num_workers=2,
            multiprocessing_context=method,
            collate_fn=keep,
        )
        seen = []
        for batch in loader:
            for t, worker_zero_copy in batch:
                assert isinstance(t, SharedTensor) and worker_zero_copy, (t, method)
                assert in_segment(address_of(t), broker.prefix), t
                seen.append((t.name, float(np.from_dlpack(t)[0])))
                del t
            del batch
        del loader
        assert sorted(seen) == [(n, float(i)) for i, n in enumerate(names)]
        wait_for(
            lambda: c.stat().sessions == 1 and c.stat().leases == 0,
            30,
            what="the workers' sessions and every lease to end",
        )
        c.delete(prefix="sample/")


def _receiver(q: Any, back: Any, prefix: str) -> None:
    """A spawned process: reads what arrives, answers with what it found."""
    client, tensors, theirs = q.get()
    out = {
        "client": type(client).__name__,
        "read": {t.name: float(np.from_dlpack(t).sum()) for t in tensors},
        "zero_copy": all(in_segment(address_of(t), prefix) for t in tensors),
        "torch_copy_ok": float(theirs.sum()),
        "torch_zero_copy": in_segment(theirs.untyped_storage().data_ptr(), prefix),
    }
    client.put("from-child", np.arange(3, dtype=np.float32))  # the client works there too
    back.put("read")
    older = q.get()  # an older version, which its sender still holds
    out["older"] = (older.version, float(np.from_dlpack(older).sum()))
    del older
    try:
        pickle.loads(q.get())  # an older version nobody holds any more
    except TensorNotFound as exc:
        out["stale"] = str(exc)
    back.put(out)
    del tensors, theirs
    client.close()


def test_a_torch_queue_carries_shared_tensors_and_a_client(broker: BrokerProc) -> None:
    ctx = tmp.get_context("spawn")
    q, back = ctx.Queue(), ctx.Queue()
    with broker.client() as c:
        c.put_many({"w": np.ones(256, np.float32), "b": np.full(8, 2.0, np.float32)})
        got = c.get_many(["w", "b"])
        torch_view = torch.from_dlpack(got["w"])  # torch's own tensor: torch copies it
        p = ctx.Process(target=_receiver, args=(q, back, broker.prefix))
        p.start()
        q.put((c, list(got.values()), torch_view))
        old = c.get("b")
        assert back.get(timeout=120) == "read"
        c.put("b", np.zeros(8, np.float32))  # v2: the v1 sent next is no longer the newest
        q.put(old)  # ...but this process holds it: the child gets v1
        c.put("g", np.ones(4, np.float32))
        gone = c.get("g")
        blob = pickle.dumps(gone)
        del gone
        c.put("g", np.zeros(4, np.float32))  # v2, and nothing holds v1 any more
        wait_for(lambda: c.list(prefix="g")[0].readers == 0, 30, what="g v1 to be let go")
        q.put(blob)
        out = back.get(timeout=120)
        p.join(60)
        assert p.exitcode == 0
        assert out["client"] == "Client"
        assert out["read"] == {"w": 256.0, "b": 16.0} and out["zero_copy"], out
        assert out["torch_copy_ok"] == 256.0 and not out["torch_zero_copy"], out
        assert out["older"] == (1, 16.0), out
        assert "'g' v1, is gone from the broker" in out["stale"], out
        assert "the broker has v2 now" in out["stale"], out
        assert np.from_dlpack(c.get("from-child")).tolist() == [0.0, 1.0, 2.0]
        del got, torch_view, old
        wait_for(
            lambda: c.stat().sessions == 1 and c.stat().leases == 0,
            30,
            what="the child's session and every lease to end",
        )
        c.delete_many(["w", "b", "g", "from-child"])


def test_pickles_name_what_they_carry_and_refuse_what_they_cannot(broker: BrokerProc) -> None:
    with broker.client() as c:
        c.put("x", np.arange(4, dtype=np.float32))
        t = c.get("x")
        again = pickle.loads(pickle.dumps(t))  # in this process: through this very client
        assert again is not t and again.version == t.version
        assert address_of(again) != 0 and np.from_dlpack(again).tolist() == [0, 1, 2, 3]
        assert c.stat().leases == 2  # a lease of its own
        fresh = pickle.loads(pickle.dumps(c))
        assert isinstance(fresh, Client) and fresh is not c and fresh.url == c.url
        assert fresh.stat().tensors == 1  # its session opens on its first call
        fresh.close()
        afresh = pickle.loads(pickle.dumps(AsyncClient(broker.url)))
        assert isinstance(afresh, AsyncClient)
        w = c.empty("y", (2,), "float32")
        with pytest.raises(InvalidRequest, match="publish"):
            pickle.dumps(w)
        w.publish()
        c.delete("x")
        blob = pickle.dumps(t)
        kept = pickle.loads(blob)  # deleted, but held here: that version still lives
        assert np.from_dlpack(kept).tolist() == [0, 1, 2, 3]
        del t, again, kept
        wait_for(lambda: c.stat().leases == 1, 10, what="x's leases to go")  # w's hold stays
        with pytest.raises(TensorNotFound, match="'x' v1, is gone from the broker"):
            pickle.loads(blob)
        del w
        c.delete("y")
        wait_for(lambda: c.stat().leases == 0, 10, what="the leases to go")


@pytest.mark.parametrize("how", ["get", "get_many"])
def test_a_pickle_from_before_a_broker_restart_never_names_the_new_tensor(
    broker: BrokerProc, how: str
) -> None:
    """Versions start again at 1 in a new broker: the pickle of the old ``w``
    v1 must not unpickle as the new ``w`` v1."""
    with broker.client() as c:
        c.put("w", np.ones(4, np.int64))
        t = c.get("w") if how == "get" else c.get_many(["w"])["w"]
        blob = pickle.dumps(t)
        del t
        broker.stop()
        broker.start()  # a new run on the same socket
        assert c.put("w", np.full(4, 666, np.int64)) == 1  # v1 again, another tensor
        with pytest.raises(TensorNotFound, match="restarted"):
            pickle.loads(blob)
        fresh = c.get("w")
        assert pickle.loads(pickle.dumps(fresh)).version == 1  # the new run's pickles work
        del fresh
        c.delete("w")
        wait_for(lambda: c.stat().leases == 0, 10, what="the leases to go")


def _drain(q: Any, back: Any, n: int) -> None:
    """A spawned process: reads ``n`` SharedTensors off ``q``, answers what each held."""
    seen = []
    for _ in range(n):
        try:
            t = q.get()
        except TensorNotFound as exc:
            seen.append(("lost", str(exc)))
            continue
        seen.append((t.version, float(np.from_dlpack(t)[0])))
        del t
    back.put(seen)


def test_a_queue_of_200_tensors_loses_none_while_new_versions_are_published(
    broker: BrokerProc,
) -> None:
    """The sender holds what it sent, as with torch.multiprocessing: each
    arrives, though a newer version of its name was published right after."""
    ctx = tmp.get_context("spawn")
    q, back = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=_drain, args=(q, back, 200))
    p.start()
    with broker.client() as c:
        sent = []
        for i in range(200):
            c.put("step", np.full(16, i, np.float32))
            t = c.get("step")
            q.put(t)
            sent.append(t)  # held until the receiver is done
        seen = back.get(timeout=120)
        p.join(60)
        assert p.exitcode == 0
        assert seen == [(i + 1, float(i)) for i in range(200)], [x for x in seen if x[0] == "lost"]
        del sent, t
        wait_for(
            lambda: c.stat().leases == 0 and c.stat().sessions == 1,
            30,
            what="every lease and the child's session to end",
        )
        assert c.stat().versions == 1
        with pytest.raises(TensorNotFound, match="'step' v3 is not kept"):
            c.get("step", version=3)
        assert c.get("step", version=200).version == 200
        with pytest.raises(InvalidRequest, match="names one version"):
            c.get("step", 1.0, version=200)
        c.delete("step")
