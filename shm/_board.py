"""The broker's board of newest versions (docs/plan-lane.md, "The board"):
one memfd of u64 slots, each the number of the newest published version of
one name (0: none), which the broker writes whenever a name's newest
changes and every lane's client maps read-only.

A client that still holds the lease of a version it got (its views are
gone, the release not sent yet) reads the name's slot: while the slot
still shows that version, a get of the name would answer with it, so the
client makes the tensor again under that lease, with no request at all.

Why one word is enough.  The broker writes a slot before it answers the
request that changed the name (a put, a publish, a delete, an expiry), so
a get that starts after that answer reads the new number.  A slot freed
with its name (written 0) and given to another name later never shows an
old number again: a new name's versions start above every number a
dropped name ever had (``_records.Records``), so a slot that shows ``v``
shows the name the client got ``v`` of.

Read-only for clients.  The memfd is sealed against growing, shrinking,
new seals and future writes (``F_SEAL_FUTURE_WRITE``) after the broker has
mapped it writable, so no other process can map it writable, write it,
reopen it writable through ``/proc``, or ``mprotect`` its mapping: what one
client reads, no other client can have written.  It holds numbers only,
no names.
"""

from __future__ import annotations

import fcntl
import mmap
import operator
import os

from ._lanemem import sealed_size

SLOTS = 1 << 16  # names with a slot at a time; names past it get none (no reuse: a request each)
SLOT = 8
F_SEAL_FUTURE_WRITE = getattr(fcntl, "F_SEAL_FUTURE_WRITE", 0x10)  # Linux 5.1
SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL | F_SEAL_FUTURE_WRITE


class BoardRefused(Exception):
    """What was passed as a board is not one: why."""


class Board:
    """The broker's side: the memfd, mapped writable, and its free slots."""

    def __init__(self, slots: int = SLOTS) -> None:
        fd = os.memfd_create("tensordepot-board", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(fd, slots * SLOT)
            self._map = mmap.mmap(fd, slots * SLOT)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)
        except BaseException:
            os.close(fd)
            raise
        self.fd = fd
        self.words = memoryview(self._map).cast("Q")  # slot -> number
        self._free = list(range(slots - 1, -1, -1))

    def slot(self) -> int:
        """A free slot (showing 0), or -1 if none is left."""
        return self._free.pop() if self._free else -1

    def show(self, slot: int, number: int) -> None:
        """Slot ``slot`` now shows ``number`` (0: no published version)."""
        if slot >= 0:
            self.words[slot] = number

    def free(self, slot: int) -> None:
        """Its name is gone: the slot shows 0 and may go to another name."""
        if slot >= 0:
            self.words[slot] = 0
            self._free.append(slot)

    def close(self) -> None:
        if self.fd < 0:
            return
        self.words.release()
        self._map.close()
        os.close(self.fd)
        self.fd = -1


class BoardView:
    """A client's read-only mapping of the board passed with its lane."""

    def __init__(self, fd: int) -> None:
        """Map the board ``fd`` read-only and close ``fd``; raises
        ``BoardRefused`` (``fd`` closed) for anything that is not one."""
        try:
            try:
                size = sealed_size(fd, SEALS, "the board")
            except ValueError as exc:
                raise BoardRefused(str(exc)) from None
            if size <= 0 or size % SLOT or size > SLOTS * SLOT:
                raise BoardRefused(f"a board of {size} bytes")
            self._map = mmap.mmap(fd, size, prot=mmap.PROT_READ)
        finally:
            os.close(fd)
        self._words = memoryview(self._map).cast("Q")
        self.slots = size // SLOT

    def newest(self, slot: int) -> int:
        """What slot ``slot`` shows (0 for one outside the board)."""
        if not 0 <= slot < self.slots:
            return 0
        return self._words[slot]

    def newest_many(self, slots: list[int]) -> list[int]:
        """What each of ``slots`` shows (all 0 if one is outside the board)."""
        if not slots:
            return []
        if min(slots) < 0 or max(slots) >= self.slots:
            return [0] * len(slots)
        if len(slots) == 1:
            return [self._words[slots[0]]]
        return list(operator.itemgetter(*slots)(self._words))

    def close(self) -> None:
        if self.slots:
            self.slots = 0
            self._words.release()
            self._map.close()
