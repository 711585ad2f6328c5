"""The shared-memory lane's rings (shm/_ring.py): records cross in order,
wrap at the end, wait for room, and whatever the other side scribbles into
the buffer is refused as RingCorrupt, never followed, never looped on."""

from __future__ import annotations

import mmap
import os
import random
import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tensordepot.shm._ring import HEADER, SKIP, Reader, RingCorrupt, Writer, ring_bytes

SIZE = 256


def _pair(size: int = SIZE, offset: int = 0) -> tuple[bytearray, Writer, Reader]:
    buf = bytearray(offset + ring_bytes(size))
    return buf, Writer(buf, offset, size), Reader(buf, offset, size)


def test_records_cross_in_order_and_wrap_at_the_end() -> None:
    rng = random.Random(7)
    _, w, r = _pair(offset=64)
    sent: list[bytes] = []
    got: list[bytes] = []
    for _ in range(2000):  # the counters go round the ring many times
        if rng.random() < 0.55:
            payload = os.urandom(rng.randrange(0, w.most() // 2))
            if w.put(payload):
                sent.append(payload)
        else:
            taken = r.take()
            if taken is not None:
                got.append(taken)
    while (taken := r.take()) is not None:
        got.append(taken)
    assert got == sent and len(sent) > 500


def test_a_full_ring_says_no_until_the_reader_takes() -> None:
    _, w, r = _pair()
    n = 0
    while w.put(b"x" * 40):
        n += 1
    assert n == SIZE // 48  # 8 bytes of header, 40 of payload
    assert r.take() == b"x" * 40
    assert w.put(b"y" * 40)
    assert r.take() == b"x" * 40


def test_a_record_larger_than_the_ring_is_refused_with_its_limit() -> None:
    _, w, _ = _pair()
    assert w.put(b"z" * w.most())
    with pytest.raises(ValueError, match=f"at most {SIZE // 2 - 8}"):
        w.put(b"z" * (w.most() + 1))


def test_the_largest_record_fits_an_empty_ring_wherever_its_counters_stand() -> None:
    # Each round leaves the counters 8 bytes further on, and the ring empty.
    _, w, r = _pair()
    for k in range(SIZE // 8 + 2):
        assert w.put(b"s" * (8 * (k % 7)))
        assert r.take() == b"s" * (8 * (k % 7))
        big = bytes([k % 256]) * w.most()
        assert w.put(big), k
        assert r.take() == big


def test_small_records_one_at_a_time_keep_to_the_first_bytes() -> None:
    size = 4096  # starts again at 0 past its first 1,024 bytes (REWIND, a quarter here)
    buf, w, r = _pair(size)
    for k in range(1000):  # 40 KB in all: ten times round a ring without rewinds
        assert w.put([b"ab", bytearray(b"cd"), memoryview(b"e" * (k % 50))])
        assert r.take() == b"abcd" + b"e" * (k % 50)
    # The largest record takes 64 bytes: nothing was written past 1,024 + 64.
    assert not any(buf[HEADER + 1024 + 64 :]) and any(buf[HEADER + 1000 : HEADER + 1024 + 64])


def test_a_rewound_ring_still_takes_records_before_its_skip_is_read() -> None:
    size = 4096
    _, w, r = _pair(size)
    for _ in range(30):  # 40-byte records to past the rewind mark (1,024)
        assert w.put(b"a" * 32)
        assert r.take() == b"a" * 32
    sent = [bytes([k]) * 32 for k in range(20)]  # 800 bytes, none taken yet
    for rec in sent:
        assert w.put(rec)
    assert [r.take() for _ in sent] == sent


def test_a_record_in_parts_is_the_parts_back_to_back() -> None:
    import array

    _, w, r = _pair()
    floats = array.array("f", [1.5, 2.5])  # a buffer of 4-byte items: written as its bytes
    assert w.put([b"head", floats, memoryview(b"tail")])
    assert r.take() == b"head" + floats.tobytes() + b"tail"


def test_sizes_and_places_that_cannot_hold_a_ring_are_refused() -> None:
    for size in (0, 32, 100, 384):
        with pytest.raises(ValueError, match="power of two"):
            ring_bytes(size)
    with pytest.raises(ValueError, match="does not fit"):
        Reader(bytearray(ring_bytes(SIZE) - 1), 0, SIZE)
    with pytest.raises(ValueError, match="does not fit"):
        Writer(bytearray(ring_bytes(SIZE) + 8), 4, SIZE)


def _u64(buf: bytearray, at: int, value: int) -> None:
    struct.pack_into("<Q", buf, at, value)


def _u32(buf: bytearray, at: int, value: int) -> None:
    struct.pack_into("<I", buf, at, value)


@pytest.mark.parametrize(
    ("scribble", "says"),
    [
        (lambda b: _u64(b, 64, SIZE + 8), "unread"),  # tail past a whole ring
        (lambda b: _u64(b, 64, 12), "unread"),  # tail not on a record's boundary
        (lambda b: _u64(b, 64, (1 << 64) - 8), "unread"),  # tail behind head
        (lambda b: _u32(b, HEADER, 1 << 31), "record of"),  # a length past what is unread
        (lambda b: _u32(b, HEADER + 4, 1), "field 1"),  # the reserved word
        (lambda b: _u32(b, HEADER, SKIP), "skip"),  # a skip that is not at the end
    ],
)
def test_a_scribbled_ring_is_refused_by_its_reader(scribble: object, says: str) -> None:
    buf, w, r = _pair()
    assert w.put(b"a" * 16) and w.put(b"b" * 16)
    scribble(buf)  # type: ignore[operator]
    with pytest.raises(RingCorrupt, match=says):
        r.take()


def test_a_scribbled_head_is_refused_by_the_writer_and_ignored_by_the_reader() -> None:
    buf, w, r = _pair()
    assert w.put(b"a" * 16)
    _u64(buf, 0, 3)  # the reader's counter, written by someone else
    with pytest.raises(RingCorrupt, match="reader says"):
        w.put(b"b")
    assert r.take() == b"a" * 16  # the reader keeps its own count


def test_two_skips_in_a_row_are_refused() -> None:
    buf, w, r = _pair()
    for _ in range(4):  # written before any is taken: they go on round the ring
        assert w.put(b"p" * 40)
    for _ in range(3):
        assert r.take() == b"p" * 40
    assert w.put(b"q" * 80)  # does not fit before the end: a skip, then the record at 0
    assert r.take() == b"p" * 40
    _u32(buf, HEADER, SKIP)
    with pytest.raises(RingCorrupt, match="two skips"):
        r.take()


def test_a_record_cut_in_half_is_not_read() -> None:
    """The writer stopped after the record's header: tail was never moved,
    so the reader sees nothing; a tail moved past half a record is refused."""
    buf, _, r = _pair()
    _u32(buf, HEADER, 100)  # a header, no tail
    assert r.take() is None
    _u64(buf, 64, 16)  # a tail that covers 16 of the record's 112 bytes
    with pytest.raises(RingCorrupt, match="record of 100 bytes"):
        r.take()


@settings(max_examples=300, deadline=None)
@given(st.binary(min_size=ring_bytes(64), max_size=ring_bytes(64)))
def test_random_bytes_give_records_none_or_ringcorrupt_and_end(raw: bytes) -> None:
    buf = bytearray(raw)
    r = Reader(buf, 0, 64)
    for _ in range(20):  # each call reads at most one skip and one record
        try:
            got = r.take()
        except RingCorrupt:
            return
        if got is None:
            return
        assert len(got) <= 64 - 8


def test_two_mappings_of_one_memfd_share_a_ring() -> None:
    """As the lane uses it: one memfd, mapped twice (the two processes' views)."""
    fd = os.memfd_create("tensordepot-ring-test", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, ring_bytes(SIZE))
        a = mmap.mmap(fd, ring_bytes(SIZE))
        b = mmap.mmap(fd, ring_bytes(SIZE))
        w, r = Writer(a, 0, SIZE), Reader(b, 0, SIZE)
        for i in range(100):
            assert w.put(b"%d" % i)
            assert r.take() == b"%d" % i
        w.release()
        r.release()
        a.close()
        b.close()
    finally:
        os.close(fd)
