"""Child processes of the benchmark suite (started with the ``spawn`` method).

Each function runs in a fresh interpreter, so the state of the process that
drives the suite (its big arrays, its Client, torch) never leaks into what a
child measures.  Imports happen inside the functions: a spawned child imports
this module first, and only the peer it runs needs torch.
"""

from __future__ import annotations

import json
import os
import threading
import time
from multiprocessing.connection import Connection
from typing import Any

# -- a side script's result ---------------------------------------------------------


def side_args(ap: Any, tag: str) -> None:
    """A side script's ``--out`` and ``--shm-prefix`` (the broker it starts:
    ``tag``, then this process's pid)."""
    ap.add_argument("--out", help="write the result here as JSON too")
    ap.add_argument(
        "--shm-prefix",
        default=f"{tag}-{os.getpid()}-",
        help="segment prefix of the broker this run starts",
    )


def emit(result: dict[str, Any], out: str | None) -> None:
    """Print ``result`` as JSON, and write it to ``out`` too when given."""
    text = json.dumps(result, indent=2)
    print(text)
    if out:
        with open(out, "w") as f:
            f.write(text + "\n")


# -- the allocator ----------------------------------------------------------------

SETTLE = 8 << 20  # bytes: above the largest message a case sends or pickles at once


def settle_malloc() -> None:
    """Put this process's allocator in the state a long-lived producer is in.

    glibc's malloc gives a block above its mmap threshold (128 KiB at start)
    pages of its own, faulted in as they are written and returned when freed,
    and it raises the threshold to the size of the largest such block freed
    (up to 32 MiB).  So a process that has freed one large array serves
    later megabyte buffers from memory it already holds, and one that has
    not faults in every page of each: a Pipe's pickle of 1,000 x 1 KiB took
    6-9 ms in a fresh process and 4-5 ms after a state dict was made and
    freed.  A case's figures then hung on which cases ran before it in the
    same process; the drivers call this first, so that every case, run alone
    or in the full suite, meets the peers at their best."""
    block = bytearray(SETTLE)  # malloc'd above the threshold: its own pages ...
    del block  # ... freed: the threshold is now SETTLE


# -- memory readings (B6) ------------------------------------------------------


def _kib_field(path: str, key: str) -> int:
    with open(path) as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(f"{key} not in {path}")


def rss_anon() -> int:
    """Bytes of private anonymous memory resident in this process (/proc/self/status)."""
    return _kib_field("/proc/self/status", "RssAnon")


def anonymous() -> int:
    """Bytes of anonymous memory mapped by this process (/proc/self/smaps_rollup)."""
    return _kib_field("/proc/self/smaps_rollup", "Anonymous")


class _PeakSampler:
    """Samples RssAnon every ``interval`` seconds on a thread and keeps the peak.

    numpy releases the GIL inside the put's copy, so this thread keeps running
    while the copy threads work."""

    def __init__(self, interval: float = 0.0005) -> None:
        self.peak = rss_anon()
        self._interval = interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, rss_anon())
            self._stop.wait(self._interval)

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss_anon())
        return self.peak


def memory_producer(url: str, name: str, nbytes: int, out: Connection) -> None:
    """B6, producer side: RssAnon growth during a put, beyond the source array."""
    import numpy as np
    from tensordepot import Client

    src = np.full(nbytes // 4, 1.5, dtype=np.float32)  # every page touched: counted in the baseline
    with Client(url) as c:
        c.put(name + ".warm", np.zeros(16, np.float32))  # session, transport and imports settle
        result: dict[str, Any] = {}
        for label in ("first", "second"):  # a first put maps the segment; a second reuses it
            base = rss_anon()
            sampler = _PeakSampler()
            c.put(name, src)
            peak = sampler.stop()
            result[label] = {
                "baseline": base,
                "peak": peak,
                "after": rss_anon(),
                "peak_growth": peak - base,
                "after_growth": rss_anon() - base,
            }
        c.delete(name + ".warm")
    out.send(result)


def memory_consumer(url: str, name: str, out: Connection) -> None:
    """B6, consumer side: anonymous-memory growth after a get and a full read."""
    import numpy as np
    from tensordepot import Client

    with Client(url) as c:
        c.stat()  # session and transport settle before the baseline
        base = anonymous()
        t = c.get(name, timeout=30)
        a = np.from_dlpack(t)
        total = float(a.sum(dtype=np.float64))  # reads every byte; numpy reduces in small buffers
        after = anonymous()
        expect = a.size * 1.5
        del a, t
    out.send({"baseline": base, "after": after, "growth": after - base, "sum_ok": total == expect})


# -- B1 and B3 consumers ---------------------------------------------------------
# Every consumer acknowledges over the same raw Pipe with the first element it
# read, so the peers differ only in how the tensor travels, and the producer
# can check that the consumer saw the new value.


def handoff_depot(url: str, name: str, iters: int, ack: Connection) -> None:
    """Blocks in ``get(newer_than=last)`` (the long poll) before each put arrives."""
    import numpy as np
    from tensordepot import Client

    with Client(url) as c:
        ack.send_bytes(b"ready")
        last = 0
        for _ in range(iters):
            t = c.get(name, timeout=60, newer_than=last)
            a = np.from_dlpack(t)
            value = a.reshape(-1)[0].item()
            last = t.version
            del a, t
            ack.send_bytes(repr(value).encode())


def _read_all(arrays: Any) -> float:
    """Read every tensor of a batch: its first and last elements, added up."""
    total = 0.0
    for a in arrays:
        total += a[0].item() + a[-1].item()
    return total


def batch_depot(url: str, names: list[str], iters: int, ack: Connection) -> None:
    """B8: waits in ``get_many`` for versions newer than the ones it read last,
    reads every tensor through DLPack, and acknowledges the sum of its reads."""
    import numpy as np
    from tensordepot import Client

    with Client(url) as c:
        ack.send_bytes(b"ready")
        last: dict[str, int] = {}
        for _ in range(iters):
            got = c.get_many(names, timeout=60, newer_than=last)
            total = _read_all(np.from_dlpack(t) for t in got.values())
            last = {n: t.version for n, t in got.items()}
            del got
            ack.send_bytes(repr(total).encode())


def batch_pipe(conn: Connection, ack: Connection) -> None:
    """B8: receives pickled dicts of arrays from a multiprocessing Pipe."""
    ack.send_bytes(b"ready")
    while True:
        d = conn.recv()
        if d is None:
            return
        total = _read_all(d.values())
        del d
        ack.send_bytes(repr(total).encode())


def _ack_each(recv: Any, ack: Connection) -> None:
    """Acknowledge every tensor ``recv()`` returns with its first element, until None."""
    ack.send_bytes(b"ready")
    while True:
        x = recv()
        if x is None:
            return
        value = x.reshape(-1)[0].item()
        del x
        ack.send_bytes(repr(value).encode())


def handoff_torch(q: Any, ack: Connection) -> None:
    """Receives tensors from a torch.multiprocessing Queue."""
    import torch  # noqa: F401  (registers torch's shared-memory reductions)

    _ack_each(q.get, ack)


def handoff_pipe(conn: Connection, ack: Connection) -> None:
    """Receives pickled arrays from a multiprocessing Pipe."""
    _ack_each(conn.recv, ack)


# -- B5: control-plane throughput ------------------------------------------------


def ops_client(
    depot_url: str,
    bare_url: str,
    name: str,
    variants: list[str],
    reps: int,
    seconds: float,
    barrier: Any,
    out: Any,
) -> None:
    """Runs every variant ``reps`` times; each run starts at a barrier shared by
    all clients and lasts ``seconds``.  Sends (variant, rep, ops, elapsed)."""
    from tensordepot import Client
    from tensordepot.client._transport import Transport

    # Over HTTP, as the bare endpoint is: the broker's request path against
    # FastAPI's (the shared-memory lane and the board are B10's gets).
    with Client(depot_url, lane=False) as c:
        bare = Transport(bare_url)
        ops = {
            "tensordepot_get": lambda: c.get(name).release(),
            "tensordepot_stat": c.stat,
            "bare_fastapi": lambda: bare.request("GET", "/v1/tensors/" + name),
        }
        for v in variants:
            for _ in range(20):  # warm connections and code paths
                ops[v]()
        for rep in range(reps):
            for v in variants:
                op = ops[v]
                barrier.wait()
                n = 0
                t0 = time.perf_counter()
                deadline = t0 + seconds
                while True:
                    op()
                    n += 1
                    now = time.perf_counter()
                    if now >= deadline:
                        break
                out.put((v, rep, n, now - t0))
        bare.close()
