"""Unit tests of the per-process mappings, on real segments in /dev/shm."""

from __future__ import annotations

import os
import secrets
from collections.abc import Iterator

import pytest
from _harness import TEST_PREFIX, shm_entries
from tensordepot.shm import PosixSegment
from tensordepot.shm._posix import _POPULATE_STEP, PAGE, SegmentFile

MiB = 1 << 20


@pytest.fixture
def segment() -> Iterator[PosixSegment]:
    prefix = f"{TEST_PREFIX}posix-{secrets.token_hex(4)}-"
    # Not a whole number of populate steps, so the last step is a short one.
    seg = PosixSegment(prefix + "a", 2 * _POPULATE_STEP + 3 * PAGE)
    try:
        yield seg
    finally:
        seg.unlink()
    assert shm_entries(prefix) == []


def resident(address: int) -> int:
    """Bytes of the mapping at ``address`` that this process has faulted in (Rss)."""
    with open("/proc/self/smaps") as f:
        lines = f.read().splitlines()
    for i, line in enumerate(lines):
        if line.split("-", 1)[0] == f"{address:x}":
            for field in lines[i + 1 :]:
                if field.startswith("Rss:"):
                    return int(field.split()[1]) * 1024
    raise AssertionError(f"no mapping at 0x{address:x} in /proc/self/smaps")


@pytest.mark.parametrize("populate", [False, True])
def test_a_populated_writer_window_is_faulted_in_whole(
    segment: PosixSegment, populate: bool
) -> None:
    """A put's fill mapping is faulted in before the copy (in steps, so other
    threads never wait long for the mmap lock), every page of it; a plain
    window faults in nothing until it is touched."""
    f = SegmentFile(segment.name, writable=True, trust={os.getuid()})
    w = f.window(0, f.size, writable=True, populate=populate)
    try:
        assert resident(w.address) == (f.size if populate else 0)
    finally:
        del w, f
