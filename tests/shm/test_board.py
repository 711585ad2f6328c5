"""The board of newest versions (``shm._board``) on its own: slots given
and taken back, what a reader's mapping shows, and what it refuses."""

from __future__ import annotations

import fcntl
import mmap
import os

import pytest
from tensordepot.shm._board import SEALS, SLOT, Board, BoardRefused, BoardView


def _view(b: Board) -> BoardView:
    return BoardView(os.dup(b.fd))


def test_a_reader_sees_what_the_broker_shows() -> None:
    b = Board(8)
    try:
        v = _view(b)
        slots = [b.slot() for _ in range(8)]
        assert sorted(slots) == list(range(8)) and b.slot() == -1, "eight slots, then none"
        b.show(slots[3], 41)
        b.show(slots[3], 1 << 62)
        assert v.newest(slots[3]) == 1 << 62 and v.newest(slots[4]) == 0
        b.free(slots[3])
        assert v.newest(slots[3]) == 0, "a freed slot shows no version"
        assert b.slot() == slots[3], "and goes to the next name"
        assert v.newest(-1) == 0 and v.newest(8) == 0 and v.newest(1 << 40) == 0
        b.show(-1, 5)  # a name without a slot: nothing shown
        b.free(-1)
        v.close()
        v.close()
    finally:
        b.close()
        b.close()


def test_no_reader_can_write_it() -> None:
    b = Board(8)
    try:
        b.show(0, 7)
        with pytest.raises(PermissionError):
            mmap.mmap(b.fd, 8 * SLOT)
        with pytest.raises(PermissionError):
            os.pwrite(b.fd, b"\x01" * SLOT, 0)
        with pytest.raises(PermissionError):
            os.truncate(f"/proc/self/fd/{b.fd}", 0)
        assert _view(b).newest(0) == 7
    finally:
        b.close()


def _memfd(size: int, seals: int) -> int:
    fd = os.memfd_create("t", os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, size)
    if seals:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
    return fd


@pytest.mark.parametrize(
    ("make", "why"),
    [
        (lambda: os.open("/dev/null", os.O_RDONLY), "not a memfd"),
        (lambda: _memfd(64, 0), "not sealed"),
        (lambda: _memfd(64, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW), "not sealed"),
        (lambda: _memfd(63, SEALS), "of 63 bytes"),
        (lambda: _memfd(0, SEALS), "of 0 bytes"),
    ],
)
def test_what_is_not_a_board_is_refused_and_closed(make: object, why: str) -> None:
    fd = make()  # type: ignore[operator]
    with pytest.raises(BoardRefused, match=why):
        BoardView(fd)
    with pytest.raises(OSError):
        os.fstat(fd)  # closed
