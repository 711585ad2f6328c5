"""Pooled, pre-faulted memory: where the broker places tensors.

One pool per device: POSIX shared memory for the CPU, CUDA blocks for each
GPU (``segment_factory`` makes the segments; the logic here is the same).
Tensors are aligned ranges inside large *pool segments*; a tensor larger
than ``dedicated_threshold`` gets a *dedicated* segment of its own.  Freed
ranges and freed dedicated segments stay allocated (their tmpfs pages warm)
so the next put into them runs at memory bandwidth.  Free memory beyond
``warm_bytes`` is returned to the kernel, and the sum of all segments never
exceeds ``max_memory``: when a new segment would not fit, warm free segments
are unlinked first, and only then does ``alloc`` raise ``PoolExhausted``.
Live data is never evicted.

Memory that a process the broker cannot vouch for may still map (a lapsed
session's leases, an expired unpublished write) is *retired*: the range is
never handed to another tensor while it is retired.  The rest of its segment
stays in use; the range comes back (``unretire``) if the process that held it
says its views are gone, and a segment that holds nothing but retired ranges
is unlinked (the kernel frees the pages when the last mapping goes).

Creating a segment (``posix_fallocate`` runs at about 1 s per GiB) is split
from placing a block so that the broker can create segments off its event
loop: ``try_alloc`` places a block in existing memory or returns None;
``plan`` + ``reserve`` account for a new segment; ``create`` makes it (in any
thread); ``add`` hands it to the pool and ``take`` places the block in it.
``alloc`` does all of that in one call for callers that may block.
"""

from __future__ import annotations

import bisect
import errno
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field

from ._base import Segment
from ._posix import PosixSegment, random_name

MiB = 1 << 20
_PAGE = 4096
_HUGE = 2 * MiB


class PoolExhausted(MemoryError):
    """An allocation does not fit in the pool's memory limit.  ``cause`` says
    which fix applies: ``"limit"`` (the tensor alone is larger than the
    limit), ``"in_use"`` (live tensors fill the limit), ``"segment"`` (the
    tensor would fit, a whole new pooled segment does not), ``"device"``
    (the memory itself is full: /dev/shm, the GPU) or ``"other"``."""

    def __init__(self, why: str, cause: str = "other") -> None:
        super().__init__(why)
        self.cause = cause

    def fix(self, limit: str, segment: str, device: str) -> str:
        """What to do, for this cause: ``limit`` and ``segment`` are the flags
        that set the pool's limit and its segment size, ``device`` says
        where its memory comes from."""
        return {
            "limit": f"the tensor alone is larger than the limit: start the broker with a larger "
            f"{limit}, or split the tensor",
            "segment": f"free tensors with delete(), or start the broker with a smaller {segment} "
            f"(or a larger {limit})",
            "device": f"{device} itself is full (other programs use it too): free memory there, "
            f"or make it larger, or start the broker with a {limit} that fits in it",
        }.get(self.cause, f"free tensors with delete(), or start the broker with a larger {limit}")


def _describe(factory: Callable[..., Segment]) -> str:
    """What a factory's segments are, for messages: "shared-memory", "CUDA", ..."""
    kind = getattr(factory, "kind", "")
    return {"posix": "shared-memory ", "cuda": "CUDA "}.get(kind, "")


def fitted_segment_size(segment_size: int, max_memory: int) -> int:
    """``segment_size``, or where that is more than ``max_memory`` (a pool
    that could make no segment at all), a quarter of ``max_memory`` in whole
    pages: room for several segments and for tensors placed on their own."""
    if segment_size <= max_memory:
        return segment_size
    return max(_PAGE, max_memory // 4 // _PAGE * _PAGE)


def _round_up(n: int, to: int) -> int:
    return (n + to - 1) // to * to


@dataclass(eq=False)
class _Seg:
    seg: Segment
    dedicated: bool
    used: int = 0  # bytes reserved by live blocks, retired ones included
    # Free ranges as parallel sorted lists of offsets and sizes.
    free_off: list[int] = field(default_factory=list)
    free_len: list[int] = field(default_factory=list)
    seq: int = 0  # creation order, for returning the oldest warm memory first
    retired: int = 0  # bytes of retired blocks in it

    @property
    def size(self) -> int:
        return self.seg.size

    @property
    def name(self) -> str:
        return self.seg.name


@dataclass(eq=False)
class Block:
    """A range of a segment that holds one tensor version."""

    segment: str
    offset: int
    nbytes: int  # what the tensor needs
    size: int  # what is reserved (aligned)
    _seg: _Seg | None = None
    refs: int = 1  # versions sharing this block (the broker's count; the pool ignores it)
    # Holders the broker cannot vouch for (a lapsed session's leases): while any
    # remain, freeing the block retires it instead.
    stale: int = 0
    retired: bool = False
    device: str = "cpu"  # the pool's device: "cpu" or "cuda:GPU-<uuid>"


class Pool:
    """Places tensors in broker-owned segments of one device (POSIX shared
    memory by default).  Not thread-safe: the broker calls it from its event
    loop only."""

    def __init__(
        self,
        prefix: str,
        *,
        max_memory: int,
        segment_size: int = 256 * MiB,
        warm_bytes: int | None = None,
        align: int = 256,
        mode: int = 0o600,
        gid: int | None = None,
        prefault: bool = True,
        segment_factory: Callable[..., Segment] = PosixSegment,
        unlinker: Callable[[Segment], None] | None = None,
        device: str = "cpu",
    ) -> None:
        if segment_size <= 0 or segment_size % _PAGE:
            raise ValueError("segment_size must be a positive multiple of 4096")
        self.prefix = prefix
        self.max_memory = max_memory
        self.segment_size = fitted_segment_size(segment_size, max_memory)
        self.dedicated_threshold = segment_size // 2
        self.warm_bytes = max_memory if warm_bytes is None else warm_bytes
        self.align = align
        self._mode, self._gid, self._prefault = mode, gid, prefault
        self._factory = segment_factory
        self.device = device
        self._segs: dict[str, _Seg] = {}
        self._seq = itertools.count()
        self.reserved = 0  # bytes in all segments
        self.used = 0  # bytes reserved by live blocks
        self.retired = 0  # bytes of retired blocks in segments not yet unlinked
        self.retired_total = 0  # bytes ever retired
        self.pending = 0  # bytes of segments reserved but not yet added
        # Unlinking a large tmpfs file frees its pages and takes time: the
        # broker passes a function that does it in a worker thread.
        self._unlinker = unlinker or (lambda seg: seg.unlink())
        self.on_drop: Callable[[str], None] | None = None  # told each segment name it unlinks

    # -- queries ---------------------------------------------------------
    @property
    def segments(self) -> int:
        return len(self._segs)

    def segment_names(self) -> list[str]:
        return list(self._segs)

    def warm_free(self) -> int:
        return self.reserved - self.pending - self.used

    # -- allocation ------------------------------------------------------
    def _size(self, nbytes: int) -> int:
        if nbytes < 0:
            raise ValueError("nbytes must be >= 0")
        return max(_round_up(nbytes, self.align), self.align)

    def alloc(self, nbytes: int) -> Block:
        """Reserve ``nbytes`` (0 is allowed), creating a segment here if needed.
        Raises PoolExhausted."""
        blk = self.try_alloc(nbytes)
        if blk is not None:
            return blk
        size, dedicated = self.plan(nbytes)
        self.reserve(size, nbytes)
        try:
            seg = self.create(size)
        except BaseException:
            self.unreserve(size)
            raise
        return self.take(self.add(seg, dedicated), nbytes)

    def try_alloc(self, nbytes: int) -> Block | None:
        """A block in memory that already exists, or None."""
        size = self._size(nbytes)
        if size > self.dedicated_threshold:
            return self._reuse_dedicated(nbytes)
        for s in self._segs.values():
            if not s.dedicated:
                blk = self._take(s, nbytes, size)
                if blk is not None:
                    return blk
        return None

    def try_alloc_many(self, sizes: list[int]) -> list[Block] | None:
        """A block for each of ``sizes`` in memory that already exists, or None
        (and nothing taken).  Small blocks go back to back into one free range
        when one holds them all (one search for the batch); each is freed on its own."""
        aligned = [self._size(n) for n in sizes]
        small = [i for i, a in enumerate(aligned) if a <= self.dedicated_threshold]
        out: list[Block | None] = [None] * len(sizes)
        if len(small) > 1:
            total = sum(aligned[i] for i in small)
            for seg in self._segs.values():
                if seg.dedicated:
                    continue
                first = self._take(seg, 0, total)
                if first is not None:
                    off, name, dev = first.offset, seg.name, self.device
                    for i in small:
                        out[i] = Block(name, off, sizes[i], aligned[i], seg, device=dev)
                        off += aligned[i]
                    break
        for i, n in enumerate(sizes):
            if out[i] is None:
                blk = self.try_alloc(n)
                if blk is None:
                    for b in out:
                        if b is not None:
                            self.free(b)  # never handed out: safe to reuse at once
                    return None
                out[i] = blk
        return out  # type: ignore[return-value]

    def plan(self, nbytes: int) -> tuple[int, bool]:
        """(segment size, dedicated) of the segment a new ``nbytes`` block needs."""
        size = self._size(nbytes)
        if size > self.dedicated_threshold:
            return _round_up(nbytes, _HUGE), True
        return self.segment_size, False

    def reserve(self, size: int, need: int | None = None) -> None:
        """Count a segment of ``size`` against ``max_memory`` before it exists,
        unlinking warm free segments if that makes room; ``need``: the bytes
        of the tensor it is for.  Raises PoolExhausted."""
        need = size if need is None else need
        if size > self.max_memory:
            raise PoolExhausted(
                f"a {size} byte segment is larger than the whole memory limit ({self.max_memory} "
                "bytes)",
                "segment" if size == self.segment_size else "limit",
            )
        if self.reserved + size > self.max_memory:
            self._shrink(self.max_memory - size, keep_one=False)
        if self.reserved + size > self.max_memory:
            room = self.max_memory - self.used - self.pending
            if size == self.segment_size and self._size(need) <= room:
                raise PoolExhausted(
                    f"{room} bytes are left under the limit, but a new segment takes {size} "
                    f"bytes (the segment size)",
                    "segment",
                )
            raise PoolExhausted(
                f"need {size} more bytes but {self.used} of {self.max_memory} bytes are in use "
                f"by live tensors" + (f" and {self.retired} are retired" if self.retired else ""),
                "in_use",
            )
        self.reserved += size
        self.pending += size

    def unreserve(self, size: int) -> None:
        """Undo ``reserve`` for a segment that could not be created."""
        self.reserved -= size
        self.pending -= size

    def create(self, size: int) -> Segment:
        """Make a segment (pre-faulted: slow).  Safe to call from any thread."""
        try:
            return self._factory(
                random_name(self.prefix),
                size,
                mode=self._mode,
                gid=self._gid,
                prefault=self._prefault,
            )
        except OSError as exc:
            full = exc.errno in (errno.ENOSPC, errno.ENOMEM)
            raise PoolExhausted(
                f"could not create a {size} byte {_describe(self._factory)}segment: {exc}",
                "device" if full else "other",
            ) from exc

    def add(self, seg: Segment, dedicated: bool) -> _Seg:
        """Hand a segment made by ``create`` (after ``reserve``) to the pool."""
        self.pending -= seg.size
        s = _Seg(seg, dedicated, seq=next(self._seq))
        if not dedicated:
            s.free_off, s.free_len = [0], [seg.size]
        self._segs[s.name] = s
        return s

    def take(self, s: _Seg, nbytes: int) -> Block:
        """Place a block in the segment ``add`` just returned."""
        if s.dedicated:
            return self._claim_dedicated(s, nbytes)
        blk = self._take(s, nbytes, self._size(nbytes))
        assert blk is not None, "a new pool segment holds any pooled block"
        return blk

    def prewarm(self, nbytes: int) -> None:
        """Create pool segments up front until ``nbytes`` of pool space exist."""
        have = sum(s.size for s in self._segs.values() if not s.dedicated)
        while have < nbytes and self.reserved + self.segment_size <= self.max_memory:
            self.reserve(self.segment_size)
            try:
                seg = self.create(self.segment_size)
            except BaseException:
                self.unreserve(self.segment_size)
                raise
            self.add(seg, dedicated=False)
            have += self.segment_size

    def _reuse_dedicated(self, nbytes: int) -> Block | None:
        size = _round_up(nbytes, _HUGE)
        # Reuse the smallest warm free dedicated segment that fits without
        # wasting more than a quarter of it.
        best: _Seg | None = None
        for s in self._segs.values():
            if (
                s.dedicated
                and s.used == 0
                and not s.retired
                and size <= s.size <= size + size // 4
                and (best is None or s.size < best.size)
            ):
                best = s
        return None if best is None else self._claim_dedicated(best, nbytes)

    def _claim_dedicated(self, s: _Seg, nbytes: int) -> Block:
        s.free_off, s.free_len = [], []
        s.used = s.size
        self.used += s.size
        return Block(s.name, 0, nbytes, s.size, s, device=self.device)

    def _take(self, s: _Seg, nbytes: int, size: int) -> Block | None:
        for i, length in enumerate(s.free_len):  # first fit keeps low offsets busy
            if length >= size:
                off = s.free_off[i]
                if length == size:
                    del s.free_off[i], s.free_len[i]
                else:
                    s.free_off[i] += size
                    s.free_len[i] -= size
                s.used += size
                self.used += size
                return Block(s.name, off, nbytes, size, s, device=self.device)
        return None

    # -- freeing ---------------------------------------------------------
    def _unhook(self, blk: Block) -> _Seg:
        s = blk._seg
        if s is None or self._segs.get(s.name) is not s:
            raise ValueError(f"block {blk} is not live in this pool")
        blk._seg = None
        return s

    def free(self, blk: Block) -> None:
        """Return a block.  Its memory stays warm, up to ``warm_bytes``.
        A block with stale holders is retired instead."""
        if blk.stale:
            self.retire(blk)
            return
        s = self._unhook(blk)
        self._give_back(s, blk)

    def _give_back(self, s: _Seg, blk: Block) -> None:
        if s.dedicated:
            s.used = 0
            self.used -= s.size
        else:
            self._insert_free(s, blk.offset, blk.size)
            s.used -= blk.size
            self.used -= blk.size
        if s.retired and s.used == s.retired:
            self._drop(s)  # nothing but retired ranges: let the kernel have it when they unmap
        self._shrink(self.used + self.warm_bytes)

    def retire(self, blk: Block) -> None:
        """Keep a block that some process may still map: its bytes are not
        handed to another tensor until ``unretire``.  The rest of its segment
        stays in use; a segment left with only retired ranges is unlinked."""
        s = blk._seg
        if s is None or self._segs.get(s.name) is not s:
            raise ValueError(f"block {blk} is not live in this pool")
        if blk.retired:
            return
        blk.retired = True
        s.retired += blk.size
        self.retired += blk.size
        self.retired_total += blk.size
        if s.dedicated or s.used == s.retired:
            self._drop(s)

    def unretire(self, blk: Block) -> None:
        """The process that held a retired block says no view of it is left:
        reuse it.  A block whose segment is gone already is forgotten."""
        s = blk._seg
        if not blk.retired or s is None or self._segs.get(s.name) is not s:
            return
        blk.retired = False
        blk.stale = 0
        s.retired -= blk.size
        self.retired -= blk.size
        blk._seg = None
        self._give_back(s, blk)

    def _insert_free(self, s: _Seg, off: int, size: int) -> None:
        i = bisect.bisect_left(s.free_off, off)
        # Coalesce with the neighbours so fragmentation stays bounded.
        if i > 0 and s.free_off[i - 1] + s.free_len[i - 1] == off:
            i -= 1
            s.free_len[i] += size
        else:
            s.free_off.insert(i, off)
            s.free_len.insert(i, size)
        if i + 1 < len(s.free_off) and s.free_off[i] + s.free_len[i] == s.free_off[i + 1]:
            s.free_len[i] += s.free_len[i + 1]
            del s.free_off[i + 1], s.free_len[i + 1]

    def _shrink(self, target: int, *, keep_one: bool = True) -> None:
        """Unlink wholly free segments, dedicated and oldest first, until
        ``reserved <= target``.  With ``keep_one``, one free pool segment stays
        so small puts stay warm; quota pressure passes ``keep_one=False``."""
        if self.reserved <= target:
            return  # every free calls this: the common case costs no sort
        for s in sorted(self._segs.values(), key=lambda s: (not s.dedicated, s.seq)):
            if self.reserved <= target:
                return
            if s.used:
                continue
            if keep_one and not s.dedicated and self._pool_segments_free() <= 1:
                continue
            self._drop(s)

    def _pool_segments_free(self) -> int:
        return sum(1 for s in self._segs.values() if not s.dedicated and s.used == 0)

    def _drop(self, s: _Seg) -> None:
        del self._segs[s.name]
        self.reserved -= s.size
        self.used -= s.used  # only retired ranges can be left in a dropped segment
        self.retired -= s.retired
        self._unlinker(s.seg)
        if self.on_drop is not None:
            self.on_drop(s.name)

    def close(self) -> None:
        """Unlink every segment, here and now (broker shutdown)."""
        for s in list(self._segs.values()):
            del self._segs[s.name]
            s.seg.unlink()
        self.reserved = self.used = self.retired = self.pending = 0
