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
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field

from ._base import Segment
from ._posix import PosixSegment, random_name

MiB = 1 << 20
_PAGE = 4096
_HUGE = 2 * MiB


class PoolExhausted(MemoryError):
    """An allocation does not fit in the pool's memory limit."""


def _describe(factory: Callable[..., Segment]) -> str:
    """What a factory's segments are, for messages: "shared-memory", "CUDA", ..."""
    kind = getattr(factory, "kind", "")
    return {"posix": "shared-memory ", "cuda": "CUDA "}.get(kind, "")


def _round_up(n: int, to: int) -> int:
    return (n + to - 1) // to * to


@dataclass(eq=False)
class _Seg:
    seg: Segment
    dedicated: bool
    used: int = 0  # bytes reserved by live blocks
    # Free ranges as parallel sorted lists of offsets and sizes.
    free_off: list[int] = field(default_factory=list)
    free_len: list[int] = field(default_factory=list)
    seq: int = 0  # creation order, for returning the oldest warm memory first

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
    device: str = "cpu"  # the pool's device: "cpu" or "cuda:GPU-<uuid>"


class Pool:
    """Places tensors in broker-owned segments of one device (POSIX shared
    memory by default).  Not thread-safe: the broker calls it from its event
    loop only."""

    def __init__(self, prefix: str, *, max_memory: int, segment_size: int = 256 * MiB,
                 warm_bytes: int | None = None, align: int = 256, mode: int = 0o600,
                 gid: int | None = None, prefault: bool = True,
                 segment_factory: Callable[..., Segment] = PosixSegment,
                 device: str = "cpu") -> None:
        if segment_size <= 0 or segment_size % _PAGE:
            raise ValueError("segment_size must be a positive multiple of 4096")
        self.prefix = prefix
        self.max_memory = max_memory
        self.segment_size = segment_size
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
        self.on_drop: Callable[[str], None] | None = None  # told each segment name it unlinks

    # -- queries ---------------------------------------------------------
    @property
    def segments(self) -> int:
        return len(self._segs)

    def segment_names(self) -> list[str]:
        return list(self._segs)

    def warm_free(self) -> int:
        return self.reserved - self.used

    # -- allocation ------------------------------------------------------
    def alloc(self, nbytes: int) -> Block:
        """Reserve ``nbytes`` (0 is allowed).  Raises PoolExhausted."""
        if nbytes < 0:
            raise ValueError("nbytes must be >= 0")
        size = max(_round_up(nbytes, self.align), self.align)
        if size > self.dedicated_threshold:
            return self._alloc_dedicated(nbytes)
        for s in self._segs.values():
            if not s.dedicated:
                blk = self._take(s, nbytes, size)
                if blk is not None:
                    return blk
        s = self._new_segment(self.segment_size, dedicated=False)
        blk = self._take(s, nbytes, size)
        assert blk is not None
        return blk

    def prewarm(self, nbytes: int) -> None:
        """Create pool segments up front until ``nbytes`` of pool space exist."""
        have = sum(s.size for s in self._segs.values() if not s.dedicated)
        while have < nbytes and self.reserved + self.segment_size <= self.max_memory:
            self._new_segment(self.segment_size, dedicated=False)
            have += self.segment_size

    def _alloc_dedicated(self, nbytes: int) -> Block:
        size = _round_up(nbytes, _HUGE)
        # Reuse the smallest warm free dedicated segment that fits without
        # wasting more than a quarter of it.
        best: _Seg | None = None
        for s in self._segs.values():
            if (s.dedicated and s.used == 0 and size <= s.size <= size + size // 4
                    and (best is None or s.size < best.size)):
                best = s
        if best is None:
            best = self._new_segment(size, dedicated=True)
        best.free_off, best.free_len = [], []
        best.used = best.size
        self.used += best.size
        return Block(best.name, 0, nbytes, best.size, best, device=self.device)

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

    def _new_segment(self, size: int, *, dedicated: bool) -> _Seg:
        if size > self.max_memory:
            raise PoolExhausted(
                f"a {size} byte segment is larger than the whole memory limit ({self.max_memory} bytes)"
            )
        if self.reserved + size > self.max_memory:
            self._shrink(self.max_memory - size, keep_one=False)
        if self.reserved + size > self.max_memory:
            raise PoolExhausted(
                f"need {size} more bytes but {self.used} of {self.max_memory} bytes are in use "
                f"by live tensors"
            )
        try:
            seg = self._factory(random_name(self.prefix), size, mode=self._mode, gid=self._gid,
                                prefault=self._prefault)
        except OSError as exc:
            raise PoolExhausted(
                f"could not create a {size} byte {_describe(self._factory)}segment: {exc}"
            ) from exc
        s = _Seg(seg, dedicated, seq=next(self._seq))
        if not dedicated:
            s.free_off, s.free_len = [0], [size]
        self._segs[s.name] = s
        self.reserved += size
        return s

    # -- freeing ---------------------------------------------------------
    def free(self, blk: Block) -> None:
        """Return a block.  Its memory stays warm, up to ``warm_bytes``."""
        s = blk._seg
        if s is None or self._segs.get(s.name) is not s:
            raise ValueError(f"block {blk} is not live in this pool")
        blk._seg = None
        if s.dedicated:
            s.used = 0
            self.used -= s.size
        else:
            self._insert_free(s, blk.offset, blk.size)
            s.used -= blk.size
            self.used -= blk.size
        self._shrink(self.used + self.warm_bytes)

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
        s.seg.unlink()
        if self.on_drop is not None:
            self.on_drop(s.name)

    def close(self) -> None:
        """Unlink every segment (broker shutdown)."""
        for s in list(self._segs.values()):
            self._drop(s)
        self.used = 0
