"""CPU per batch handoff: what a put_many -> get_many of many small tensors
costs the broker, the producer and the consumer (the consumer reads every
tensor), from /proc/<pid>/stat over many handoffs, with the wall time.

    python tests/bench/handoff_cpu.py [--tensors 1000] [--nbytes 1024]
        [--handoffs 200] [--out FILE] [--shm-prefix P] [--registry [--reps 7]]

It starts its own broker (``tensordepot serve`` on a socket of its own) and a
consumer process; the producer is this process.  Each handoff: the producer
puts the batch (a new version of every name), the consumer gets it with
``newer_than`` and reads a byte of every tensor, then says so.  Issue 43's
goal: broker <= 2 ms and consumer <= 3 ms per 1,000-tensor handoff.

``--registry`` measures the broker's registry alone for the same handoff,
without HTTP: it makes a ``Broker`` in this process (the real one, on a
pool of its own) and drives it as the fast lane does (``try_put_many`` with
the bytes inline, ``try_get_many`` with ``newer_than``, the answer's
``_render.columns``, ``release``), with the garbage collector set as the
broker sets it, timing ``--reps`` reps of ``--handoffs``
with ``time.process_time``.  One process and no sockets: it moves by a few
percent from run to run where the three processes on two cores move by
twenty.  For comparing two versions of the registry, alternated.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import multiprocessing as mp
import os
import statistics
import subprocess
import sys
import tempfile
import time
from multiprocessing.connection import Connection
from typing import Any

import _procs
import numpy as np

WARMUP = 5
TICK = os.sysconf("SC_CLK_TCK")


def cpu(pid: int | str = "self") -> float:
    """Seconds of CPU (user + system) the process has used."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def consumer(url: str, names: list[str], handoffs: int, conn: Connection) -> None:
    from tensordepot import Client

    with Client(url) as c:
        conn.send("ready")
        floor, t0 = 0, cpu()
        for k in range(WARMUP + handoffs):
            if k == WARMUP:
                t0 = cpu()
            got = c.get_many(names, newer_than=floor, timeout=30)
            total = sum(int(np.from_dlpack(t)[0]) for t in got.values())
            floor = got[names[0]].version
            del got
            conn.send(total)
        conn.send(cpu() - t0)


def run(tensors: int, nbytes: int, handoffs: int, prefix: str) -> dict[str, Any]:
    from tensordepot import Client

    with tempfile.TemporaryDirectory() as d:
        url = f"unix://{d}/broker.sock"
        broker = subprocess.Popen(
            [sys.executable, "-m", "tensordepot", "serve", "--listen", url, "--shm-prefix", prefix],
            stderr=subprocess.DEVNULL,
        )
        try:
            subprocess.run(
                [sys.executable, "-m", "tensordepot", "wait", "--url", url, "--timeout", "30"],
                check=True,
                capture_output=True,
            )
            names = [f"t{i}" for i in range(tensors)]
            batches = [
                {n: np.full(nbytes, (k + i) % 251, dtype=np.uint8) for i, n in enumerate(names)}
                for k in range(2)
            ]
            ctx = mp.get_context("spawn")
            here, there = ctx.Pipe()
            p = ctx.Process(target=consumer, args=(url, names, handoffs, there))
            p.start()
            assert here.recv() == "ready"
            with Client(url) as c:
                t0, b0, w0 = cpu(), cpu(broker.pid), time.perf_counter()
                for k in range(WARMUP + handoffs):
                    if k == WARMUP:
                        t0, b0, w0 = cpu(), cpu(broker.pid), time.perf_counter()
                    c.put_many(batches[k % 2])
                    here.recv()
                t1, b1, w1 = cpu(), cpu(broker.pid), time.perf_counter()
                consumed = here.recv()
            p.join(30)
        finally:
            broker.terminate()
            broker.wait(30)
    ms = 1e3 / handoffs
    return {
        "tensors": tensors,
        "nbytes": nbytes,
        "handoffs": handoffs,
        "wall_ms": (w1 - w0) * ms,
        "broker_cpu_ms": (b1 - b0) * ms,
        "producer_cpu_ms": (t1 - t0) * ms,
        "consumer_cpu_ms": consumed * ms,
    }


def run_registry(
    tensors: int, nbytes: int, handoffs: int, reps: int, prefix: str
) -> dict[str, Any]:
    """``--registry``: the broker's registry alone, in this process (module doc)."""
    from tensordepot._wire import ManyAlloc
    from tensordepot.service import Broker
    from tensordepot.service._http._render import columns
    from tensordepot.service._http._server import YOUNG_OBJECTS
    from tensordepot.service._registry._records import number_of
    from tensordepot.service._registry._sessions import Caller
    from tensordepot.shm._pool import Pool

    gc.collect()  # the collector as the broker keeps it (``Server.startup``)
    gc.freeze()
    gc.set_threshold(YOUNG_OBJECTS, *gc.get_threshold()[1:])
    need = 4 * tensors * max(nbytes, 256)  # two versions of the batch, and room
    broker = Broker(Pool(prefix, max_memory=max(need, 64 << 20), prefault=False))
    loop = asyncio.new_event_loop()
    try:
        producer, consumer = Caller("uid:0", 1), Caller("uid:0", 2)
        ps = broker.open_session(producer).session
        cs = broker.open_session(consumer).session
        names = [f"t{i}" for i in range(tensors)]
        req = ManyAlloc(names=names, shapes=[[nbytes]] * tensors, dtypes=["uint8"] * tensors)
        data = [memoryview(np.full(tensors * nbytes, k, np.uint8).tobytes()) for k in (1, 2)]
        floor = 0

        def handoff(k: int) -> None:
            nonlocal floor
            body = data[k % 2]
            if broker.try_put_many(ps, producer, req, body) is None:
                loop.run_until_complete(broker.put_many(ps, producer, req, body))
            got = broker.try_get_many(cs, consumer, names, floor)
            assert got is not None and len(got) == tensors
            floor = number_of(got[0][0])
            columns(broker, got, "ready")
            broker.release(cs, consumer, sorted({lease for _, lease in got if lease is not None}))

        for k in range(max(5, handoffs // 10)):  # warm: both versions' memory placed
            handoff(k)
        per: list[float] = []
        for _ in range(reps):
            t0 = time.process_time()
            for k in range(handoffs):
                handoff(k)
            per.append((time.process_time() - t0) / handoffs * 1e3)
        stat = broker.stat()
        assert stat.leases == 0, stat
    finally:
        broker.close()
        loop.close()
    return {
        "tensors": tensors,
        "nbytes": nbytes,
        "handoffs": handoffs,
        "reps": reps,
        "registry_cpu_ms": statistics.median(per),
        "samples_ms": per,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tensors", type=int, default=1000)
    ap.add_argument("--nbytes", type=int, default=1024)
    ap.add_argument("--handoffs", type=int, default=200)
    ap.add_argument(
        "--registry",
        action="store_true",
        help="the broker's registry alone, in this process, without HTTP (module doc)",
    )
    ap.add_argument("--reps", type=int, default=7, help="--registry: timed reps of --handoffs")
    _procs.side_args(ap, "tdcpu")
    a = ap.parse_args()
    if a.registry:
        result = run_registry(a.tensors, a.nbytes, a.handoffs, a.reps, a.shm_prefix)
    else:
        result = run(a.tensors, a.nbytes, a.handoffs, a.shm_prefix)
    _procs.emit(result, a.out)


if __name__ == "__main__":
    main()
