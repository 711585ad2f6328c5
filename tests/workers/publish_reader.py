"""Reads a tensor the moment it is published: for each line ``VERSION`` on
stdin, a parked get of the version after it, then element 0 (int64) read
over and over for ``WINDOW`` seconds; prints ``got V DISTINCT`` (how many
values element 0 showed after the get returned: 1 if published bytes never
change)."""

from __future__ import annotations

import sys
import time

import numpy as np
from tensordepot import Client

url, name = sys.argv[1], sys.argv[2]
WINDOW = 0.02
with Client(url) as c:
    print("ready", flush=True)
    for line in sys.stdin:
        t = c.get(name, timeout=60, newer_than=int(line))
        a = np.from_dlpack(t)
        seen = set()
        end = time.monotonic() + WINDOW
        while time.monotonic() < end:
            seen.add(int(a[0]))
        print("got", t.version, len(seen), flush=True)
        del a, t  # the lease ends with the last view
