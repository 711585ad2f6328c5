"""Where a get_many's tensors are read: a window per segment, over the span
of the batch's tensors in it (``client/_batch.py``'s "Reader mappings").

The tensors of one batch share their segment's window and stay apart
because their bytes do not overlap: a write within one tensor's bytes
changes no other tensor's bytes, as a copy-on-write page holds the
neighbour's bytes unchanged.  Tensors whose bytes are the very same (tied
weights, a name given twice) are views of the same bytes of the window;
tensors whose bytes only overlap each get a window of their own
(``layout``).
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from .._errors import BrokerUnavailable
from .._wire import HandleColumns
from ..shm._posix import byte_view
from ._extent import Layout, check_packs

if TYPE_CHECKING:
    from ._core import Core
    from ._known import Known


def pack_window(
    client: Core, cols: HandleColumns, entry: Known
) -> tuple[list[int], list[tuple[Any, Any, int]]]:
    """``windows`` of columns filled from ``entry`` (one pack, in one
    segment, its rows in order, none overlapping the next: as they were
    checked when they came): one window over the rows' bytes."""
    segment = cols.segments[0]
    base = cols.packs[0][1]
    try:
        check_packs(cols, [client.segments.file(segment, False).size])
        window = _window(client, segment, base + entry.lo, entry.end - entry.lo)
    except OSError as exc:
        raise BrokerUnavailable(f"cannot map segment {segment}: {exc}") from exc
    return list(map(base.__add__, cols.at)), [window] * len(cols.names)


def windows(
    client: Core, cols: HandleColumns, layouts: list[Layout]
) -> tuple[list[int], list[tuple[Any, Any, int]]]:
    """Per tensor: its offset in its segment, and (its window, the window as
    flat uint8 arrays, writable and read-only, the segment offset the window
    starts at)."""
    packs, pack = cols.packs, cols.pack
    n = len(cols.names)
    size = [nb for _, _, nb in layouts]
    by_segment: dict[int, Sequence[int]] = {}
    if n and pack[0] >= 0 and pack.count(pack[0]) == n:  # the usual batch: one pack
        offsets = list(map(packs[pack[0]][1].__add__, cols.at))
        nbytes = list(map(size.__getitem__, cols.layout))
        by_segment[packs[pack[0]][0]] = range(n)
    else:
        # 0 for a tensor in no pack (a GPU tensor's whole handle is in cols.others)
        offsets = [packs[k][1] + a if k >= 0 else 0 for k, a in zip(pack, cols.at, strict=True)]
        nbytes = [size[m] if k >= 0 else 0 for k, m in zip(pack, cols.layout, strict=True)]
        for i, k in enumerate(pack):
            if k >= 0:
                by_segment.setdefault(packs[k][0], []).append(i)  # type: ignore[attr-defined]
    out: list[tuple[Any, Any, int]] = [(None, None, 0)] * n
    segment = ""
    try:
        sizes = []
        for segment in cols.segments:
            sizes.append(client.segments.file(segment, False).size)
        check_packs(cols, sizes)
        for j, members in by_segment.items():
            segment = cols.segments[j]
            shared, alone = layout(members, offsets, nbytes)
            if shared:
                if len(shared) == n:  # every tensor: their columns as they are
                    starts, lengths = offsets, nbytes
                else:
                    starts, lengths = [offsets[i] for i in shared], [nbytes[i] for i in shared]
                lo = min(starts)
                hi = max(map(operator.add, starts, lengths))
                window = _window(client, segment, lo, hi - lo)
                if len(shared) == n:
                    out = [window] * n
                else:
                    for i in shared:
                        out[i] = window
            for one in alone:  # the tensors of one range
                window = _window(client, segment, offsets[one[0]], nbytes[one[0]])
                for i in one:
                    out[i] = window
    except OSError as exc:
        raise BrokerUnavailable(f"cannot map segment {segment}: {exc}") from exc
    return offsets, out


def _window(client: Core, segment: str, lo: int, n: int) -> tuple[Any, Any, int]:
    w = client.segments.reader(segment, lo, n)
    flat = byte_view(w, 0, n, writable=True)  # private pages: see module doc
    return w, (flat, byte_view(w, 0, n, writable=False)), lo


def layout(
    members: Sequence[int], offsets: list[int], nbytes: list[int]
) -> tuple[Sequence[int], list[list[int]]]:
    """The tensors of one segment that may share a window, and the groups
    that each need one of their own: the tensors of one range of bytes (tied
    weights, a name given twice) are one; ranges that overlap without being
    the same may not share a window."""
    if len(members) == len(offsets):  # every tensor of the batch (a range): its columns
        starts = offsets
        ends = list(map(operator.add, offsets, nbytes))
    else:
        starts = [offsets[i] for i in members]
        ends = [offsets[i] + nbytes[i] for i in members]
    if all(map(operator.ge, starts[1:], ends)):  # the usual batch: in order, none overlapping
        return members, []
    # Out of order (a state dict whose large tensors each have a block of
    # their own, its small ones one pack): none overlapping once sorted.
    order = sorted(range(len(starts)), key=starts.__getitem__)
    if all(map(operator.ge, map(starts.__getitem__, order[1:]), map(ends.__getitem__, order))):
        return members, []
    spans: dict[tuple[int, int], list[int]] = {}
    for i in members:
        spans.setdefault((offsets[i], offsets[i] + nbytes[i]), []).append(i)
    ranges = sorted(spans)
    shared: list[int] = []
    alone: list[list[int]] = []
    end = -1
    for k, (lo, hi) in enumerate(ranges):
        nxt = ranges[k + 1][0] if k + 1 < len(ranges) else None
        if lo < end or (nxt is not None and nxt < hi):
            alone.append(spans[lo, hi])
        else:
            shared.extend(spans[lo, hi])
        end = max(end, hi)
    return shared, alone
