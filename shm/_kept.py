"""Reader mappings kept across gets: one private mapping per segment, lent out
range by range, so a read through a later get finds its page tables made.

A fresh window per get (``_posix.Window``) sets up page tables again for
every read: reading 1 GiB through a new mapping costs about twice what it
costs through a mapping kept from an earlier get.  A ``KeptMap`` maps the
whole segment once, ``MAP_PRIVATE`` like a reader window, and lends
``[offset, offset + nbytes)`` of it as a ``Lent``.

What a reader window promises still holds: a stray write through a view
(torch and jax ignore read-only flags) lands on a private copy of the page,
in this process only, and never reaches a later get.  The private copies are
found and dropped:

* **Invariant:** every page that holds a private copy (is *dirty*) lies under
  a range that is lent now.  A page under no lent range maps the segment's
  own page, so it shows what the segment holds.
* **Return:** when a ``Lent``'s last view is gone, its range is returned and
  its pages are scanned (``PAGEMAP_SCAN``, Linux 6.7, or ``/proc/self/pagemap``,
  which a range of a few pages reads faster: one ``pread``);
  dirty pages that no other lent range shares are dropped (``MADV_DONTNEED``),
  so they map the segment's page again.
* **Lend:** lent ranges never share bytes: a range that overlaps one lent now
  is refused, and the caller maps a fresh window.  Only a range's first and
  last page can be shared with another lent range (small tensors in one
  page); if such a page is dirty, the range is refused too.

Whether this kernel reports private copies truthfully is checked once per
process on a scratch memfd (``supported``); where it does not, callers map a
fresh window per get, as before.

**Locked memory** (``mlock``, ``mlockall``) breaks the invariant: locking a
writable private mapping faults every page in for writing, so each page
becomes a private copy of what the segment held at that moment, and
``MADV_DONTNEED`` refuses locked pages (EINVAL).  A map whose pages may be
locked is *retired*: it lends nothing more (each get maps a fresh window,
whose copy, if it is locked, is taken after publishing and so holds the
published bytes), and its ranges are never lent again.  Locking is seen
through the first page of each range asked for (copied under no lent range:
``mlockall`` copied every page, even if unlocked since; one pagemap read,
1.9 us, where a probe of the lock itself would add a syscall to every lend),
and through any drop the kernel refuses.  Under ``mlockall(MCL_FUTURE)`` a
new map would be copied whole as it is made: ``locked_now`` says so first.

A ``Lent``'s finalizer may run in any thread, including one inside ``lend``
on the same map (garbage collection), so it never waits for the lock: a
return that finds the lock held is queued and handled by whoever holds it.
"""

from __future__ import annotations

import bisect
import collections
import ctypes
import os
import struct
import threading
from typing import Any

from ._posix import (
    _MAP_FIXED,
    _MAP_PRIVATE,
    _PROT_READ,
    _PROT_WRITE,
    PAGE,
    SegmentFile,
    _libc,
    _mmap,
)

_MADV_DONTNEED = 4
_MAP_ANONYMOUS = 0x20


class _ScanArg(ctypes.Structure):  # struct pm_scan_arg, linux/fs.h
    _fields_ = [
        (n, ctypes.c_uint64)
        for n in (
            "size",
            "flags",
            "start",
            "end",
            "walk_end",
            "vec",
            "vec_len",
            "max_pages",
            "category_inverted",
            "category_mask",
            "category_anyof_mask",
            "return_mask",
        )
    ]


class _Region(ctypes.Structure):  # struct page_region
    _fields_ = [
        ("start", ctypes.c_uint64),
        ("end", ctypes.c_uint64),
        ("categories", ctypes.c_uint64),
    ]


# _IOWR('f', 16, struct pm_scan_arg)
_PAGEMAP_SCAN = (3 << 30) | (ctypes.sizeof(_ScanArg) << 16) | (ord("f") << 8) | 16
_PAGE_IS_FILE, _PAGE_IS_PRESENT, _PAGE_IS_SWAPPED = 1 << 2, 1 << 3, 1 << 4
_VEC = 64
# A range of at most this many pages is read from /proc/self/pagemap rather
# than scanned: one pread and one unpack cost less than building the scan's
# ctypes arguments (checking a 4 KiB get's page at its return, in a loop of
# 4 KiB gets: 8.6 us read against 12.5 us scanned; alone, 2.0 against 5.2;
# at 64 pages the scan is the cheaper, 6.8 against 14.3).
_READ_PAGES = 16
_ioctl = _libc.ioctl
_ioctl.restype = ctypes.c_int
_ioctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_void_p]


class _Pagemap:
    """This process's /proc/self/pagemap: which pages of a range hold private
    (anonymous) copies.  Reopened after fork, since /proc/self is resolved at open.
    ``use_scan``: ask with ``PAGEMAP_SCAN``, else read the entries;
    ``read_small``: read them anyway for ranges of at most ``_READ_PAGES``."""

    def __init__(self, use_scan: bool = True, read_small: bool = False) -> None:
        self.use_scan = use_scan
        self.read_small = read_small
        self._pid = -1
        self._fd = -1
        self._lock = threading.Lock()

    def _file(self) -> int:
        if self._pid != os.getpid():
            with self._lock:
                if self._pid != os.getpid():
                    self._fd = os.open("/proc/self/pagemap", os.O_RDONLY | os.O_CLOEXEC)
                    self._pid = os.getpid()
        return self._fd

    def after_fork(self) -> None:
        """In a child: the inherited fd reads the parent's pages, and another
        thread of the parent may have held the lock."""
        if self._fd >= 0:
            os.close(self._fd)
        self._fd, self._pid, self._lock = -1, -1, threading.Lock()

    def dirty(self, start: int, end: int) -> list[tuple[int, int]]:
        """The address ranges in ``[start, end)`` (page aligned) whose pages
        are private copies, present or swapped out."""
        fd = self._file()
        if self.use_scan and not (self.read_small and end - start <= _READ_PAGES * PAGE):
            return self._scan(fd, start, end)
        return self._read(fd, start, end)

    @staticmethod
    def _scan(fd: int, start: int, end: int) -> list[tuple[int, int]]:
        vec = (_Region * _VEC)()
        out: list[tuple[int, int]] = []
        while start < end:
            arg = _ScanArg(
                size=ctypes.sizeof(_ScanArg),
                start=start,
                end=end,
                vec=ctypes.addressof(vec),
                vec_len=_VEC,
                category_inverted=_PAGE_IS_FILE,
                category_mask=_PAGE_IS_FILE,
                category_anyof_mask=_PAGE_IS_PRESENT | _PAGE_IS_SWAPPED,
                return_mask=_PAGE_IS_FILE,
            )
            n = _ioctl(fd, _PAGEMAP_SCAN, ctypes.addressof(arg))
            if n < 0:
                err = ctypes.get_errno()
                raise OSError(err, f"PAGEMAP_SCAN failed: {os.strerror(err)}")
            out.extend((vec[i].start, vec[i].end) for i in range(n))
            if arg.walk_end <= start:
                break
            start = arg.walk_end
        return out

    @staticmethod
    def _read(fd: int, start: int, end: int) -> list[tuple[int, int]]:
        n = (end - start) // PAGE
        raw = os.pread(fd, n * 8, (start // PAGE) * 8)
        if len(raw) != n * 8:  # a page not reported would be taken for clean
            raise OSError(f"/proc/self/pagemap gave {len(raw)} bytes for {n} pages")
        # bit 63 present, 62 swapped, 61 file page or shared anonymous
        if n <= _READ_PAGES:
            pages = [
                p
                for p, e in enumerate(struct.unpack(f"<{n}Q", raw))
                if e >> 62 and not (e >> 61) & 1
            ]
        else:
            import numpy as np  # a long range where PAGEMAP_SCAN is missing

            e = np.frombuffer(raw, dtype="<u8")
            one = np.uint64(1)
            flag = ((e >> np.uint64(63)) | (e >> np.uint64(62))) & ~(e >> np.uint64(61)) & one
            pages = np.flatnonzero(flag).tolist()
        out: list[tuple[int, int]] = []
        for p in pages:
            a = start + p * PAGE
            if out and out[-1][1] == a:
                out[-1] = (out[-1][0], a + PAGE)
            else:
                out.append((a, a + PAGE))
        return out


_pagemap = _Pagemap()
os.register_at_fork(after_in_child=_pagemap.after_fork)
_supported: bool | None = None


def _probe(pm: _Pagemap) -> bool:
    """Whether ``pm`` reports a written page of a private shmem mapping as
    dirty, and an untouched or read page as clean, and whether dropping the
    dirty page shows the file's bytes again."""
    fd = os.memfd_create("tensordepot-probe", os.MFD_CLOEXEC)
    base = 0
    try:
        os.ftruncate(fd, 3 * PAGE)
        os.pwrite(fd, b"\x01" * (3 * PAGE), 0)
        base = _mmap(None, 3 * PAGE, _PROT_READ | _PROT_WRITE, _MAP_PRIVATE, fd, 0, "probe")
        ctypes.string_at(base, 16)  # page 0 read: mapped, clean
        ctypes.memset(base + PAGE, 7, 16)  # page 1 written: a private copy
        if pm.dirty(base, base + 3 * PAGE) != [(base + PAGE, base + 2 * PAGE)]:
            return False
        if _libc.madvise(base + PAGE, PAGE, _MADV_DONTNEED):
            return False
        restored = ctypes.string_at(base + PAGE, 16) == b"\x01" * 16
        return restored and not pm.dirty(base, base + 3 * PAGE)
    except OSError:
        return False
    finally:
        if base:
            _libc.munmap(base, 3 * PAGE)
        os.close(fd)


def supported() -> bool:
    """Whether kept mappings can be used here (checked once per process)."""
    global _supported
    if _supported is None:
        _pagemap.read_small = False
        scan = _probe(_pagemap)  # no PAGEMAP_SCAN before Linux 6.7
        _pagemap.use_scan = False
        read = _probe(_pagemap)
        # Both truthful: small ranges read, long ones scanned.
        _pagemap.use_scan, _pagemap.read_small = scan, scan and read
        _supported = scan or read
    return _supported


def locked_now() -> bool:
    """Whether a mapping made now would be locked (``mlockall(MCL_FUTURE)``):
    then a kept map would be copied whole as it is mapped."""
    page = _mmap(None, PAGE, _PROT_READ, _MAP_PRIVATE | _MAP_ANONYMOUS, -1, 0, "probe")
    try:
        # MADV_DONTNEED fails (EINVAL) on a locked page; on this untouched
        # anonymous page it is a no-op otherwise.
        return bool(_libc.madvise(page, PAGE, _MADV_DONTNEED) != 0)
    finally:
        _libc.munmap(page, PAGE)


class KeptMap:
    """The whole of one segment, mapped private once, lent range by range."""

    _base = 0  # 0 until mapped: nothing to unmap
    retired = False  # its pages may be locked copies: it lends nothing more

    def __init__(self, file: SegmentFile, pagemap: _Pagemap | None = None) -> None:
        self.file, self.name = file, file.name
        self._len = max(-(-file.size // PAGE) * PAGE, PAGE)
        self._pm = pagemap or _pagemap
        self._base = _mmap(
            None, self._len, _PROT_READ | _PROT_WRITE, _MAP_PRIVATE, file.fd, 0, file.name
        )
        # The lent ranges, (start, end), sorted; they never share bytes.  One
        # list, so that each change is one step a signal cannot split (Ctrl-C
        # raises between steps, never inside ``list.insert``).
        self._spans: list[tuple[int, int]] = []
        self._lock = threading.Lock()
        self._returned: collections.deque[tuple[int, int]] = collections.deque()

    def __del__(self) -> None:  # after every Lent (they hold the map)
        if self._base:
            try:
                _libc.munmap(self._base, self._len)
            except Exception:  # at interpreter exit, libc may be gone
                pass

    def lend(self, offset: int, nbytes: int) -> Lent | None:
        """``[offset, offset + nbytes)`` as a ``Lent``, or None where it
        shares bytes, or a dirty page, with a range lent now (the caller
        maps a fresh window)."""
        if nbytes <= 0 or offset < 0 or offset + nbytes > self.file.size or self.retired:
            return None
        hi = offset + nbytes
        first, last = offset // PAGE, (hi - 1) // PAGE
        # Never wait for the lock: one that a signal left held (a Ctrl-C
        # between its acquire and the block) would hang every later get;
        # a busy map is a fresh window instead.
        if not self._lock.acquire(blocking=False):
            return None
        try:
            self._drain()
            spans = self._spans
            i = bisect.bisect_left(spans, (offset, hi))
            before = spans[i - 1] if i else None
            after = spans[i] if i < len(spans) else None
            if (before and before[1] > offset) or (after and after[0] < hi):
                return None
            # The first page is checked always (one pagemap read): dirty under
            # no other lent range, it breaks the invariant, as locking the
            # map does (even when unlocked since), and the map is retired.
            if self._dirty(first, first + 1):
                if not (
                    (before and (before[1] - 1) // PAGE == first)
                    or (after and after[0] // PAGE == first)
                ):
                    self.retired = True
                return None
            if last != first and after and after[0] // PAGE == last and self._dirty(last, last + 1):
                return None
            # Interrupted from here until the Lent exists, the range stays
            # listed as lent: never lent again, never unsafe.
            spans.insert(i, (offset, hi))
            lent = Lent(self, offset, nbytes)
        finally:
            self._lock.release()
        if self._returned:
            self._give_back()
        return lent

    def settle(self) -> None:
        """Handle returns still queued (the client's background thread calls
        this every few seconds, in case a return found the map busy)."""
        self._give_back()

    def lent(self) -> list[tuple[int, int]]:
        """The ranges lent now."""
        with self._lock:
            self._drain()
            return list(self._spans)

    def _dirty(self, p0: int, p1: int) -> list[tuple[int, int]]:
        return self._pm.dirty(self._base + p0 * PAGE, self._base + p1 * PAGE)

    def _give_back(self, span: tuple[int, int] | None = None) -> None:
        if span is not None:
            self._returned.append(span)
        while self._returned and self._lock.acquire(blocking=False):
            try:
                self._drain()
            finally:
                self._lock.release()

    def _drain(self) -> None:
        """Handle queued returns (the lock is held).  A range's private pages
        are dropped before it leaves the list, so that an interruption in
        between leaves it listed (covered), never a dirty page uncovered."""
        spans = self._spans
        while self._returned:
            span = self._returned.popleft()
            i = bisect.bisect_left(spans, span)
            lo, hi = span
            p0, p1 = lo // PAGE, -(-hi // PAGE)
            # Edge pages another lent range shares stay as they are: that
            # range's own return scans them.
            if i and (spans[i - 1][1] - 1) // PAGE == p0:
                p0 += 1
            if i + 1 < len(spans) and spans[i + 1][0] // PAGE == p1 - 1:
                p1 -= 1
            if (
                p0 < p1
                and not self.retired
                and not all(self._drop(a, b) for a, b in self._dirty(p0, p1))
            ):
                continue  # a private page stays: the range stays covered, never lent again
            del spans[i]

    def _drop(self, a: int, b: int) -> bool:
        """Make ``[a, b)`` map the segment's pages again; False if it may
        still hold private copies.  ``MADV_DONTNEED`` fails (EINVAL) on locked
        pages (``mlock``, ``mlockall``): then the map is retired, and the
        range is mapped afresh in place all the same (``MAP_FIXED`` replaces
        the old pages, locked or not), so the stray write leaves this
        process's memory; that can fail too (``RLIMIT_MEMLOCK``)."""
        if _libc.madvise(a, b - a, _MADV_DONTNEED) == 0:
            return True
        self.retired = True
        try:
            _mmap(
                a,
                b - a,
                _PROT_READ | _PROT_WRITE,
                _MAP_PRIVATE | _MAP_FIXED,
                self.file.fd,
                a - self._base,
                self.name,
            )
        except OSError:  # the old pages may be gone too: never lend this range again
            return False
        return True

    def __repr__(self) -> str:
        return f"KeptMap({self.name!r}, {self._len} bytes, {len(self._spans)} lent)"


class Lent:
    """``[offset, offset + nbytes)`` of a ``KeptMap``, read like a reader
    window; returned to the map once no view references it."""

    __slots__ = ("_kept", "address", "name", "offset", "size")

    def __init__(self, kept: KeptMap, offset: int, nbytes: int) -> None:
        self._kept, self.offset = kept, offset
        self.address = kept._base + offset
        self.name, self.size = kept.name, nbytes

    def __del__(self) -> None:
        try:
            self._kept._give_back((self.offset, self.offset + self.size))
        except Exception:  # at interpreter exit
            pass

    def __repr__(self) -> str:
        return f"Lent({self.name!r}, size={self.size}, at=0x{self.address:x})"


def lend_or_map(kept: Any, file: SegmentFile, offset: int, nbytes: int) -> Any:
    """A reader view source for ``[offset, offset + nbytes)``: lent from
    ``kept`` when it can be, else a fresh private window."""
    lent = kept.lend(offset, nbytes) if kept is not None else None
    return lent if lent is not None else file.window(offset, nbytes, writable=False)
