"""Kept reader mappings (shm/_kept.py), on real segments in /dev/shm: a write
through a lent range never reaches a later lend, and a returned range's
private pages are dropped."""

from __future__ import annotations

import ctypes
import gc
import os
import secrets
import threading
from collections.abc import Iterator

import numpy as np
import pytest
from _harness import TEST_PREFIX, run_worker, shm_entries
from tensordepot.shm import PosixSegment, _kept
from tensordepot.shm._posix import PAGE, SegmentFile, byte_view


@pytest.fixture(
    params=[(True, False), (False, False), (True, True)],
    ids=["pagemap_scan", "pagemap_read", "pagemap_both"],
)
def pagemap(request: pytest.FixtureRequest) -> _kept._Pagemap:
    """Scanned, read, or (what a client uses where both are truthful) read
    for ranges of a few pages and scanned for longer ones."""
    use_scan, read_small = request.param
    pm = _kept._Pagemap(use_scan=use_scan, read_small=read_small)
    if not _kept._probe(pm) or (read_small and not _kept._probe(_kept._Pagemap(use_scan=False))):
        pytest.skip("this kernel has no PAGEMAP_SCAN" if use_scan else "no /proc/self/pagemap")
    return pm


@pytest.fixture
def seg() -> Iterator[tuple[PosixSegment, SegmentFile, np.ndarray]]:
    """A 16-page segment holding bytes 1, its reader file, and a shared
    writable view of it (what a producer writes through)."""
    prefix = f"{TEST_PREFIX}kept-{secrets.token_hex(4)}-"
    s = PosixSegment(prefix + "a", 16 * PAGE)
    try:
        f = SegmentFile(s.name, writable=False, trust={os.getuid()})
        wf = SegmentFile(s.name, writable=True, trust={os.getuid()})
        w = wf.window(0, wf.size, writable=True)
        shared = byte_view(w, 0, wf.size, writable=True)
        shared[:] = 1
        yield s, f, shared
        del shared, w, wf, f
        gc.collect()
    finally:
        s.unlink()
    assert shm_entries(prefix) == []


def read(lent: _kept.Lent) -> bytes:
    return ctypes.string_at(lent.address, lent.size)


def write(lent: _kept.Lent, value: int) -> None:
    """A stray write, as torch makes one into a read-only view."""
    ctypes.memset(lent.address, value, lent.size)


def test_a_write_through_a_returned_range_never_reaches_the_next_lend(seg, pagemap) -> None:
    _, f, _ = seg
    k = _kept.KeptMap(f, pagemap)
    a = k.lend(PAGE, 3 * PAGE)
    assert a is not None and read(a) == b"\x01" * (3 * PAGE)
    write(a, 9)
    assert read(a) == b"\x09" * (3 * PAGE)
    base = a.address
    assert pagemap.dirty(base, base + 3 * PAGE) == [(base, base + 3 * PAGE)]
    del a
    # Returned: its private pages are gone, so nothing of the write is left.
    assert k.lent() == [] and pagemap.dirty(base, base + 3 * PAGE) == []
    b = k.lend(PAGE, 3 * PAGE)
    assert b is not None and b.address == base and read(b) == b"\x01" * (3 * PAGE)


def test_the_next_lend_shows_what_the_segment_holds_now(seg, pagemap) -> None:
    """A range the broker reuses for another tensor reads the new bytes
    through the kept mapping, once the old range is returned."""
    _, f, shared = seg
    k = _kept.KeptMap(f, pagemap)
    a = k.lend(0, 4 * PAGE)
    assert a is not None
    read(a)
    write(a, 5)
    del a
    shared[: 4 * PAGE] = 3  # the producer's next tensor in the same bytes
    b = k.lend(0, 4 * PAGE)
    assert b is not None and read(b) == b"\x03" * (4 * PAGE)


def test_bytes_lent_now_are_not_lent_again(seg, pagemap) -> None:
    """Two gets of the same tensor while the first is held: the second is
    refused (the caller maps a fresh window), so a write through the first
    never shows in the second."""
    _, f, _ = seg
    k = _kept.KeptMap(f, pagemap)
    a = k.lend(2 * PAGE, 2 * PAGE)
    assert a is not None
    assert k.lend(2 * PAGE, 2 * PAGE) is None
    assert k.lend(3 * PAGE, 10) is None  # inside
    assert k.lend(PAGE, PAGE + 1) is None  # overlaps the first byte
    assert k.lend(4 * PAGE - 1, 2) is None  # overlaps the last byte
    fresh = _kept.lend_or_map(k, f, 2 * PAGE, 2 * PAGE)
    assert not isinstance(fresh, _kept.Lent)
    write(a, 8)
    assert ctypes.string_at(fresh.address, 2 * PAGE) == b"\x01" * (2 * PAGE)
    b = k.lend(4 * PAGE, PAGE)  # next to it, no shared byte
    assert b is not None and read(b) == b"\x01" * PAGE
    assert k.lent() == [(2 * PAGE, 4 * PAGE), (4 * PAGE, 5 * PAGE)]
    del a, b, fresh
    assert k.lent() == []


def test_a_page_shared_by_small_tensors_is_dropped_only_once_none_is_lent(seg, pagemap) -> None:
    """Three small tensors in one page.  A write through the first copies the
    page; while another of them is lent the copy stays (dropping it would undo
    the writer's own write), and a new tensor in that page is not lent from the
    copy, which holds the bytes from before it was written."""
    _, f, shared = seg
    k = _kept.KeptMap(f, pagemap)
    a, b = k.lend(0, 100), k.lend(100, 100)
    assert a is not None and b is not None
    write(a, 7)
    page = a.address
    del a
    assert pagemap.dirty(page, page + PAGE) == [(page, page + PAGE)]  # b still lent
    assert read(b) == b"\x01" * 100
    shared[200:300] = 4  # the producer's new tensor in the same page
    assert k.lend(200, 100) is None  # its page is a stale private copy
    fresh = _kept.lend_or_map(k, f, 200, 100)
    assert ctypes.string_at(fresh.address, 100) == b"\x04" * 100
    del b
    assert pagemap.dirty(page, page + PAGE) == []
    c = k.lend(200, 100)
    assert c is not None and read(c) == b"\x04" * 100
    del c, fresh


def test_a_return_while_the_map_is_busy_is_handled_by_the_next_call(seg, pagemap) -> None:
    """A Lent's finalizer may run while the map's lock is held (garbage
    collection inside lend): the return waits in a queue, never blocks."""
    _, f, _ = seg
    k = _kept.KeptMap(f, pagemap)
    a = k.lend(0, PAGE)
    assert a is not None
    write(a, 6)
    page = a.address
    with k._lock:
        del a  # would deadlock if the finalizer waited for the lock
        assert list(k._returned) == [(0, PAGE)]
    assert k.lent() == [] and pagemap.dirty(page, page + PAGE) == []


def test_every_way_of_asking_finds_the_same_private_pages() -> None:
    """/proc/self/pagemap read entry by entry (a few pages), read in bulk (a
    long range) and PAGEMAP_SCAN agree on which pages of a private mapping
    hold copies: written pages, not read or untouched ones."""
    prefix = f"{TEST_PREFIX}kept-{secrets.token_hex(4)}-"
    n = 64  # past _READ_PAGES: the bulk read
    s = PosixSegment(prefix + "a", n * PAGE)
    try:
        f = SegmentFile(s.name, writable=True, trust={os.getuid()})
        os.pwrite(f.fd, b"\x01" * (n * PAGE), 0)
        k = _kept.KeptMap(f, _kept._Pagemap(use_scan=False))
        lent = k.lend(0, n * PAGE)
        assert lent is not None
        base = lent.address
        ctypes.string_at(base, n * PAGE)  # every page read: present, clean
        written = [0, 1, 2, 7, 17, 40, 41, n - 1]
        for p in written:
            ctypes.memset(base + p * PAGE + 5, 9, 3)
        want = [
            (base, base + 3 * PAGE),
            (base + 7 * PAGE, base + 8 * PAGE),
            (base + 17 * PAGE, base + 18 * PAGE),
            (base + 40 * PAGE, base + 42 * PAGE),
            (base + (n - 1) * PAGE, base + n * PAGE),
        ]
        ways = {
            "read": _kept._Pagemap(use_scan=False),
            "scan": _kept._Pagemap(use_scan=True),
            "both": _kept._Pagemap(use_scan=True, read_small=True),
        }
        if not _kept._probe(ways["scan"]):
            del ways["scan"], ways["both"]  # no PAGEMAP_SCAN here
        assert _kept._probe(ways["read"]), "no /proc/self/pagemap here"
        for how, pm in ways.items():
            assert pm.dirty(base, base + n * PAGE) == want, how
            for lo, hi in [(0, 3), (0, 16), (6, 9), (3, 7), (30, 46)]:  # short and long ranges
                part = [
                    (max(a, base + lo * PAGE), min(b, base + hi * PAGE))
                    for a, b in want
                    if a < base + hi * PAGE and b > base + lo * PAGE
                ]
                assert pm.dirty(base + lo * PAGE, base + hi * PAGE) == part, (how, lo, hi)
        del lent, k, f
        gc.collect()
    finally:
        s.unlink()
    assert shm_entries(prefix) == []


def test_a_pagemap_that_reports_nothing_turns_kept_mappings_off() -> None:
    """The probe is what keeps a kernel that hides private copies (or a
    sandbox's fake /proc) from lending stale pages."""

    class Blind(_kept._Pagemap):
        def dirty(self, start: int, end: int) -> list[tuple[int, int]]:
            return []

    assert _kept._probe(_kept._Pagemap()) or _kept._probe(_kept._Pagemap(use_scan=False))
    assert not _kept._probe(Blind())


@pytest.mark.parametrize("how", ["scan", "read"])
def test_a_forked_child_drops_its_own_copies(how: str) -> None:
    """The pagemap is this process's: after fork the child reads its own, and
    its writes stay its own (in a worker: this process has threads)."""
    prefix = f"{TEST_PREFIX}keptfork-{secrets.token_hex(4)}-"
    res = run_worker("kept_fork", prefix, how)
    assert res.stdout.strip() == "ok", res.stdout
    assert shm_entries(prefix) == []


def test_a_stale_copy_of_the_last_page_is_not_lent_either(seg, pagemap) -> None:
    """As above, with the lent neighbour after the new range."""
    _, f, shared = seg
    k = _kept.KeptMap(f, pagemap)
    b, a = k.lend(200, 100), k.lend(100, 100)
    assert a is not None and b is not None
    write(a, 7)
    del a
    shared[0:100] = 4
    assert k.lend(0, 100) is None
    del b
    c = k.lend(0, 100)
    assert c is not None and read(c) == b"\x04" * 100


def _mlock(address: int, size: int, lock: bool = True) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    fn = libc.mlock if lock else libc.munlock
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    if fn(address, size):
        pytest.skip(f"mlock refused here: {os.strerror(ctypes.get_errno())}")


def test_a_locked_range_is_remapped_when_returned_and_the_map_retired(seg, pagemap) -> None:
    """``MADV_DONTNEED`` fails on locked pages: the stray write is dropped by
    mapping the range afresh, and the map lends nothing more."""
    _, f, _ = seg
    k = _kept.KeptMap(f, pagemap)
    a = k.lend(PAGE, 3 * PAGE)
    assert a is not None
    base = a.address
    _mlock(base, 3 * PAGE)
    write(a, 9)
    del a
    assert pagemap.dirty(base, base + 3 * PAGE) == [], "the stray write stayed"
    assert ctypes.string_at(base, 3 * PAGE) == b"\x01" * (3 * PAGE)
    assert k.retired and k.lend(PAGE, 3 * PAGE) is None


def test_a_map_locked_once_is_retired_even_after_it_is_unlocked(seg, pagemap) -> None:
    """Locking a private mapping copies every page of it as it is then; a
    page copied under no lent range would show a dead tensor's bytes."""
    _, f, shared = seg
    k = _kept.KeptMap(f, pagemap)
    _mlock(k._base, 16 * PAGE)
    _mlock(k._base, 16 * PAGE, lock=False)
    shared[: 2 * PAGE] = 7  # the broker's next tensor in these bytes
    assert k.lend(0, 2 * PAGE) is None and k.retired


def test_a_lock_left_held_never_hangs_a_lend(seg, pagemap) -> None:
    """A Ctrl-C between a lock's acquire and its block can leave it held:
    a lend then maps a fresh window instead of waiting for ever."""
    _, f, _ = seg
    k = _kept.KeptMap(f, pagemap)
    k._lock.acquire()
    got: list[object] = []
    t = threading.Thread(target=lambda: got.append(k.lend(0, PAGE)), daemon=True)
    t.start()
    t.join(5)
    k._lock.release()
    t.join(5)
    assert got == [None] and not t.is_alive() and k.lend(0, PAGE) is not None
