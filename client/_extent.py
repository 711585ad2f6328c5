"""What the client believes of a handle: only what it has checked against
the segment it maps.

A handle says where a tensor lives (a segment, an offset, a byte count) and
what it is (shape, strides, dtype).  A view made from it reads, or writes,
every byte its shape and strides reach from its offset.  A handle that
reaches outside its bytes would make that view read another tensor's bytes
(or write into them), or, past the end of the segment or before its start,
fault: SIGBUS past the end of the file, SIGSEGV past the mapping.  A real
broker never sends one; a broken or impostor one may.  So before a window
is mapped, every handle passes ``check_extent``: the one check, which get,
get_many, empty, put and put_many (``Client`` and ``AsyncClient`` alike)
reach (a batch's handles through ``check_columns``, which passes each
layout through it once and checks each tensor's bytes within its pack, and
``check_packs``, each pack within its segment).  What
fails raises ``TensorBroken``, and the operation gives back what the broker
handed out (the lease, or the allocation).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .._errors import TensorBroken
from .._wire import MAX_NDIM, Handle, HandleColumns
from ..shm import DType, UnsupportedDType, dtype_from_name

_FIX = (
    "A tensordepot broker never sends that: check who serves the broker's socket, and "
    "that the client and the broker are of the same version"
)


# What a handle is, for a message: the handle, its (name, version, segment),
# a batch's columns and a position in them, or words.  Made into words only
# when a check fails.
Where = tuple[str, int, str] | tuple[HandleColumns, int] | str | Handle


def describe(h: Handle) -> tuple[str, int, str]:
    return (h.name, h.version, h.segment)


def broken(where: Where, problem: str) -> TensorBroken:
    if isinstance(where, Handle):
        where = describe(where)
    elif isinstance(where, tuple) and isinstance(where[0], HandleColumns):
        cols, i = where
        where = (cols.names[i], cols.versions[i], _segment_of(cols, i))
    what = where if isinstance(where, str) else f"{where[0]!r} v{where[1]} in segment {where[2]}"
    return TensorBroken(
        f"refusing the broker's handle for {what}: {problem}. Nothing was read or "
        f"written through it, and what the broker handed out is given back. {_FIX}"
    )


def _segment_of(cols: HandleColumns, i: int) -> str:
    """The segment tensor ``i`` of checked columns names, in words (any columns)."""
    try:
        return cols.segments[cols.packs[cols.pack[i]][0]]
    except (IndexError, TypeError):
        return "(none)"


_DTYPES: dict[str, DType] = {}  # dtype names seen so far
# Layouts that passed (nbytes, shape, strides, dtype): whether the elements
# reach only the tensor's own bytes depends on nothing else, so the same
# layout passes again (where those bytes lie is checked every time).
_GOOD: dict[tuple[Any, ...], DType] = {}


def dtype_of(where: Where, name: str) -> DType:
    """The dtype a handle names (cached: a batch names a few, many times)."""
    dt = _DTYPES.get(name)
    if dt is None:
        try:
            dt = _DTYPES[name] = dtype_from_name(name)
        except (UnsupportedDType, TypeError) as exc:
            raise broken(where, f"its dtype {name!r} is unknown ({exc})") from None
    return dt


def check_extent(
    where: Where,
    size: int,
    offset: int,
    nbytes: int,
    shape: Sequence[int],
    strides: Sequence[int] | None,
    dtype: str,
    asked: tuple[tuple[int, ...], str] | None = None,
) -> DType:
    """The dtype of a tensor at ``offset`` of a segment of ``size`` bytes,
    ``nbytes`` long, with ``shape`` and ``strides`` (in elements; None: C
    order), once every byte its elements reach is known to lie within its
    bytes, and those within the segment; ``asked``: the (shape, dtype) a put
    asked for, which an allocation must be.  Raises ``TensorBroken``.

    The numbers are ints: the wire models validated the answer.  Every get
    and every tensor of a batch passes here, so the usual case is one loop
    over the dimensions and a few comparisons."""
    if asked is not None and (tuple(shape) != asked[0] or dtype != asked[1]):
        raise broken(
            where,
            f"it is {list(shape)} of {dtype!r}, not the {list(asked[0])} of {asked[1]!r} asked for",
        )
    if offset < 0 or nbytes < 0 or offset + nbytes > size:
        raise broken(
            where,
            f"its bytes [{offset}, {offset}+{nbytes}) are not within its segment of {size} bytes",
        )
    key = (nbytes, tuple(shape), None if strides is None else tuple(strides), dtype)
    dt = _GOOD.get(key)
    if dt is not None:  # the same layout passed before: a loop of gets, a state dict's shapes
        return dt
    dt = _DTYPES.get(dtype) or dtype_of(where, dtype)
    item = dt.itemsize
    if len(shape) > MAX_NDIM:
        raise broken(where, f"its shape {list(shape)} is not up to {MAX_NDIM} dimensions >= 0")
    if strides is not None and len(strides) != len(shape):
        raise broken(where, f"its strides {list(strides)} do not match its shape {list(shape)}")
    # The element count, and the lowest and the highest element the strides
    # reach from the first (they matter only when no dimension is 0).
    count, low, high = 1, 0, 0
    for i, d in enumerate(shape):
        if d < 0:
            raise broken(where, f"its shape {list(shape)} is not up to {MAX_NDIM} dimensions >= 0")
        count *= d
        if strides is not None:
            step = (d - 1) * strides[i]
            if step > 0:
                high += step
            else:
                low += step
    if count * item != nbytes:
        raise broken(
            where, f"its shape {list(shape)} of {dt.name} is {count * item} bytes, not its {nbytes}"
        )
    if count and (low < 0 or (high + 1) * item > nbytes):
        raise broken(
            where,
            f"its strides {list(strides or ())} reach bytes "
            f"[{low * item}, {(high + 1) * item}) of its {nbytes}",
        )
    if len(_GOOD) >= 4096:
        _GOOD.clear()
    _GOOD[key] = dt
    return dt


Layout = tuple[tuple[int, ...], DType, int]  # (shape, dtype, nbytes) of a batch's tensors


def check_columns(cols: HandleColumns) -> list[Layout]:
    """The columns of a batch's handles, checked before anything is mapped:
    one entry per tensor; each names a pack and a layout of the batch (or -1
    for both: its handle is in ``others``); each pack a segment of the
    batch; each layout passes ``check_extent`` (its elements are its
    bytes); each tensor's bytes lie within its pack.  (That each pack lies
    within its segment, ``check_packs`` finds once the segments are open.)
    Returns the layouts as (shape, dtype, nbytes)."""
    n = len(cols.names)
    what = f"a batch of {n} tensor(s)"
    lengths = [len(c) for c in (cols.versions, cols.pack, cols.at, cols.layout)]
    if any(k != n for k in lengths):
        raise broken(what, f"its columns have {sorted({n, *lengths})} entries, not {n} each")
    nseg = len(cols.segments)
    for k, (j, offset, nbytes, _) in enumerate(cols.packs):
        if not 0 <= j < nseg or offset < 0 or nbytes < 0:
            raise broken(
                what, f"its pack {k} names bytes [{offset}, {offset}+{nbytes}) of segment {j}"
            )
    layouts: list[Layout] = []
    for m, (shape, dtype, nbytes) in enumerate(cols.layouts):
        dt = check_extent(f"layout {m} of {what}", nbytes, 0, nbytes, shape, None, dtype)
        layouts.append((tuple(shape), dt, nbytes))
    pack, at, layout = cols.pack, cols.at, cols.layout
    npack, nlay = len(cols.packs), len(layouts)
    if not cols.others and (not n or (min(pack) >= 0 and max(pack) < npack)):
        if n and (min(layout) < 0 or max(layout) >= nlay):
            raise broken(what, f"its tensors name layouts {sorted(set(layout))} of {nlay}")
    else:
        for i, (k, m) in enumerate(zip(pack, layout, strict=True)):
            if not (-1 <= k < npack) or (k == -1) != (i in cols.others) or (k == -1) != (m == -1):
                raise broken(what, f"tensor {cols.names[i]!r} names pack {k} of {npack}")
            if not -1 <= m < nlay:
                raise broken(what, f"tensor {cols.names[i]!r} names layout {m} of {nlay}")
        if any(not 0 <= i < n for i in cols.others):
            raise broken(what, f"it has handles for positions {sorted(cols.others)} of {n}")
    sizes = [p[2] for p in cols.packs]
    for i, (k, a, m) in enumerate(zip(pack, at, layout, strict=True)):
        if k >= 0 and not (a >= 0 and a + layouts[m][2] <= sizes[k]):
            raise broken(
                (cols, i),
                f"its bytes [{a}, {a}+{layouts[m][2]}) are not within its pack of {sizes[k]} bytes",
            )
    return layouts


def check_packs(cols: HandleColumns, sizes: Sequence[int]) -> None:
    """The packs of a batch's columns lie within their segments, of
    ``sizes`` bytes (in the order of ``cols.segments``); their tensors lie
    within them (``check_columns``)."""
    for k, (j, offset, nbytes, _) in enumerate(cols.packs):
        if offset + nbytes > sizes[j]:
            raise broken(
                (cols, cols.pack.index(k)) if k in cols.pack else f"pack {k} of a batch",
                f"its pack's bytes [{offset}, {offset}+{nbytes}) are not within "
                f"its segment of {sizes[j]} bytes",
            )


def check_allocations(
    cols: HandleColumns,
    shapes: list[list[int]],
    dtypes: list[str],
    nbytes: list[int],
) -> None:
    """What a put_many allocated, after ``check_columns``, is what it asked
    for: tensor ``i`` is of ``shapes[i]`` and ``dtypes[i]``, ``nbytes[i]``
    long; the first that is not is named."""
    lays, layout = cols.layouts, cols.layout
    if (
        [lays[m][0] for m in layout] == shapes
        and [lays[m][1] for m in layout] == dtypes
        and [lays[m][2] for m in layout] == nbytes
    ):
        return
    for i, m in enumerate(layout):
        shape, dtype, n = lays[m]
        if shape != list(shapes[i]) or dtype != dtypes[i] or n != nbytes[i]:
            raise broken(
                (cols, i),
                f"it is {shape} of {dtype!r} ({n} bytes), not the {list(shapes[i])} of "
                f"{dtypes[i]!r} ({nbytes[i]} bytes) asked for",
            )
