"""Copying into shared memory at memory bandwidth.

numpy releases the GIL inside large copies, so splitting one copy across a
few threads uses several cores' worth of memory bandwidth.  A single thread
tops out well below the machine's bandwidth (DESIGN.md: 105 ms against 64 ms
per GiB on two cores).

Two promises the callers rely on:

* **A copy that raises has stopped writing.**  When the calling thread is
  interrupted (Ctrl-C) or a piece fails, pieces not yet started do nothing
  and the running ones are waited for before the exception propagates, so
  the caller may give the memory back at once: no thread is still writing
  into it (README, Lifetime: M1).  Pieces are at most ``_PIECE`` bytes, so
  that wait is short.
* **Fork-safe.**  A forked child has none of its parent's threads; the
  executor is re-created in the child on first use.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ._sigint import interruptible

_MIN_PARALLEL = 8 << 20  # below this, thread hand-off costs more than it saves
# The most one thread copies before it can notice a cancel: about 40 ms of one
# thread's bandwidth.  Not smaller: glibc's memcpy switches to non-temporal
# stores only above a threshold (x86_non_temporal_threshold, 3/4 of the
# shared cache size; 192 MiB on the benchmark machine), and below it a copy
# also reads every destination line first.  There, 64 MiB pieces made a
# 1 GiB copy into shared memory 1.6x slower than 256 MiB ones (141 ms
# against 87 ms, two threads).
_PIECE = 256 << 20
_CHUNK_ALIGN = 1 << 16
_threads = max(1, min(os.cpu_count() or 1, 8))
_executor: ThreadPoolExecutor | None = None
_owner_pid = os.getpid()


def _forget_executor() -> None:
    global _executor, _owner_pid
    _executor, _owner_pid = None, os.getpid()


os.register_at_fork(after_in_child=_forget_executor)


def _pool() -> ThreadPoolExecutor:
    global _executor
    if _executor is None or _owner_pid != os.getpid():
        _forget_executor()
        _executor = ThreadPoolExecutor(_threads, thread_name_prefix="tensordepot-copy")
    return _executor


class _Gate:
    """What every piece of one copy passes through before it writes.

    Once ``shut`` returns, no piece of that copy writes any more: a piece that
    has not started returns at once, and ``shut`` waits for the running ones.
    It holds wherever the caller's interrupt lands, even between two
    ``submit`` calls, where no future of the running piece is known yet."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self.closed = False
        self._running = 0

    def run(self, bucket: list[tuple[Any, Any]]) -> None:
        """Copy each (dst, src) pair of ``bucket`` in turn, until the gate shuts."""
        with self._cond:
            if self.closed:
                return
            self._running += 1
        try:
            self.copy(bucket)
        finally:
            with self._cond:
                self._running -= 1
                self._cond.notify_all()

    @interruptible
    def copy(self, bucket: list[tuple[Any, Any]]) -> None:
        """Copy each pair of ``bucket``, until the gate shuts: a copy
        thread's through ``run``, or the bucket of the thread that made the
        gate (``_run_all``), which a Ctrl-C stops between two copies: once the
        exception leaves here that thread writes no more, so the gate counts
        only the copy threads."""
        for d, s in bucket:
            if self.closed:
                return
            _copy(d, s)

    @interruptible
    def shut(self) -> None:
        while True:
            try:
                with self._cond:
                    self.closed = True
                    while self._running:
                        self._cond.wait()
                return
            except BaseException:  # a second Ctrl-C: keep waiting, the threads still write
                continue


@interruptible
def _run_all(buckets: list[list[tuple[Any, Any]]], here: bool = False) -> None:
    """Copy each bucket of (dst, src) pairs on a copy thread and wait for all
    of them; on any exception (Ctrl-C included), stop them first, then re-raise.
    ``here``: the first bucket is copied in this thread (``_Gate.copy``: for
    runs of small tensors, each under ``_MIN_PARALLEL``, so that a Ctrl-C
    waits for one of them at most)."""
    gate = _Gate()
    try:
        pool = _pool()
        futures = []
        for bucket in buckets[1:] if here else buckets:
            futures.append(pool.submit(gate.run, bucket))
        if here:
            gate.copy(buckets[0])
        for f in futures:
            f.result()
    except BaseException:
        gate.shut()
        raise


class FileChanged(OSError):
    """A file read as a copy's source ended before the bytes it was to hold;
    ``fd`` is the file's descriptor."""

    def __init__(self, fd: int, why: str) -> None:
        super().__init__(why)
        self.fd = fd


class FileSpan:
    """Bytes ``[offset, offset + nbytes)`` of an open file, as the source of
    a copy: read with ``preadv`` straight into the destination (one copy,
    from the page cache, as from a mapping of the file, and without the GIL).

    Not a mapping: a file that another process shrinks while it is copied
    would kill this one with SIGBUS through a mapping; read, it raises
    ``FileChanged``.  The caller owns ``fd`` and keeps it open meanwhile."""

    ndim = 1

    def __init__(self, fd: int, offset: int, nbytes: int) -> None:
        import numpy as np

        self.fd, self.offset, self.nbytes = fd, offset, nbytes
        self.shape = (nbytes,)
        self.dtype = np.dtype(np.uint8)

    def part(self, start: int, stop: int) -> FileSpan:
        stop = min(stop, self.nbytes)
        return FileSpan(self.fd, self.offset + start, stop - start)

    def read_into(self, dst: Any) -> None:
        """Fill ``dst`` (C-contiguous, ``nbytes`` bytes) from the file."""
        import numpy as np

        view = memoryview(dst.reshape(-1).view(np.uint8))
        done = 0
        while done < self.nbytes:
            n = os.preadv(self.fd, [view[done:]], self.offset + done)
            if n == 0:
                raise FileChanged(
                    self.fd,
                    f"the file ended {self.offset + done} bytes in, "
                    f"before the {self.nbytes} bytes from {self.offset}: "
                    f"it shrank while it was read",
                )
            done += n

    def tobytes(self) -> bytes:
        import numpy as np

        out = np.empty(self.nbytes, np.uint8)
        self.read_into(out)
        return out.tobytes()


def _pieces(dst: Any, src: Any) -> list[tuple[Any, Any]]:
    """Split a copy into at most ``_PIECE``-byte pieces along the outermost axis."""
    import numpy as np

    nbytes = dst.nbytes
    n = max(_threads, -(-nbytes // _PIECE))
    step = -(-nbytes // n)
    step = -(-step // _CHUNK_ALIGN) * _CHUNK_ALIGN  # for flat pieces: whole 64 KiB chunks
    if isinstance(src, FileSpan):
        d = dst.reshape(-1).view(np.uint8)
        return [(d[i : i + step], src.part(i, i + step)) for i in range(0, nbytes, step)]
    if src.flags.c_contiguous:
        d = dst.reshape(-1).view(np.uint8)
        s = src.reshape(-1).view(np.uint8)
        return [(d[i : i + step], s[i : i + step]) for i in range(0, nbytes, step)]
    axis = next((i for i, k in enumerate(src.shape) if k > 1), 0)
    rows = src.shape[axis]
    step = max(1, -(-rows // n))
    out = []
    idx: list[Any] = [slice(None)] * src.ndim
    for start in range(0, rows, step):
        idx[axis] = slice(start, start + step)
        out.append((dst[tuple(idx)], src[tuple(idx)]))
    return out


def _copy(d: Any, s: Any) -> None:
    import numpy as np

    if isinstance(s, FileSpan):
        s.read_into(d)
        return
    np.copyto(d, s, casting="no")


def copy_into(dst: Any, src: Any) -> None:
    """Copy ``src`` (any strides) into ``dst`` (C-contiguous, same shape and item size)."""
    if dst.nbytes < _MIN_PARALLEL or _threads == 1:
        _copy(dst, src)
        return
    _run_all([[piece] for piece in _pieces(dst, src)])


def copy_many(pairs: list[tuple[Any, Any]]) -> None:
    """Copy many (dst, src) pairs, as ``copy_into`` each, using every copy thread.

    A state dict is hundreds of tensors that are each too small to split, so
    each thread copies a run of whole tensors, in order, of about equal bytes;
    tensors big enough to split are split into pieces."""
    total = sum(d.nbytes for d, _ in pairs)
    if total < _MIN_PARALLEL or _threads == 1:
        for d, s in pairs:
            _copy(d, s)
        return
    jobs: list[tuple[Any, Any]] = []
    small = []
    for d, s in pairs:
        if d.nbytes >= _MIN_PARALLEL:
            jobs.extend(_pieces(d, s))
        else:
            small.append((d, s))
    # This thread copies a run itself rather than wake a thread per run and
    # sleep: two copy threads woken together by one thread were often queued
    # on its CPU while the other CPU idled, until the scheduler moved one
    # (B7's fill on two cores: a thread runnable but waiting up to 7 ms of
    # a 16-23 ms fill, the cores idle a quarter of the time; none since).
    runs = [b for b in _runs(small, _threads) if b]
    _run_all(runs + [[piece] for piece in jobs], here=bool(runs))


def _runs(pairs: list[tuple[Any, Any]], n: int) -> list[list[tuple[Any, Any]]]:
    """``pairs`` cut, in order, into at most ``n`` runs of about equal bytes.

    put_many places a batch back to back, so each thread writes one stretch
    of memory, which copies faster than tensors dealt out largest first
    (B7's state dict into shared memory, interleaved: 16.4-16.7 ms against
    17.0-17.3).  A tensor starts the next run when most of it lies past this
    run's share: each cut lies within half a tensor of a multiple of the
    share, so a run's bytes are its share give or take one tensor."""
    share = sum(d.nbytes for d, _ in pairs) / n
    runs: list[list[tuple[Any, Any]]] = [[]]
    done = 0
    for d, s in pairs:
        if runs[-1] and len(runs) < n and done + d.nbytes / 2 > share * len(runs):
            runs.append([])
        runs[-1].append((d, s))
        done += d.nbytes
    return runs
