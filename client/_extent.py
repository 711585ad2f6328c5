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
reach (a batch's handles through ``check_segment`` and
``check_allocations``, which pass in bulk only what it would pass).  What
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
        where = (cols.names[i], cols.versions[i], cols.segments[cols.segment[i]])
    what = where if isinstance(where, str) else f"{where[0]!r} v{where[1]} in segment {where[2]}"
    return TensorBroken(
        f"refusing the broker's handle for {what}: {problem}. Nothing was read or "
        f"written through it, and what the broker handed out is given back. {_FIX}"
    )


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


def check_segment(cols: HandleColumns, members: list[int], size: int) -> None:
    """``check_extent`` for the handles at ``members`` of a batch's columns,
    which all name one segment of ``size`` bytes.  The columns carry no
    strides (C order), and a batch repeats a few layouts: when every one has
    passed before and every tensor's bytes lie within the segment, they pass
    in bulk; otherwise each goes through ``check_extent``."""
    offsets, nbytes, shapes, dtypes = cols.offsets, cols.nbytes, cols.shapes, cols.dtypes
    if (
        all(offsets[i] >= 0 and nbytes[i] >= 0 and offsets[i] + nbytes[i] <= size for i in members)
        and {(nbytes[i], tuple(shapes[i]), None, dtypes[i]) for i in members} <= _GOOD.keys()
    ):
        return
    for i in members:
        check_extent((cols, i), size, offsets[i], nbytes[i], shapes[i], None, dtypes[i])


def check_allocations(
    cols: HandleColumns,
    sizes: Sequence[int],
    shapes: list[list[int]],
    dtypes: list[str],
    nbytes: list[int],
) -> None:
    """``check_extent`` for every allocation of a put_many whose columns
    passed ``check_columns`` and hold every handle: ``sizes`` of its
    segments; ``shapes``, ``dtypes`` and ``nbytes``, what each tensor asked
    for.  Allocations are C-ordered, so when each is the shape and dtype
    asked for, its byte count the asked tensor's, and its bytes within its
    segment, ``check_extent`` passes them all: that is found in a few bulk
    comparisons.  Otherwise each goes through ``check_extent``, which names
    the first that fails."""
    if (
        cols.shapes == shapes
        and cols.dtypes == dtypes
        and cols.nbytes == nbytes
        and max(map(len, shapes), default=0) <= MAX_NDIM
        and all(
            off >= 0 and off + n <= sizes[seg]
            for seg, off, n in zip(cols.segment, cols.offsets, nbytes, strict=True)
        )
    ):
        return
    for i, (seg, off, n) in enumerate(zip(cols.segment, cols.offsets, cols.nbytes, strict=True)):
        check_extent(
            (cols, i),
            sizes[seg],
            off,
            n,
            cols.shapes[i],
            None,
            cols.dtypes[i],
            (tuple(shapes[i]), dtypes[i]),
        )


def check_columns(cols: HandleColumns) -> None:
    """The columns of a batch's handles hold one entry per tensor, and each
    names a segment of the batch (or -1: its handle is in ``others``)."""
    n = len(cols.names)
    lengths = [
        len(c)
        for c in (
            cols.versions,
            cols.segment,
            cols.offsets,
            cols.nbytes,
            cols.shapes,
            cols.dtypes,
            cols.names if cols.leases is None else cols.leases,
        )
    ]
    what = f"a batch of {n} tensor(s)"
    if any(k != n for k in lengths):
        raise broken(what, f"its columns have {sorted(set(lengths))} entries, not {n} each")
    if not cols.others and (
        not n or (min(cols.segment) >= 0 and max(cols.segment) < len(cols.segments))
    ):
        return  # the usual batch: every handle in the columns, each naming a segment of it
    for i, j in enumerate(cols.segment):
        if not (-1 <= j < len(cols.segments)) or (j == -1) != (i in cols.others):
            raise broken(
                what, f"tensor {cols.names[i]!r} names segment {j} of {len(cols.segments)}"
            )
    if any(not 0 <= i < n for i in cols.others):
        raise broken(what, f"it has handles for positions {sorted(cols.others)} of {n}")
