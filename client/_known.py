"""The columns of a batch this client got whole, kept by their key, so that
the next answer of the same batch can leave them out.

A put_many's pack never changes its names, offsets and layouts, and the
broker names them by a key it gives to no other rows in its run
(``HandleColumns.key``, ``service/_registry/_packs.py``).  A consumer that
gets the same batch again and again (a handoff loop, a worker reading the
newest weights each step) sends the key it holds (``?known=``); an answer
of that pack's rows then carries only what changes: the versions, where the
pack lies and its lease.  What is kept here was checked when it came
(``check_columns``); a short answer is checked for what it carries
(``filled``), and its pack within its segment as any answer's
(``check_packs``).  A key is good only with the broker run that gave it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .._wire import HandleColumns
from ._extent import Layout, broken

MOST = 8  # batches kept per client: the oldest goes first


@dataclass(slots=True)
class Known:
    """One whole pack's columns as an answer gave them, checked; and the
    last answer of them that named the board's slots (``last``: the
    session it leased in, the filled columns), for ``_shmlane.again_many``."""

    instance: str  # the broker run whose key it is
    key: int
    names: list[str]
    pack: list[int]
    at: list[int]
    layouts: list[tuple[list[int], str, int]]
    layout: list[int]
    checked: list[Layout]  # check_columns' layouts
    lo: int  # where the first of the rows' bytes starts in the pack
    end: int  # where the last of them ends
    positions: dict[str, int]  # name -> its position (a TensorMap's, copied)
    last: tuple[str, HandleColumns] | None = None


Kept = dict[tuple[str, ...], Known]  # a client's (Core.known), by the names in their order


def known(kept: Kept, instance: str, names: list[str]) -> Known | None:
    """The columns kept for a get_many of ``names`` (in this order), if the
    broker run ``instance`` (the session's) gave them."""
    got = kept.get(tuple(names))
    return got if got is not None and got.instance == instance else None


def remember(kept: Kept, instance: str, cols: HandleColumns, checked: list[Layout]) -> Known | None:
    """Keep the columns of ``cols`` (checked: ``checked``) that broker run
    ``instance`` gave, if they are one whole pack's it named by a key."""
    if cols.key is None or not cols.names or len(cols.packs) != 1 or cols.others:
        return None
    sizes = [checked[m][2] for m in cols.layout]
    entry = Known(
        instance,
        cols.key,
        cols.names,
        cols.pack,
        cols.at,
        cols.layouts,
        cols.layout,
        checked,
        min(cols.at),
        max(map(int.__add__, cols.at, sizes)),
        {name: i for i, name in enumerate(cols.names)},
    )
    if len(kept) >= MOST:
        try:
            kept.pop(next(iter(kept)), None)
        except (StopIteration, RuntimeError):  # another thread's get_many changed it meanwhile
            pass
    kept[tuple(cols.names)] = entry
    return entry


def filled(entry: Known | None, cols: HandleColumns) -> HandleColumns:
    """A short answer (``cols``: no names, its ``key``) as the whole columns of
    ``entry``, after the checks of what it carries: a version per tensor and
    one pack, in its one segment, that holds every row's bytes."""
    n = 0 if entry is None else len(entry.names)
    what = f"a batch of {n} tensor(s)"
    if entry is None or cols.key != entry.key:
        raise broken(what, f"its answer leaves out the columns of key {cols.key}, not ours")
    if len(cols.versions) != n or len(cols.segments) != 1 or len(cols.packs) != 1:
        raise broken(
            what,
            f"its short answer has {len(cols.versions)} versions, {len(cols.segments)} "
            f"segments and {len(cols.packs)} packs, not {n}, 1 and 1",
        )
    j, offset, nbytes, _ = cols.packs[0]
    if j != 0 or offset < 0 or nbytes < entry.end:
        raise broken(
            what,
            f"its pack [{offset}, {offset}+{nbytes}) of segment {j} does not hold its "
            f"tensors' bytes (up to {entry.end})",
        )
    fields: dict[str, Any] = {
        "names": entry.names,
        "versions": cols.versions,
        "state": cols.state,
        "segments": cols.segments,
        "packs": cols.packs,
        "pack": entry.pack,
        "at": entry.at,
        "layouts": entry.layouts,
        "layout": entry.layout,
        "others": {},
        "key": entry.key,
        "slots": cols.slots,
    }
    return HandleColumns.model_construct(**fields)
