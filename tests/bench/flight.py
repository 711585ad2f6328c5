"""Benchmarks across hosts: F1 and F2, against their peers, in one run.

    python tests/bench/flight.py [--quick] [--out bench-results/flight.json]

It starts two brokers on this machine: A serves Arrow Flight on loopback, B
pulls from A (``--peer``, ``--peer-refresh 0``).  Every repetition publishes
a new version on A, so every get on B pulls it again.

* **F1.** A get on B of a version only A holds: the metadata call, the
  Flight stream over loopback, the copy into B's shared memory and the
  publish, as a consumer sees it.  Its peer: the same number of bytes over
  a plain TCP socket between two processes of the same run, ``sendall``
  from a pre-faulted shared buffer into ``recv_into`` a pre-faulted shared
  buffer.  Goal: at least 0.5x the socket's throughput.
* **F2.** Consumers on B get a version only A holds and read it: a zero-copy
  view, and one byte of every 4 KiB page (every page is touched, no byte is
  copied).  The wall time for 8 consumers at once, from the go signal to
  the last one done, against the same for one consumer.  Goal: at most 1.2x
  (one transfer, then zero copy).

Medians of several repetitions, after warm-up repetitions that let both
brokers' pools create their segments.  ``--quick`` uses 64 MiB and fewer
repetitions, so CI can run it; its ratios mean little.
"""

from __future__ import annotations

import argparse
import json
import mmap
import multiprocessing as mp
import secrets
import socket
import sys
import time
from dataclasses import dataclass, replace
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
for _p in (str(HERE), str(HERE.parent)):
    if _p not in sys.path:
        sys.path.insert(0, _p)

import numpy as np
import run as suite  # the B-suite's helpers: series, check, machine, versions, teardown
from _harness import BrokerProc, wait_for
from _hosts import flight_url
from tensordepot import Client

MiB, GiB = 1 << 20, 1 << 30
PAGE = 4096
# Why a goal was missed, found by profiling (perf on both brokers during a 1 GiB pull).
REASONS = {
    "F1": "CPU-bound on 2 shared cores: per GiB the pulling broker spends ~0.95 s of CPU (perf: "
    "41% in two user-space copies, Arrow Flight's copy of each multi-slice gRPC message into "
    "one buffer and then ours into shared memory; 22% in the kernel's receive copy) and the "
    "serving broker ~0.4 s, against ~0.5 s of kernel copies for the socket; exploratory "
    "pulls at load below 2 took 0.78-1.1 s per GiB against 0.55-0.6 s for the socket "
    "(0.5-0.7x), so the other users' load on the same cores decides the verdict",
    "F2": "The consumers' own reads, not a second transfer (the pull happens once: "
    "test_eight_consumers_on_another_host_share_one_transfer): touching every page of a "
    "fresh 1 GiB mapping takes one process 115-121 ms (16,385 minor faults with the "
    "kernel's fault-around), so 8 consumers add about 0.8 s of CPU on the 2 cores the "
    "brokers also use; runs gave 1.04x, 1.2x and 1.31x",
}


@dataclass(frozen=True)
class Config:
    mode: str
    nbytes: int
    reps: int
    warm: int
    consumers: int = 8
    max_memory: str = "6GiB"


FULL = Config("full", nbytes=GiB, reps=5, warm=2)
QUICK = replace(FULL, mode="quick", nbytes=64 * MiB, reps=2, warm=1, consumers=4, max_memory="1GiB")


# -- children (spawned: a fresh interpreter each) ------------------------------------


def _prefaulted(nbytes: int, fill: int) -> mmap.mmap:
    """Shared anonymous memory (shmem pages, as /dev/shm), every page allocated."""
    buf = mmap.mmap(-1, nbytes)
    np.frombuffer(buf, np.uint8)[:] = fill
    return buf


def tcp_receiver(nbytes: int, reps: int, conn: Connection) -> None:
    buf = _prefaulted(nbytes, 0)
    view = memoryview(buf)
    with socket.create_server(("127.0.0.1", 0)) as ls:
        conn.send(ls.getsockname()[1])
        for _ in range(reps):
            s, _ = ls.accept()
            with s:
                got = 0
                while got < nbytes:
                    n = s.recv_into(view[got:], nbytes - got)
                    if not n:
                        raise ConnectionError("the sender closed early")
                    got += n
                conn.send(time.monotonic())
    view.release()
    buf.close()


def tcp_sender(nbytes: int, reps: int, port: int, conn: Connection) -> None:
    buf = _prefaulted(nbytes, 1)
    conn.send("ready")
    for _ in range(reps):
        conn.recv()
        start = time.monotonic()
        with socket.create_connection(("127.0.0.1", port)) as s:
            s.sendall(buf)
            conn.send(start)
    buf.close()


def consumer(url: str, name: str, conn: Connection) -> None:
    """Per "go": get ``name`` (B may pull it), read one byte per page, say when done."""
    with Client(url) as c:
        conn.send("ready")
        while conn.recv() == "go":
            t = c.get(name, timeout=120)
            view = np.from_dlpack(t).view(np.uint8)
            total = int(view[::PAGE].sum())
            done = time.monotonic()
            del view, t
            conn.send((done, total))


# -- the benchmarks --------------------------------------------------------------------


def tcp_baseline(cfg: Config) -> list[float]:
    ctx = mp.get_context("spawn")
    reps = cfg.warm + cfg.reps
    r_conn, r_child = ctx.Pipe()
    s_conn, s_child = ctx.Pipe()
    receiver = ctx.Process(target=tcp_receiver, args=(cfg.nbytes, reps, r_child), daemon=True)
    receiver.start()
    port = r_conn.recv()
    sender = ctx.Process(target=tcp_sender, args=(cfg.nbytes, reps, port, s_child), daemon=True)
    sender.start()
    assert s_conn.recv() == "ready"
    times = []
    for i in range(reps):
        s_conn.send("go")
        start = s_conn.recv()
        end = r_conn.recv()
        if i >= cfg.warm:
            times.append(end - start)
    for p in (sender, receiver):
        p.join(60)
    return times


def publish(a: Client, name: str, x: np.ndarray, i: int) -> None:
    x[:8] = np.frombuffer(i.to_bytes(8, "little"), np.uint8)  # each version differs
    a.put(name, x)


def drained(b: BrokerProc) -> None:
    """Until B's readers let go, so the replica they held can be reused warm."""
    wait_for(lambda: b.stat().leases == 0, 30, what="B's leases to drain")


def bench_f1(
    cfg: Config, a: BrokerProc, b: BrokerProc, x: np.ndarray
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    flight = []
    with a.client() as ca, b.client() as cb:
        for i in range(cfg.warm + cfg.reps):
            publish(ca, "f1", x, i)
            start = time.monotonic()
            t = cb.get("f1")
            took = time.monotonic() - start
            assert int(np.from_dlpack(t).view(np.uint8)[0]) == i % 256
            del t
            drained(b)
            if i >= cfg.warm:
                flight.append(took)
    tcp = tcp_baseline(cfg)
    size = suite.human(cfg.nbytes)
    data = {
        "flight_pull": suite.series(
            f"get on B pulling {size} from A over loopback Flight", flight, "ms", 1e3
        ),
        "tcp": suite.series(
            f"plain TCP sendall/recv_into of {size} between two processes", tcp, "ms", 1e3
        ),
    }
    ratio = suite.median(tcp) / suite.median(flight)
    gbps = {k: cfg.nbytes / (v["median"] / 1e3) / 1e9 for k, v in data.items()}
    note = f"{gbps['flight_pull']:.2f} GB/s against {gbps['tcp']:.2f} GB/s"
    rows = [
        suite.check(
            "F1",
            "F1",
            f"fetch {size} from a peer: Flight pull throughput / plain TCP socket",
            data["flight_pull"],
            data["tcp"],
            ratio,
            ">=",
            0.5,
            note=note,
        )
    ]
    return data, rows


def bench_f2(
    cfg: Config, a: BrokerProc, b: BrokerProc, x: np.ndarray
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    ctx = mp.get_context("spawn")
    pipes, procs = [], []
    for _ in range(cfg.consumers):
        parent, child = ctx.Pipe()
        p = ctx.Process(target=consumer, args=(b.url, "f2", child), daemon=True)
        p.start()
        pipes.append(parent)
        procs.append(p)
    for conn in pipes:
        assert conn.recv() == "ready"
    runs: dict[int, list[float]] = {1: [], cfg.consumers: []}
    try:
        with a.client() as ca:
            i = 0
            for rep in range(cfg.warm + cfg.reps):
                for n, samples in runs.items():  # alternate, so drift hits both alike
                    publish(ca, "f2", x, i)
                    i += 1
                    start = time.monotonic()
                    for conn in pipes[:n]:
                        conn.send("go")
                    ends = [conn.recv()[0] for conn in pipes[:n]]
                    drained(b)
                    if rep >= cfg.warm:
                        samples.append(max(ends) - start)
    finally:
        for conn in pipes:
            conn.send("stop")
        for p in procs:
            p.join(60)
    size = suite.human(cfg.nbytes)
    n = cfg.consumers
    data = {
        "one": suite.series(
            f"1 consumer on B: get (pull {size}) + read every page", runs[1], "ms", 1e3
        ),
        "many": suite.series(
            f"{n} consumers on B at once: get + read every page", runs[n], "ms", 1e3
        ),
    }
    ratio = suite.median(runs[n]) / suite.median(runs[1])
    rows = [
        suite.check(
            "F2",
            "F2",
            f"{n} consumers on the pulling host / 1 consumer: wall time",
            data["many"],
            data["one"],
            ratio,
            "<=",
            1.2,
            note="one transfer per version, then zero-copy reads",
        )
    ]
    return data, rows


def markdown(result: dict[str, Any]) -> str:
    """The README's table for this run."""
    return suite.table(
        result,
        f"pyarrow {result['versions'].get('pyarrow')}",
        after=" (other users' work on the same 2 cores)",
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="64 MiB and few repetitions (CI)")
    ap.add_argument("--out", default="bench-results/flight.json", help="where to write the JSON")
    ap.add_argument("--shm-prefix", help="segment prefix of the brokers this run starts")
    ap.add_argument("--report", metavar="JSON", help="print the README table of an earlier run")
    args = ap.parse_args(argv)
    if args.report:
        done = json.loads(Path(args.report).read_text())
        for row in done["checks"]:  # reasons found since the run
            if row["pass"] is False:
                row["reason"] = suite.reason_for(row, done["mode"], REASONS) or row["reason"]
        print(markdown(done))
        return 0
    cfg = QUICK if args.quick else FULL
    prefix = args.shm_prefix or f"tdbench-{secrets.token_hex(4)}-"
    started = time.monotonic()
    result = suite.head("flight.py", cfg.mode, args.out, cfg, pyarrow=suite._version("pyarrow"))
    common = [
        "--max-memory",
        cfg.max_memory,
        "--warm-memory",
        cfg.max_memory,
        "--reap-interval",
        "0.5",
    ]
    brokers: list[BrokerProc] = []
    benches: dict[str, Any] = {}
    checks: list[dict[str, Any]] = []
    # Flight, like every TCP listener, needs a token; both brokers use the same one.
    env = {"TENSORDEPOT_TOKEN": secrets.token_urlsafe(24)}
    try:
        a = BrokerProc(
            *common,
            "--flight",
            "grpc://127.0.0.1:0",
            max_memory=cfg.max_memory,
            prefix=f"{prefix}a-",
            env=env,
        )
        brokers.append(a)
        b = BrokerProc(
            *common,
            "--peer",
            flight_url(a),
            "--peer-refresh",
            "0",
            max_memory=cfg.max_memory,
            prefix=f"{prefix}b-",
            env=env,
        )
        brokers.append(b)
        x = np.ones(cfg.nbytes, np.uint8)
        for name, fn in (("F1", bench_f1), ("F2", bench_f2)):
            print(f"[{time.monotonic() - started:5.1f} s] {name} ...", end=" ", flush=True)
            t0 = time.monotonic()
            data, rows = fn(cfg, a, b, x)
            data["seconds"] = round(time.monotonic() - t0, 2)
            benches[name], checks = data, checks + rows
            print(f"{data['seconds']} s", flush=True)
        for br in (b, a):  # the benchmarks' names go first: teardown counts what is left
            with br.client() as c:
                for name in ("f1", "f2"):
                    c.delete(name)
        result["teardown"] = {"A": suite.teardown(a), "B": suite.teardown(b)}
    finally:
        for br in brokers:
            br.cleanup()
    result["benchmarks"] = benches
    result["checks"] = checks
    out = suite.written(result, args.out, started, REASONS)
    print(suite.summary(result))
    print(markdown(result))
    print(f"[{time.monotonic() - started:5.1f} s] wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
