"""Copying into shared memory at memory bandwidth.

numpy releases the GIL inside large copies, so splitting one copy across a
few threads uses several cores' worth of memory bandwidth.  A single thread
tops out well below the machine's bandwidth (DESIGN.md: 105 ms against 64 ms
per GiB on two cores).
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any

_MIN_PARALLEL = 8 << 20  # below this, thread hand-off costs more than it saves
_CHUNK_ALIGN = 1 << 16
_threads = max(1, min(os.cpu_count() or 1, 8))
_executor: ThreadPoolExecutor | None = None


def _pool() -> ThreadPoolExecutor:
    global _executor
    if _executor is None:
        _executor = ThreadPoolExecutor(_threads, thread_name_prefix="tensordepot-copy")
    return _executor


def copy_into(dst: Any, src: Any) -> None:
    """Copy ``src`` (any strides) into ``dst`` (C-contiguous, same shape and item size)."""
    import numpy as np

    nbytes = dst.nbytes
    if nbytes < _MIN_PARALLEL or _threads == 1:
        np.copyto(dst, src, casting="no")
        return
    futures = []
    if src.flags.c_contiguous:
        d = dst.reshape(-1).view(np.uint8)
        s = src.reshape(-1).view(np.uint8)
        step = -(-nbytes // _threads)
        step = -(-step // _CHUNK_ALIGN) * _CHUNK_ALIGN
        for start in range(0, nbytes, step):
            futures.append(_pool().submit(np.copyto, d[start:start + step], s[start:start + step]))
    else:
        # Split along the outermost axis with more than one row.
        axis = next((i for i, n in enumerate(src.shape) if n > 1), 0)
        rows = src.shape[axis]
        step = max(1, -(-rows // _threads))
        idx = [slice(None)] * src.ndim
        for start in range(0, rows, step):
            idx[axis] = slice(start, start + step)
            futures.append(_pool().submit(np.copyto, dst[tuple(idx)], src[tuple(idx)], "no"))
    for f in futures:
        f.result()


def copy_many(pairs: list[tuple[Any, Any]]) -> None:
    """Copy many (dst, src) pairs, as ``copy_into`` each, using every copy thread.

    A state dict is hundreds of tensors that are each too small to split, so
    whole tensors are dealt out to the threads, largest first, to the least
    loaded one; tensors big enough to split are copied with ``copy_into``."""
    import numpy as np

    total = sum(d.nbytes for d, _ in pairs)
    if total < _MIN_PARALLEL or _threads == 1:
        for d, s in pairs:
            np.copyto(d, s, casting="no")
        return
    big = [(d, s) for d, s in pairs if d.nbytes >= _MIN_PARALLEL]
    small = sorted(((d, s) for d, s in pairs if d.nbytes < _MIN_PARALLEL), key=lambda p: -p[0].nbytes)
    buckets: list[list[tuple[Any, Any]]] = [[] for _ in range(_threads)]
    loads = [0] * _threads
    for d, s in small:
        i = loads.index(min(loads))
        buckets[i].append((d, s))
        loads[i] += d.nbytes

    def run(bucket: list[tuple[Any, Any]]) -> None:
        for d, s in bucket:
            np.copyto(d, s, casting="no")

    futures = [_pool().submit(run, b) for b in buckets if b]
    for d, s in big:
        copy_into(d, s)
    for f in futures:
        f.result()
