"""Puts one large float32 tensor ("big", MIB MiB) into a broker that has no warm
memory for it yet: the broker must create and pre-fault a segment."""

from __future__ import annotations

import sys

import numpy as np
from tensordepot import Client

url, mib = sys.argv[1], int(sys.argv[2])
src = np.ones(mib << 18, dtype=np.float32)
with Client(url) as c:
    v = c.put("big", src)
print("put", v, flush=True)
