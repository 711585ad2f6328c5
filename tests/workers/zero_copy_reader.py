"""Reads a big tensor and every one of its pages; reports anonymous-memory growth.

Anonymous memory is what a hidden copy would show up in: shared-memory pages
that only this process maps count as Private_* in smaps, so RSS or Private_*
would mislead (DESIGN.md, "Gotchas")."""

from __future__ import annotations

import sys

import numpy as np
from tensordepot import Client


def anonymous_kib() -> int:
    with open("/proc/self/smaps_rollup") as f:
        for line in f:
            if line.startswith("Anonymous:"):
                return int(line.split()[1])
    raise RuntimeError("no Anonymous line in smaps_rollup")


url, name = sys.argv[1], sys.argv[2]
with Client(url) as c:
    before = anonymous_kib()
    t = c.get(name, timeout=30)
    a = np.from_dlpack(t)
    # One element of every 4 KiB page: touches every page without a temporary copy.
    step = 4096 // a.itemsize
    total = float(a.reshape(-1)[::step].sum(dtype=np.float64))
    after = anonymous_kib()
    expected = float(a.size // step)  # the producer filled it with ones
    print(
        f"nbytes={a.nbytes} pages_sum={total} expected={expected} anon_growth_kib={after - before}"
    )
    del a, t
