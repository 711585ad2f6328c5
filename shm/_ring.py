"""A single-producer, single-consumer ring of records in shared memory, for
the shared-memory lane (docs/plan-lane.md): one side writes records, the
other reads them, through a buffer both map (a memfd) and no lock.

A ring of ``size`` bytes of data (a power of two, at least ``MIN_SIZE``)
starts at ``offset`` in its buffer and takes ``HEADER + size`` bytes:

* ``offset + 0``: ``head``, u64, the bytes the reader has consumed (only
  the reader writes it);
* ``offset + 64``: ``tail``, u64, the bytes the writer has published (only
  the writer writes it), each in its own cache line;
* ``offset + 128``: the data.

Both counters only grow (modulo 2**64): ``tail - head`` bytes are unread.
A record is a u32 payload length, a u32 that is 0, and the payload, padded
to 8 bytes; it never wraps: one that does not fit before the end follows a
skip mark (the length ``SKIP``) and starts again at 0, as does one
written into an empty ring past its first ``REWIND`` bytes when it fits
before the write position (the memory a ring touches is then about
``REWIND`` and its largest records, not its size).  The writer stores
the record's bytes before it stores ``tail`` (x86 keeps stores in order;
other CPUs would need a fence there).

The other side may write anything into the buffer at any time, or stop in
the middle of a record.  So each side keeps its own counter to itself and
reads only the other's, a record is copied out before it is checked, every
length is bounded by what the other side published and by the ring, and
whatever a well-behaved peer never writes raises ``RingCorrupt``: a
counter out of range, a record that does not fit, a skip that is not at
the end.  Nothing here waits, and a call reads at most one skip and one
record: garbage cannot make it loop.
"""

from __future__ import annotations

import struct
from typing import Any

HEADER = 128  # the two counters, a cache line each
MIN_SIZE = 64
SKIP = 0xFFFFFFFF  # a record's length: the rest of the ring is skipped
REWIND = 64 << 10  # an empty ring's writer starts again at 0 from here on (``Writer.put``)
_U64 = struct.Struct("<Q")
_REC = struct.Struct("<II")  # payload length, 0
_MOD = 1 << 64


Buffer = bytes | bytearray | memoryview


class RingCorrupt(Exception):
    """The other side wrote what a well-behaved peer never writes."""


def ring_bytes(size: int) -> int:
    """The bytes a ring of ``size`` bytes of data takes in its buffer."""
    _check_size(size)
    return HEADER + size


def _check_size(size: int) -> None:
    if size < MIN_SIZE or size & (size - 1):
        raise ValueError(f"a ring's size is a power of two of at least {MIN_SIZE}, not {size}")


def _padded(n: int) -> int:
    return 8 + ((n + 7) & ~7)


class _Side:
    def __init__(self, buf: Any, offset: int, size: int) -> None:
        _check_size(size)
        view = memoryview(buf).cast("B")
        if offset < 0 or offset % 8 or offset + HEADER + size > len(view):
            raise ValueError(
                f"a ring of {size} bytes at {offset} does not fit a buffer of {len(view)} bytes"
            )
        self._view = view
        self._head = offset  # where the counters are
        self._tail = offset + 64
        self._data = offset + HEADER
        self.size = size

    def _load(self, at: int) -> int:
        return int(_U64.unpack_from(self._view, at)[0])

    def _store(self, at: int, value: int) -> None:
        _U64.pack_into(self._view, at, value % _MOD)

    def release(self) -> None:
        """Let go of the buffer (a memoryview of it is kept until then)."""
        self._view.release()


class Reader(_Side):
    """The reading side of a ring: ``take`` the next record's payload."""

    def __init__(self, buf: Any, offset: int, size: int) -> None:
        super().__init__(buf, offset, size)
        self._consumed = self._load(self._head)  # ours: what the buffer says is not trusted later

    def take(self) -> bytes | None:
        """The next record's payload (a copy), or None when there is none
        yet; raises ``RingCorrupt`` for what no well-behaved writer writes."""
        head, size = self._consumed, self.size
        unread = (self._load(self._tail) - head) % _MOD
        if unread == 0:
            return None
        if unread > size or unread % 8:
            raise RingCorrupt(
                f"the ring's writer says {unread} bytes are unread, of a ring of {size}"
            )
        at = head % size
        length, zero = _REC.unpack_from(self._view, self._data + at)
        if length == SKIP:
            gap = size - at
            if gap >= unread:
                raise RingCorrupt(f"a skip of {gap} bytes at {at}, with {unread} unread")
            head += gap
            unread -= gap
            at = 0
            length, zero = _REC.unpack_from(self._view, self._data)
            if length == SKIP:
                raise RingCorrupt("two skips in a row")
        need = _padded(length)
        if zero or need > unread or at + need > size:
            raise RingCorrupt(
                f"a record of {length} bytes at {at} (field {zero}), with {unread} unread "
                f"in a ring of {size}"
            )
        start = self._data + at + 8
        payload = bytes(self._view[start : start + length])  # copied before anyone trusts it
        self._consumed = head = (head + need) % _MOD
        self._store(self._head, head)
        return payload


class Writer(_Side):
    """The writing side of a ring: ``put`` a record."""

    def __init__(self, buf: Any, offset: int, size: int) -> None:
        super().__init__(buf, offset, size)
        self._published = self._load(self._tail)

    def most(self) -> int:
        """The largest payload a record of this ring can carry, whatever
        its place: one of half the ring fits an empty ring wherever its
        counters stand (one larger may not fit before the end, nor after a
        skip to the start)."""
        return self.size // 2 - 8

    def put(self, payload: Buffer | list[Any]) -> bool:
        """Write one record, its payload given whole or as parts (written
        back to back, each bytes-like and C-contiguous); False when the
        ring has no room for it now.  Raises ``ValueError`` for a payload
        larger than ``most()``, and ``RingCorrupt`` when the reader's
        counter is out of range."""
        parts = [
            p if type(p) is bytes else memoryview(p).cast("B")
            for p in (payload if isinstance(payload, list) else [payload])
        ]
        n = sum(map(len, parts))
        if n > self.most():
            raise ValueError(
                f"a record of {n} bytes does not fit a ring of {self.size} (at most {self.most()})"
            )
        tail, size = self._published, self.size
        used = (tail - self._load(self._head)) % _MOD
        if used > size or used % 8:
            raise RingCorrupt(f"the ring's reader says {used} bytes are unread, of {size}")
        free = size - used
        need = _padded(n)
        at = tail % size
        # A record that does not fit before the end starts again at 0; so
        # does one written into an empty ring past its first ``REWIND``
        # bytes, where it can, so that a ring of small records keeps to its
        # first pages (a memfd's pages are only memory once written).  The
        # skip counts as unread until the reader passes it: ``REWIND`` bytes
        # at least stay free meanwhile.
        rewind = not used and need <= at >= min(REWIND, size // 4)
        gap = size - at if at + need > size or rewind else 0
        if gap + need > free:
            return False
        view, data = self._view, self._data
        if gap:
            _REC.pack_into(view, data + at, SKIP, 0)
            tail += gap
            at = 0
        _REC.pack_into(view, data + at, n, 0)
        at += data + 8
        for part in parts:
            view[at : at + len(part)] = part
            at += len(part)
        self._published = tail = (tail + need) % _MOD
        self._store(self._tail, tail)  # after the record's bytes: the reader may take it now
        return True
