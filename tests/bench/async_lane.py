"""An AsyncClient's small requests on the shared-memory lane, against the
same requests over HTTP: a put of a 4 KiB tensor, then a get of it with
``newer_than`` (a new version each time, so the board never answers it),
from one AsyncClient, with ``lane=True`` and ``lane=False`` alternated in
one process, the order reversed each round.

    python tests/bench/async_lane.py [--pairs 2000] [--rounds 3] [--out FILE]
        [--shm-prefix P]

It starts its own broker.  Each round gives each door the median of its
``--pairs`` puts and gets; the result is the median over rounds, and the
lane's as a ratio of HTTP's (below 1: the lane is faster).  Two doors of
one client, on one machine in one sitting: no peer here (``peers.py``
compares the Client with Ray and the Pipe).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
for _p in (str(HERE), str(HERE.parent)):
    if _p not in sys.path:
        sys.path.insert(0, _p)

import _procs
from _harness import BrokerProc

WARM = 50


async def _pairs(url: str, lane: bool, n: int) -> tuple[list[float], list[float]]:
    """Seconds of each put and each get of ``n`` pairs, on one door."""
    from tensordepot import AsyncClient

    x = np.zeros(1024, np.float32)  # 4 KiB
    puts, gets = [], []
    async with AsyncClient(url, lane=lane) as c:
        if (c._core.lane is not None) != lane:
            raise RuntimeError(f"lane={lane}, but the client has {c._core.lane!r}")
        for i in range(WARM + n):
            x[0] = i
            t0 = time.perf_counter()
            v = await c.put("async_lane", x)
            t1 = time.perf_counter()
            t = await c.get("async_lane", newer_than=v - 1)
            t2 = time.perf_counter()
            if int(np.from_dlpack(t)[0]) != i:
                raise AssertionError(f"get {i} read {np.from_dlpack(t)[0]}")
            del t
            if i >= WARM:
                puts.append(t1 - t0)
                gets.append(t2 - t1)
        await c.delete("async_lane")
    return puts, gets


def run(pairs: int, rounds: int, prefix: str) -> dict[str, Any]:
    broker = BrokerProc(prefix=prefix)
    try:
        doors: dict[str, dict[str, list[float]]] = {
            d: {"put_us": [], "get_us": []} for d in ("lane", "http")
        }
        for r in range(rounds):
            for lane in (True, False) if r % 2 == 0 else (False, True):
                puts, gets = asyncio.run(_pairs(broker.url, lane, pairs))
                d = doors["lane" if lane else "http"]
                d["put_us"].append(statistics.median(puts) * 1e6)
                d["get_us"].append(statistics.median(gets) * 1e6)
        broker.check_clean()
    finally:
        broker.cleanup()
    out: dict[str, Any] = {"pairs": pairs, "rounds": rounds, "nbytes": 4096}
    for door, samples in doors.items():
        out[door] = {k: {"median": statistics.median(v), "samples": v} for k, v in samples.items()}
    for k in ("put_us", "get_us"):
        out[f"{k[:3]}_lane_over_http"] = out["lane"][k]["median"] / out["http"][k]["median"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pairs", type=int, default=2000, help="puts and gets per door per round")
    ap.add_argument("--rounds", type=int, default=3)
    _procs.side_args(ap, "tdalane")
    a = ap.parse_args()
    result = run(a.pairs, a.rounds, a.shm_prefix)
    _procs.emit(result, a.out)


if __name__ == "__main__":
    main()
