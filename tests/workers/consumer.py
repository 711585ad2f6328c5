"""Consumer worker: reads every tensor through numpy and torch, checks values and zero copy."""

from __future__ import annotations

import os
import sys

import numpy as np
import torch
from _data import expected
from tensordepot import Client

PAGE = os.sysconf("SC_PAGE_SIZE")


def page_is_the_segments(ptr: int) -> bool:
    """Whether the page at ``ptr`` is present and is the file's own page (pagemap
    bit 61: file-page or shared-anon), not a private anonymous copy of it."""
    with open("/proc/self/pagemap", "rb") as f:
        f.seek(ptr // PAGE * 8)
        entry = int.from_bytes(f.read(8), "little")
    return bool(entry >> 63 & 1) and bool(entry >> 61 & 1)


def shared_mappings() -> list[tuple[int, int, str, str]]:
    out = []
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split()
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            path = parts[5] if len(parts) > 5 else ""
            out.append((lo, hi, parts[1], path))
    return out


url = sys.argv[1]
data = expected()
with Client(url) as c:
    for name, want in data.items():
        t = c.get(name, timeout=10)
        assert t.shape == want.shape and t.dtype == want.dtype.name, (name, t, want.dtype)
        a = np.from_dlpack(t)
        assert not a.flags.writeable, f"{name}: published tensors must be read-only in numpy"
        x = torch.from_dlpack(t)
        assert np.array_equal(a, want), name
        assert np.array_equal(x.numpy(), want), name
        # Zero copy, shown: both views point into a mapping of the broker's segment,
        # and the page they read is the segment's own page, not a copy.
        ptr = a.__array_interface__["data"][0]
        assert x.data_ptr() == ptr, name
        hits = [m for m in shared_mappings() if m[0] <= ptr < m[1]]
        assert hits, f"{name}: data pointer {ptr:#x} is in no mapping"
        lo, hi, perms, path = hits[0]
        assert path.startswith("/dev/shm/"), f"{name}: mapping {path!r} is not a shm segment"
        assert page_is_the_segments(ptr), f"{name}: the page at {ptr:#x} is a private copy"
        print(name, "ok", path.rsplit("-", 1)[-1][:8])
print("consumed", len(data))
