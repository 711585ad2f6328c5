"""Puts on command, from a process of its own: one line ``NAME FILL MIB`` puts
``MIB`` MiB of bytes equal to ``FILL`` as ``NAME`` and answers ``put VERSION``.

    python putter.py BROKER_URL
"""

from __future__ import annotations

import sys

import numpy as np
from tensordepot import Client

with Client(sys.argv[1], label="putter") as c:
    print("ready", flush=True)
    for line in sys.stdin:
        name, fill, mib = line.split()
        print("put", c.put(name, np.full(int(mib) << 20, int(fill), dtype=np.uint8)), flush=True)
