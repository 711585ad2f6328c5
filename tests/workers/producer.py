"""Producer worker: puts every tensor of _data.expected(), fills one through empty(), exits."""

from __future__ import annotations

import sys

import numpy as np
from _data import expected
from tensordepot import Client

url = sys.argv[1]
data = expected()
with Client(url) as c:
    for name, arr in data.items():
        if name == "filled":
            continue
        if name == "u8_strided":
            assert not arr.flags.c_contiguous
        c.put(name, arr)
    out = c.empty("filled", data["filled"].shape, "float32")
    view = np.from_dlpack(out)
    assert view.flags.writeable, "empty() views must be writable"
    view[...] = data["filled"]
    del view
    out.publish()
print("produced", len(data))
