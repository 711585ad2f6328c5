"""tensordepot against what users would pick instead, interleaved in one run.

    python tests/bench/peers.py [--quick] [--out bench-results/peers.json]
    python tests/bench/peers.py --report bench-results/peers.json   # the README table
    python tests/bench/peers.py --cases 1000x1KiB,gets1   # some cases only (development)

``tests/bench/run.py`` runs it as its step B10.  Every case hands data from
a producer to a consumer in another process, and the consumer reads every
byte before it answers; a handoff is timed from the producer's first step
(its copy into the system) to that answer.

Systems (each handoff gets memory of its own, as a tensordepot version does):

* ``tensordepot``: ``put`` / ``put_many``; the consumer waits in ``get`` /
  ``get_many(newer_than=...)``;
* ``ray``: ``ray.put``, and an actor's ``ray.get`` of the reference (when
  ``ray`` is installed: ``pip install -e '.[bench]'``);
* ``shm_pipe``: a new ``multiprocessing.shared_memory`` segment per handoff,
  its name sent through a Pipe;
* ``torch_mp``: a new shared torch tensor per handoff, through a
  ``torch.multiprocessing`` Queue (when torch is installed);
* ``pipe_pickle``: the array pickled through a Pipe.

Cases: handoffs of 4 KiB, 1 MiB, 64 MiB and 1 GiB; a state dict (B4's, 300
tensors), to one consumer and to two; 1,000 tensors of 1 KiB; and 256 MiB
read by 1, 2, 4 and 8 consumers at once, where a handoff ends with the last
consumer's answer.  Rates: 1 and 4 client processes get the same published
4 KiB tensor over and over, each get read whole (tensordepot ``get``; Ray's
``ray.get`` in an actor; a request over a Pipe to a process that holds it,
answered with the segment's name, the shared torch tensor, or the pickle),
as gets per second of all clients together.

Each repetition runs every system once, in an order that rotates from one
repetition to the next, so drift on this shared machine hits all alike.  A
repetition's figure is the median of its handoffs; the report gives the
median over repetitions with min and max.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import pickle
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
for _p in (str(HERE), str(HERE.parent)):
    if _p not in sys.path:
        sys.path.insert(0, _p)

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
# Every /dev/shm name this run makes starts with this (children inherit it):
# a test of the run looks at its own names only, never at other programs'.
SHM_ENV = "TENSORDEPOT_PEERS_SHM_PREFIX"


def _shm_name() -> str:
    import os
    import secrets

    return os.environ.get(SHM_ENV, "tdpeers-") + secrets.token_hex(8)


SYSTEMS = ("tensordepot", "ray", "shm_pipe", "torch_mp", "pipe_pickle")
OWN_MEMORY = ("shm_pipe", "torch_mp", "pipe_pickle")  # the peers that give each handoff its own


def cases(quick: bool) -> list[dict[str, Any]]:
    """Each case: id, what, ``sizes`` (its arrays' bytes), ``per`` (handoffs per
    repetition), ``consumers`` (1 unless given) and ``reps`` (the run's unless given)."""
    if quick:
        return [
            {"id": "4KiB", "what": "4 KiB handoff", "sizes": [4 * KiB], "per": 10},
            {"id": "8MiB", "what": "8 MiB handoff", "sizes": [8 * MiB], "per": 3},
            {"id": "200x1KiB", "what": "200 tensors of 1 KiB", "sizes": [KiB] * 200, "per": 3},
            {
                "id": "fanout2",
                "what": "8 MiB read by 2 consumers at once",
                "sizes": [8 * MiB],
                "per": 2,
                "consumers": 2,
            },
        ]
    # B4's state dict: 100 weights of 640 x 1024 and 200 vectors of 7,680 float32
    state_dict = [640 * 1024 * 4, 7680 * 4, 7680 * 4] * 100
    return [
        {"id": "4KiB", "what": "4 KiB handoff", "sizes": [4 * KiB], "per": 50},
        {"id": "1MiB", "what": "1 MiB handoff", "sizes": [MiB], "per": 20},
        {"id": "64MiB", "what": "64 MiB handoff", "sizes": [64 * MiB], "per": 5},
        {"id": "1GiB", "what": "1 GiB handoff", "sizes": [GiB], "per": 1},
        {
            "id": "state_dict",
            "what": "state dict, 300 tensors, 262 MiB",
            "sizes": state_dict,
            "per": 3,
        },
        {
            "id": "state_dict_x2",
            "what": "the next state dict to 2 consumers",
            "sizes": state_dict,
            "per": 3,
            "consumers": 2,
        },
        {"id": "1000x1KiB", "what": "1,000 tensors of 1 KiB", "sizes": [KiB] * 1000, "per": 10},
    ] + [
        # 5 repetitions: a Pipe sends 256 MiB to each consumer in turn, seconds per handoff
        {
            "id": f"fanout{k}",
            "what": f"256 MiB read by {k} consumer{'s' * (k > 1)} at once (5 repetitions)",
            "sizes": [256 * MiB],
            "per": 1,
            "consumers": k,
            "reps": 5,
        }
        for k in (1, 2, 4, 8)
    ]


def read_all(arrays: list[Any]) -> tuple[int, int]:
    """Every byte read: (the first word of the first array, the sum of all words)."""
    total = 0
    for a in arrays:
        total += int(np.asarray(a).view(np.uint64).sum(dtype=np.uint64))
    return int(np.asarray(arrays[0]).view(np.uint64)[0]), total % (1 << 64)


def _names(n: int) -> list[str]:
    return ["t"] if n == 1 else [f"layer.{i}" for i in range(n)]


# -- consumers (each in its own process) ---------------------------------------------------


def _consume_tensordepot(url: str, n: int, ack: Any) -> None:
    from tensordepot import Client

    names = _names(n)
    with Client(url) as c:
        ack.send("ready")
        last: dict[str, int] = dict.fromkeys(names, 0)
        while True:
            if n == 1:
                got = {"t": c.get("t", timeout=120, newer_than=last["t"])}
            else:
                got = c.get_many(names, timeout=120, newer_than=last)
            last = {k: t.version for k, t in got.items()}
            if got[names[0]].shape == (1,):
                ack.send("done")
                return
            ack.send(read_all([np.from_dlpack(got[k]) for k in names]))
            del got


def _consume_pipe(data: Any, shm: bool, ack: Any) -> None:
    from multiprocessing import shared_memory

    ack.send("ready")
    while True:
        msg = pickle.loads(data.recv_bytes())
        if msg is None:
            return
        if not shm:
            ack.send(read_all(msg if isinstance(msg, list) else [msg]))
            del msg
            continue
        name, layout = msg
        s = shared_memory.SharedMemory(name)
        views = [np.ndarray((nb // 8,), np.uint64, s.buf, off) for off, nb in layout]
        out = read_all(views)
        del views
        s.close()
        ack.send(out)


def _consume_torch(q: Any, ack: Any) -> None:
    ack.send("ready")
    while True:
        msg = q.get()
        if msg is None:
            return
        ack.send(read_all([t.numpy() for t in msg]))
        del msg


def rate_cases(quick: bool) -> list[dict[str, Any]]:
    """Each rate case: id, what, ``nbytes`` (the tensor's), ``per`` (gets per
    client per repetition) and ``clients``."""
    ks, per = ((1, 2), 100) if quick else ((1, 4), 1000)
    return [
        {
            "id": f"gets{k}",
            "what": f"small gets/s, {k} client{'s' * (k > 1)}",
            "nbytes": 4 * KiB,
            "per": per,
            "clients": k,
        }
        for k in ks
    ]


def _getter(system: str, where: Any, ctrl: Any) -> None:
    """One client: on each ``m`` from ``ctrl``, ``m`` gets, each read whole,
    then the first get's answer back.  ``where``: the broker's URL, or a
    Pipe to the process that holds the tensor."""
    if system == "tensordepot":
        from tensordepot import Client

        c = Client(where)

        def get() -> tuple[int, int]:
            t = c.get(RATE_NAME)
            return read_all([np.from_dlpack(t)])
    else:
        from multiprocessing import shared_memory

        if system == "torch_mp":
            import torch.multiprocessing  # noqa: F401  (its reductions: a tensor's memory is sent)

        def get() -> tuple[int, int]:
            where.send_bytes(b"")
            msg = where.recv()
            if system == "pipe_pickle":
                return read_all([msg])
            if system == "torch_mp":
                return read_all([msg.numpy()])
            s = shared_memory.SharedMemory(msg)
            v = np.ndarray((s.size // 8,), np.uint64, s.buf)
            out = read_all([v])
            del v
            s.close()
            return out

    ctrl.send("ready")
    while (m := ctrl.recv()) is not None:
        first = get()
        for _ in range(m - 1):
            get()
        ctrl.send(first)


def _holder(system: str, a: np.ndarray, conns: list[Any], ack: Any) -> None:
    """The process that holds the tensor and answers each request on ``conns``
    with what its ``system`` sends; it ends when every client has gone."""
    from multiprocessing import connection, shared_memory

    s = None
    if system == "torch_mp":
        import torch
        import torch.multiprocessing  # its reductions: the payload is sent as shared memory

        payload: Any = torch.from_numpy(a.copy()).share_memory_()
    elif system == "shm_pipe":
        s = shared_memory.SharedMemory(_shm_name(), create=True, size=a.nbytes)
        np.ndarray(a.shape, a.dtype, s.buf)[:] = a
        payload = s.name
    else:
        payload = a
    ack.send("ready")
    live = list(conns)
    try:
        while live:
            for c in connection.wait(live):
                try:
                    c.recv_bytes()
                    c.send(payload)
                except (EOFError, OSError):
                    live.remove(c)
    finally:
        if s is not None:
            s.close()
            s.unlink()


RATE_NAME = "bench.small"


class Getters:
    """``k`` client processes of one system and, for the Pipe peers, the
    process that answers them; ``round(m)`` lets each make ``m`` gets."""

    def __init__(self, ctx: Any, system: str, k: int, url: str, a: np.ndarray) -> None:
        self.holder = None
        if system == "torch_mp":
            import torch.multiprocessing as tmp

            ctx = tmp.get_context("spawn")
        wheres: list[Any] = [url] * k
        if system != "tensordepot":
            pairs = [ctx.Pipe() for _ in range(k)]
            wheres = [theirs for _, theirs in pairs]
            self.holder = _Peer(ctx, 1, _holder, lambda i: (system, a, [m for m, _ in pairs]))
            for m, _ in pairs:
                m.close()
        self.peer = _Peer(ctx, k, _getter, lambda i: (system, wheres[i]))
        for w in wheres:
            if w is not url:
                w.close()

    def round(self, m: int) -> list[Any]:
        for a in self.peer.acks:
            a.send(m)
        return self.peer.answers()

    def close(self) -> None:
        for a in self.peer.acks:
            a.send(None)
        self.peer.close()
        if self.holder is not None:
            self.holder.close()


class RayGetters:
    """``k`` actors, each ``ray.get``-ing the same reference ``m`` times."""

    def __init__(self, ray: Any, k: int, a: np.ndarray) -> None:
        self.ray = ray

        class Getter:  # defined here, so that Ray ships it by value
            def run(self, refs: list[Any], m: int) -> Any:
                import numpy as np
                import ray as r

                out = None
                for _ in range(m):
                    got = r.get(refs[0])
                    v = got.view(np.uint64)
                    answer = (int(v[0]), int(v.sum(dtype=np.uint64)) % (1 << 64))
                    out = out or answer
                    del got, v
                return out

        self.ref = ray.put(a)
        self.actors = [ray.remote(num_cpus=0)(Getter).remote() for _ in range(k)]

    def round(self, m: int) -> list[Any]:
        return list(self.ray.get([g.run.remote([self.ref], m) for g in self.actors]))

    def close(self) -> None:
        for g in self.actors:
            self.ray.kill(g)
        del self.ref


# -- producers: one handoff each, timed from the first copy to the last answer -------------


class _Peer:
    """One system's consumers (``k`` processes) and its handoff (``send``,
    which returns every consumer's answer)."""

    def __init__(
        self, ctx: Any, k: int, target: Callable[..., None], args: Callable[[int], tuple[Any, ...]]
    ) -> None:
        self.acks, self.procs = [], []
        for i in range(k):
            mine, theirs = ctx.Pipe()
            p = ctx.Process(target=target, args=(*args(i), theirs), daemon=True)
            p.start()
            theirs.close()
            self.acks.append(mine)
            self.procs.append(p)
        for a in self.acks:
            if not a.poll(120) or a.recv() != "ready":
                raise RuntimeError(f"{target.__name__} did not start")

    def answers(self) -> list[Any]:
        out = []
        for a in self.acks:
            if not a.poll(300):
                raise RuntimeError("a consumer did not answer within 300 s")
            out.append(a.recv())
        return out

    def close(self) -> None:
        for p in self.procs:
            p.join(30)
            if p.is_alive():
                p.kill()


class Depot(_Peer):
    """Every consumer waits for the next version of the same names."""

    def __init__(self, ctx: Any, k: int, url: str, n: int) -> None:
        from tensordepot import Client

        self.c = Client(url)
        self.names = _names(n)
        super().__init__(ctx, k, _consume_tensordepot, lambda i: (url, n))

    def send(self, arrays: list[np.ndarray]) -> list[Any]:
        if len(arrays) == 1:
            self.c.put("t", arrays[0])
        else:
            self.c.put_many(dict(zip(self.names, arrays, strict=True)))
        return self.answers()

    def close(self) -> None:
        end = np.zeros(1, np.uint8)
        if len(self.names) == 1:
            self.c.put("t", end)
        else:
            self.c.put_many(dict.fromkeys(self.names, end))
        self.answers()
        super().close()
        for k in self.names:
            self.c.delete(k)
        self.c.close()


class PipePeer(_Peer):
    """A Pipe to each consumer: the pickle (made once, sent to each), or the
    name of a new shared_memory segment that all of them map."""

    def __init__(self, ctx: Any, k: int, shm: bool) -> None:
        self.data: list[Any] = []
        self.shm = shm

        def args(i: int) -> tuple[Any, ...]:
            mine, theirs = ctx.Pipe()
            self.data.append(mine)
            return (theirs, shm)

        super().__init__(ctx, k, _consume_pipe, args)

    def send(self, arrays: list[np.ndarray]) -> list[Any]:
        if not self.shm:
            blob = pickle.dumps(arrays[0] if len(arrays) == 1 else arrays, protocol=5)
            for d in self.data:
                d.send_bytes(blob)
            return self.answers()
        from multiprocessing import shared_memory

        total = sum(a.nbytes for a in arrays)
        s = shared_memory.SharedMemory(_shm_name(), create=True, size=total)
        try:
            layout, off = [], 0
            for a in arrays:
                np.ndarray((a.nbytes,), np.uint8, s.buf, off)[:] = a.view(np.uint8)
                layout.append((off, a.nbytes))
                off += a.nbytes
            for d in self.data:
                d.send((s.name, layout))
            return self.answers()
        finally:
            s.close()
            s.unlink()

    def close(self) -> None:
        for d in self.data:
            d.send_bytes(pickle.dumps(None))
        super().close()


class TorchPeer(_Peer):
    """New shared tensors, put on each consumer's Queue."""

    def __init__(self, ctx: Any, k: int) -> None:
        import torch.multiprocessing as tmp

        self.torch = __import__("torch")
        tctx = tmp.get_context("spawn")
        self.qs = [tctx.Queue() for _ in range(k)]
        super().__init__(tctx, k, _consume_torch, lambda i: (self.qs[i],))

    def send(self, arrays: list[np.ndarray]) -> list[Any]:
        torch = self.torch
        out = []
        for a in arrays:
            t = torch.empty(a.shape, dtype=torch.float32).share_memory_()
            t.copy_(torch.from_numpy(a))
            out.append(t)
        for q in self.qs:
            q.put(out)
        return self.answers()

    def close(self) -> None:
        for q in self.qs:
            q.put(None)
        super().close()


class RayPeer:
    """``ray.put``, then each consumer actor's ``ray.get`` of the reference."""

    def __init__(self, ray: Any, k: int) -> None:
        self.ray = ray

        class Reader:  # defined here, so that Ray ships it by value
            def read(self, refs: list[Any]) -> Any:
                import numpy as np
                import ray as r

                got = r.get(refs[0])
                arrays = got if isinstance(got, list) else [got]
                total = 0
                for a in arrays:
                    total += int(a.view(np.uint64).sum(dtype=np.uint64))
                first = int(arrays[0].view(np.uint64)[0])
                del got, arrays
                return first, total % (1 << 64)

        # num_cpus=0: actors that wait on ray.get need no CPU reserved, so 8 fit on 2 cores.
        self.actors = [ray.remote(num_cpus=0)(Reader).remote() for _ in range(k)]
        warm = ray.put(np.zeros(8, np.uint8))
        ray.get([a.read.remote([warm]) for a in self.actors])

    def send(self, arrays: list[np.ndarray]) -> list[Any]:
        ref = self.ray.put(arrays[0] if len(arrays) == 1 else arrays)
        out = self.ray.get([a.read.remote([ref]) for a in self.actors])
        del ref
        return list(out)

    def close(self) -> None:
        for a in self.actors:
            self.ray.kill(a)


def start_ray(quick: bool) -> Any:
    try:
        import ray
    except ImportError:
        return None
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        log_to_driver=False,
        object_store_memory=(512 * MiB if quick else 4 * GiB),
        configure_logging=False,
    )
    return ray


def _source(sizes: list[int]) -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    out = []
    for nb in sizes:
        a = rng.integers(0, 1 << 30, nb // 4, dtype=np.int64).astype(np.float32)
        out.append(a)
    return out


def run(
    url: str,
    quick: bool,
    systems: tuple[str, ...] = SYSTEMS,
    reps: int | None = None,
    log: Callable[[str], None] = print,
    only: set[str] | None = None,
) -> dict[str, Any]:
    """Every case (or those whose ids are in ``only``), every system,
    interleaved; the result as JSON-able data."""
    import _procs

    _procs.settle_malloc()  # each case meets the peers at their best, whatever ran before
    ctx = mp.get_context("spawn")
    reps = reps or (3 if quick else 11)
    ray = start_ray(quick) if "ray" in systems else None
    try:
        import torch  # noqa: F401

        have_torch = True
    except ImportError:
        have_torch = False
    skipped = {}
    if ray is None and "ray" in systems:
        skipped["ray"] = "ray is not installed (pip install -e '.[bench]')"
    if not have_torch and "torch_mp" in systems:
        skipped["torch_mp"] = "torch is not installed"
    active = [s for s in systems if s not in skipped]
    out: dict[str, Any] = {"reps": reps, "systems": active, "skipped": skipped, "cases": {}}
    try:
        for case in cases(quick):
            if only is not None and case["id"] not in only:
                continue
            arrays = _source(case["sizes"])
            peers: dict[str, Any] = {}
            try:
                k = case.get("consumers", 1)
                for s in active:
                    peers[s] = (
                        Depot(ctx, k, url, len(arrays))
                        if s == "tensordepot"
                        else RayPeer(ray, k)
                        if s == "ray"
                        else PipePeer(ctx, k, shm=True)
                        if s == "shm_pipe"
                        else TorchPeer(ctx, k)
                        if s == "torch_mp"
                        else PipePeer(ctx, k, shm=False)
                    )
                samples: dict[str, list[float]] = {s: [] for s in active}
                for _ in range(2):  # warm every path
                    for s in active:
                        peers[s].send(arrays)
                n_reps = case.get("reps", reps)
                for r in range(n_reps):
                    order = active[r % len(active) :] + active[: r % len(active)]
                    for s in order:
                        times = []
                        for i in range(case["per"]):
                            arrays[0].view(np.uint64)[0] = i + 1  # each handoff is new data
                            want = read_all(arrays) if i == 0 else None
                            t0 = time.perf_counter()
                            got = peers[s].send(arrays)
                            times.append(time.perf_counter() - t0)
                            if want is not None and any(tuple(g) != want for g in got):
                                raise AssertionError(
                                    f"{s}, {case['id']}: the consumers read {got}, not {want}"
                                )
                        samples[s].append(statistics.median(times))
                row = {}
                for s, xs in samples.items():
                    ms = [x * 1e3 for x in xs]
                    row[s] = {
                        "label": f"{s}, {case['what']}",
                        "unit": "ms",
                        "median": statistics.median(ms),
                        "min": min(ms),
                        "max": max(ms),
                        "samples": ms,
                        "n": len(ms),
                    }
                out["cases"][case["id"]] = {
                    "what": case["what"],
                    "per": case["per"],
                    "reps": n_reps,
                    "consumers": k,
                    "nbytes": sum(case["sizes"]),
                    "systems": row,
                }
                log(
                    f"  {case['id']}: "
                    + ", ".join(f"{s} {v['median']:.3g} ms" for s, v in row.items())
                )
            finally:
                for p in peers.values():
                    p.close()
        for case in rate_cases(quick):
            if only is not None and case["id"] not in only:
                continue
            out["cases"][case["id"]] = _rates(case, ctx, url, ray, active, reps, log)
    finally:
        if ray is not None:
            ray.shutdown()
    return out


def _rates(
    case: dict[str, Any],
    ctx: Any,
    url: str,
    ray: Any,
    active: list[str],
    reps: int,
    log: Callable[[str], None],
) -> dict[str, Any]:
    """One rate case: every system's clients, interleaved as the handoffs are."""
    from tensordepot import Client

    a = _source([case["nbytes"]])[0]
    want = read_all([a])
    k = case["clients"]
    getters: dict[str, Any] = {}
    with Client(url) as c:
        c.put(RATE_NAME, a)
        try:
            for s in active:
                getters[s] = RayGetters(ray, k, a) if s == "ray" else Getters(ctx, s, k, url, a)
            for s in active:  # warm every path
                getters[s].round(20)
            samples: dict[str, list[float]] = {s: [] for s in active}
            for r in range(reps):
                for s in active[r % len(active) :] + active[: r % len(active)]:
                    t0 = time.perf_counter()
                    got = getters[s].round(case["per"])
                    samples[s].append(k * case["per"] / (time.perf_counter() - t0))
                    if any(tuple(g) != want for g in got):
                        raise AssertionError(
                            f"{s}, {case['id']}: the clients read {got}, not {want}"
                        )
        finally:
            for g in getters.values():
                g.close()
            c.delete(RATE_NAME)
    row = {
        s: {
            "label": f"{s}, {case['what']}",
            "unit": "gets/s",
            "median": statistics.median(xs),
            "min": min(xs),
            "max": max(xs),
            "samples": xs,
            "n": len(xs),
        }
        for s, xs in samples.items()
    }
    log(f"  {case['id']}: " + ", ".join(f"{s} {v['median']:,.0f}/s" for s, v in row.items()))
    return {
        "what": case["what"],
        "per": case["per"],
        "reps": reps,
        "consumers": k,
        "nbytes": case["nbytes"],
        "rate": True,
        "systems": row,
    }


def ratios(case: dict[str, Any]) -> dict[str, float | None]:
    """tensordepot's time over Ray's and over that of the best peer that
    gives each handoff memory of its own (for a rate: theirs over ours)."""
    row = case["systems"]
    ours = row["tensordepot"]["median"]
    ray = row.get("ray", {}).get("median")
    own = best_own(case)

    def over(theirs: float) -> float:
        return theirs / ours if case.get("rate") else ours / theirs

    return {
        "vs_ray": over(ray) if ray else None,
        "vs_best_own": over(row[own]["median"]) if own else None,
    }


def _ms(x: float) -> str:
    return f"{x:,.0f}" if x >= 100 else f"{x:.3g}"


def best_own(case: dict[str, Any]) -> str | None:
    """The fastest peer that gives each handoff memory of its own."""
    own = [s for s in OWN_MEMORY if s in case["systems"]]
    pick = max if case.get("rate") else min
    return pick(own, key=lambda s: case["systems"][s]["median"]) if own else None


def table(result: dict[str, Any]) -> str:
    """The README table: medians (min to max) per case and system."""
    systems = result["systems"]
    head = "| case | " + " | ".join(systems) + " | vs Ray | vs best own-memory peer |"
    lines = [head, "|" + "---|" * (len(systems) + 3)]
    for case in result["cases"].values():
        cells = []
        for s in systems:
            v = case["systems"][s]
            unit = "/s" if case.get("rate") else " ms"
            cells.append(f"{_ms(v['median'])}{unit} ({_ms(v['min'])} to {_ms(v['max'])})")
        r = ratios(case)
        shown = [f"{x:.2f}×" if x is not None else "—" for x in (r["vs_ray"], r["vs_best_own"])]
        lines.append(f"| {case['what']} | " + " | ".join(cells) + f" | {shown[0]} | {shown[1]} |")
    if any(c.get("rate") for c in result["cases"].values()):
        lines += [
            "",
            "A ratio is tensordepot's time over the peer's; for a rate, the peer's "
            "rate over tensordepot's (its time per get over the peer's).",
        ]
    if result["skipped"]:
        lines.append("")
        skipped = result["skipped"].items()
        lines.append("Not measured: " + "; ".join(f"{k}: {v}" for k, v in skipped))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="small sizes, 3 repetitions")
    ap.add_argument("--out", default="bench-results/peers.json")
    ap.add_argument("--systems", default=",".join(SYSTEMS))
    ap.add_argument("--reps", type=int)
    ap.add_argument(
        "--cases",
        help="comma-separated case ids, e.g. 1000x1KiB,gets1 (for development; a partial table)",
    )
    ap.add_argument("--report", metavar="JSON", help="print the table of a result and stop")
    args = ap.parse_args(argv)
    if args.report:
        data = json.loads(Path(args.report).read_text())
        print(table(data.get("benchmarks", {}).get("B10", data)))
        return 0
    from _harness import BrokerProc

    only = None if args.cases is None else set(args.cases.split(","))
    if only is not None:
        known = {c["id"] for c in cases(args.quick) + rate_cases(args.quick)}
        if not only <= known:
            ap.error(f"unknown case ids {sorted(only - known)}; the cases: {sorted(known)}")
    import os

    prefix = os.environ.setdefault(SHM_ENV, f"tdpeers-{os.getpid()}-")
    broker = BrokerProc(
        "--max-memory",
        "8GiB",
        "--warm-memory",
        "6GiB",
        max_memory="8GiB",
        prefix=prefix + "broker-",
    )
    try:
        result = run(broker.url, args.quick, tuple(args.systems.split(",")), args.reps, only=only)
    finally:
        broker.cleanup()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(table(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
