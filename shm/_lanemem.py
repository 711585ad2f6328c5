"""A shared-memory lane's memory and bells (docs/plan-lane.md): one memfd
with a header page and two rings (``_ring``), and two eventfds that wake
each side.  The broker makes them (``LaneMemory.create``) and passes the
three descriptors over the session's own unix socket (``fds``,
``SCM_RIGHTS``); the client takes them (``LaneMemory.adopt``), which
checks what it was given before it maps anything.

Layout: the header page (``MAGIC``, the layout version, the two rings'
sizes), then the request ring (the client writes, the broker reads), then
the answer ring (the broker writes, the client reads).  The memfd is
sealed against growing and shrinking, so a mapping of it can never fault
past its end (SIGBUS), and against new seals; nothing of it has a name in
``/dev/shm``.

The broker marks the lane gone in its header page when it closes it
(``gone``): a client waiting for an answer stops waiting.

Bells: the client's (``BROKER``: it wakes the broker) and the broker's
(``CLIENT``); ringing adds 1, ``drain`` reads and clears, ``wait`` waits
for a ring up to a timeout.  Both are non-blocking and close-on-exec.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import select
import struct

from ._ring import Reader, Writer, ring_bytes
from ._sigint import interruptible

MAGIC = b"TDLANE01"
VERSION = 1
PAGE = 4096
_HEAD = struct.Struct("<8sIII")  # magic, version, request ring size, answer ring size
SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
MOST = 16 << 20  # the largest ring either side accepts
_GONE_AT = 64  # in the header page: a u32 the broker sets when it closes the lane
BROKER, CLIENT = 0, 1  # whose bell: the one that wakes the broker, the client's


class LaneRefused(Exception):
    """What was passed as a lane is not one this side can use: why."""


def lane_bytes(requests: int, answers: int) -> int:
    """The memfd's size for rings of these sizes."""
    return PAGE + ring_bytes(requests) + ring_bytes(answers)


class LaneMemory:
    """One lane's memfd, mapped, its two rings as this side uses them, and
    its two bells.  ``close`` gives everything back."""

    def __init__(self, memfd: int, bells: tuple[int, int], broker: bool) -> None:
        self._fds = [memfd, *bells]
        self._broker = broker  # the broker's side marks the lane gone when it closes it
        size = os.fstat(memfd).st_size
        self._map = mmap.mmap(memfd, size)
        _, _, req, ans = _HEAD.unpack_from(self._map, 0)  # checked by adopt, or written by create
        self.sizes = (req, ans)
        at = PAGE + ring_bytes(req)
        self.requests: Reader | Writer
        self.answers: Reader | Writer
        if broker:
            self.requests, self.answers = Reader(self._map, PAGE, req), Writer(self._map, at, ans)
        else:
            self.requests, self.answers = Writer(self._map, PAGE, req), Reader(self._map, at, ans)
        self.bells = bells

    @classmethod
    def create(cls, requests: int, answers: int) -> LaneMemory:
        """The broker's side of a new lane: the memfd, sealed, its header
        written, and two bells."""
        size = lane_bytes(requests, answers)  # raises for a size that is not a ring's
        fd = os.memfd_create("tensordepot-lane", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        bells: list[int] = []
        try:
            os.ftruncate(fd, size)
            with mmap.mmap(fd, size) as m:
                _HEAD.pack_into(m, 0, MAGIC, VERSION, requests, answers)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)
            for _ in range(2):
                bells.append(os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC))
            return cls(fd, (bells[0], bells[1]), broker=True)
        except BaseException:
            for f in [fd, *bells]:
                os.close(f)
            raise

    def fds(self) -> list[int]:
        """What the client is passed: the memfd and the two bells, in order."""
        return list(self._fds)

    @classmethod
    def adopt(cls, fds: list[int]) -> LaneMemory:
        """The client's side, from the descriptors the broker passed; raises
        ``LaneRefused`` (closing them) for anything that is not a lane."""
        try:
            if len(fds) != 3:
                raise LaneRefused(
                    f"a lane is 3 descriptors (a memfd and two bells), not {len(fds)}"
                )
            memfd = fds[0]
            try:
                size = sealed_size(memfd, SEALS, "the lane's memory")
            except ValueError as exc:
                raise LaneRefused(str(exc)) from None
            if size < PAGE or size > lane_bytes(MOST, MOST):
                raise LaneRefused(f"the lane's memory has {size} bytes")
            head = os.pread(memfd, _HEAD.size, 0)
            magic, version, req, ans = _HEAD.unpack(head)
            if magic != MAGIC or version != VERSION:
                raise LaneRefused(f"not a lane of this layout ({magic!r}, version {version})")
            try:
                need = lane_bytes(req, ans)
            except ValueError as exc:
                raise LaneRefused(str(exc)) from None
            if need != size or max(req, ans) > MOST:
                raise LaneRefused(f"rings of {req} and {ans} bytes in {size} bytes of memory")
            for bell in fds[1:]:
                if not _is_eventfd(bell):
                    raise LaneRefused("a lane's bell is not an eventfd")
            return cls(memfd, (fds[1], fds[2]), broker=False)
        except BaseException:
            for f in fds:
                os.close(f)
            raise

    # -- bells ----------------------------------------------------------------------
    def ring(self, whose: int) -> None:
        """Wake the side ``whose`` bell this is (``BROKER`` or ``CLIENT``)."""
        os.eventfd_write(self.bells[whose], 1)

    def drain(self, whose: int) -> int:
        """The rings of ``whose`` bell since the last drain (0: none), cleared."""
        try:
            return os.eventfd_read(self.bells[whose])
        except BlockingIOError:
            return 0

    @interruptible  # a Ctrl-C cuts it (shm._sigint): its caller cleans up
    def wait(self, whose: int, timeout: float | None) -> bool:
        """Wait up to ``timeout`` seconds (None: for ever) for ``whose`` bell;
        whether it rang (it is drained)."""
        poller = select.poll()  # not select(): a descriptor may be past 1024
        poller.register(self.bells[whose], select.POLLIN)
        ready = poller.poll(None if timeout is None else max(0, int(timeout * 1000)))
        return bool(ready) and self.drain(whose) > 0

    def gone(self) -> bool:
        """Whether the broker closed this lane (``close`` on its side): its
        client's requests will not be answered."""
        return bool(self._fds) and self._map[_GONE_AT] != 0

    def close(self) -> None:
        """Unmap and close every descriptor (idempotent).  The broker's side
        marks the lane gone first, for a client still waiting on it."""
        if not self._fds:
            return
        if self._broker:
            self._map[_GONE_AT] = 1
        self.requests.release()
        self.answers.release()
        self._map.close()
        for f in self._fds:
            os.close(f)
        self._fds = []


def sealed_size(fd: int, seals: int, what: str) -> int:
    """The size of memfd ``fd``, which another process passed, if it
    carries every one of ``seals``; raises ``ValueError`` saying why not
    (``what`` names it)."""
    try:
        has = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError:
        raise ValueError(f"{what} is not a memfd") from None
    if has & seals != seals:
        raise ValueError(f"{what} is not sealed (seals {has:#x}, not {seals:#x})")
    return os.fstat(fd).st_size


def _is_eventfd(fd: int) -> bool:
    try:
        return os.readlink(f"/proc/self/fd/{fd}") == "anon_inode:[eventfd]"
    except OSError:
        return False
