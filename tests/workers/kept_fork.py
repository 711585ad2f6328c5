"""A kept mapping across fork, in a process with no other threads: the parent
lends a range and reads it, forks; the child writes through the inherited
range, returns it, lends it again and must see the segment's bytes; the
parent's view must never see the child's write.

    kept_fork.py SEGMENT_PREFIX scan|read    -> prints "ok", exits 0
"""

from __future__ import annotations

import ctypes
import gc
import os
import sys

from tensordepot.shm import PosixSegment, _kept
from tensordepot.shm._posix import PAGE, SegmentFile

prefix, how = sys.argv[1], sys.argv[2]
pm = _kept._Pagemap(use_scan=how == "scan")
assert _kept._probe(pm), "this kernel reports no private pages this way"
seg = PosixSegment(prefix + "fork", 4 * PAGE)
try:
    f = SegmentFile(seg.name, writable=True, trust={os.getuid()})
    os.pwrite(f.fd, b"\x01" * (4 * PAGE), 0)
    k = _kept.KeptMap(f, pm)
    a = k.lend(0, 2 * PAGE)
    assert a is not None
    assert ctypes.string_at(a.address, 2 * PAGE) == b"\x01" * (2 * PAGE)
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            ctypes.memset(a.address, 2, 2 * PAGE)
            page = a.address
            del a
            b = k.lend(0, 2 * PAGE)
            clean = pm.dirty(page, page + 2 * PAGE) == []
            same = b is not None and ctypes.string_at(b.address, 2 * PAGE) == b"\x01" * (2 * PAGE)
            code = 0 if clean and same else 3
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, f"the child failed: {status}"
    assert ctypes.string_at(a.address, 2 * PAGE) == b"\x01" * (2 * PAGE), "the child's write leaked"
    del a, k, f
    gc.collect()
finally:
    seg.unlink()
print("ok")
