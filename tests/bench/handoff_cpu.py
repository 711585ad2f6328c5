"""CPU per batch handoff: what a put_many -> get_many of many small tensors
costs the broker, the producer and the consumer (the consumer reads every
tensor), from /proc/<pid>/stat over many handoffs, with the wall time.

    python tests/bench/handoff_cpu.py [--tensors 1000] [--nbytes 1024]
        [--handoffs 200] [--out FILE] [--shm-prefix P]

It starts its own broker (``tensordepot serve`` on a socket of its own) and a
consumer process; the producer is this process.  Each handoff: the producer
puts the batch (a new version of every name), the consumer gets it with
``newer_than`` and reads a byte of every tensor, then says so.  Issue 43's
goal: broker <= 2 ms and consumer <= 3 ms per 1,000-tensor handoff.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import subprocess
import sys
import tempfile
import time
from multiprocessing.connection import Connection
from typing import Any

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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tensors", type=int, default=1000)
    ap.add_argument("--nbytes", type=int, default=1024)
    ap.add_argument("--handoffs", type=int, default=200)
    ap.add_argument("--out", help="write the result here as JSON too")
    ap.add_argument(
        "--shm-prefix",
        default=f"tdcpu-{os.getpid()}-",
        help="segment prefix of the broker this run starts",
    )
    a = ap.parse_args()
    result = run(a.tensors, a.nbytes, a.handoffs, a.shm_prefix)
    text = json.dumps(result, indent=2)
    print(text)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
