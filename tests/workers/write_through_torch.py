"""Writes into a published tensor through torch, which ignores DLPack's
READ_ONLY flag.  Reader mappings are private copy-on-write, so the write must
land on this process's own copy of the page: the process lives, sees its own
write, and a fresh get of the same tensor shows the published bytes again."""

from __future__ import annotations

import sys

import numpy as np
import torch
from tensordepot import Client

url, name = sys.argv[1], sys.argv[2]
with Client(url) as c:
    x = torch.from_dlpack(c.get(name))
    want = x.clone()
    print("writing", flush=True)
    x[0] = 42.0
    x.add_(1.0)
    assert x[0].item() == 43.0 and torch.equal(x[1:], want[1:] + 1), (
        "the write did not land locally"
    )
    print("WROTE", flush=True)
    again = np.from_dlpack(c.get(name))  # a new view of the same published version
    assert np.array_equal(again, want.numpy()), "a fresh get shows this process's own stray write"
    del x, again
print("CLEAN", flush=True)
